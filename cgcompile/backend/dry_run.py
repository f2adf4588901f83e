"""Shape-only stand-ins for the eager splitting ops, so PIECEWISE graphs can be recorded
without running anything.

Capturing the pieces of a split graph one after the other needs, between two pieces, the
tensors the splitting op (attention) hands to the next piece: their shapes, dtypes and
devices, not their values (capture records kernels; it reads no data). Running the op for
real would write what it writes, e.g. a KV cache. Inside `shapes_only(split)` each splitting
piece of `split.split_gm` computes its outputs' metadata on fake tensors and returns zeros
of those shapes and strides; on exit the real pieces are back.

    with shapes_only(split):
        split.split_gm.forward(*args)      # captured pieces record, attention never runs
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only

from cgcompile.passes.split import SplitResult


class _ShapesOnly:
    """Runs a splitting piece on fake tensors; returns zero tensors shaped like its outputs."""

    def __init__(self, graph: fx.GraphModule) -> None:
        self.graph = graph

    def __call__(self, *args: Any) -> Any:
        with FakeTensorMode() as mode:
            fake = tree_map_only(torch.Tensor, mode.from_tensor, args)
            out = self.graph.forward(*fake)
        return tree_map_only(torch.Tensor, _zeros_like_fake, out)


def _zeros_like_fake(t: torch.Tensor) -> torch.Tensor:
    """Zeros with the fake's shape and strides: the next piece was compiled for the strides
    the op's real kernel gives (e.g. SDPA's output is not contiguous on CUDA)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).zero_()


@contextlib.contextmanager
def shapes_only(split: SplitResult) -> Iterator[None]:
    """Within the block, every splitting piece of `split` is a `_ShapesOnly` stand-in."""
    installed = split.split_gm.__dict__
    saved = {item.name: installed[item.name] for item in split.splitting}
    try:
        for item in split.splitting:
            installed[item.name] = _ShapesOnly(item.graph)
        yield
    finally:
        installed.update(saved)
