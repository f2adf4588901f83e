"""A model written as libraries write theirs (Hugging Face transformers 5): a forward wrapped by
a decorator that reads the wrapped function's name, and an activation that is an object of a
class defined in a function. Importable, so precompile's tests can save and load it.

    model = Decorated().eval()
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def named(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper closes over `fn`, which pickle cannot find by its qualified name (that
    leads to the wrapper)."""

    @functools.wraps(fn)
    def wrapper(self: nn.Module, *args: Any) -> Any:
        if fn.__name__ != "forward":
            raise AssertionError(fn.__name__)
        return fn(self, *args)

    return wrapper


def _make_activation() -> nn.Module:
    class Activation(nn.Module):  # defined in a function, as the `kernels` package does
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x) * 2

    return Activation()


class Decorated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.act = _make_activation()

    @named
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x)) + 1
