"""Which graph inputs a Dynamo graph writes in place, found by running it on fake tensors.

Each tensor placeholder gets a fresh fake tensor of its traced shape and layout (symbolic sizes
included); the graph runs on them under the graph's own fake mode, which computes no data, and
every in-place write bumps the written tensor's version counter: `add_`, `index_copy_`, a copy
into a view (`cache[:, pos] = k`), a custom op's `mutates_args`. The placeholders whose counter
moved are the mutated inputs. Real models write KV caches and counters this way; the backend
must leave them exactly as one eager call would.

    mutated = find_mutated_inputs(gm, example_inputs)     # e.g. (0, 5): placeholder positions
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher

logger = logging.getLogger(__name__)


def find_mutated_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[int, ...]:
    """Positions of the placeholders that `gm` writes in place."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with fake_execution(example_inputs):
        args = fresh_fakes(placeholders, example_inputs)
        before = [a._version if isinstance(a, torch.Tensor) else None for a in args]
        fx.Interpreter(gm).run(*args)
    mutated = tuple(
        i
        for i, (a, version) in enumerate(zip(args, before, strict=True))
        if version is not None and a._version != version
    )
    logger.debug("mutated inputs: %s", [placeholders[i].name for i in mutated])
    return mutated


def fake_execution(example_inputs: Sequence[Any]) -> contextlib.AbstractContextManager[Any]:
    """The graph's own fake mode (or a new one), with the Python dispatcher, without grad."""
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    if fake_mode is None:
        fake_mode = torch._subclasses.FakeTensorMode()
    stack = contextlib.ExitStack()
    for context in (fake_mode, enable_python_dispatcher(), torch.no_grad()):
        stack.enter_context(context)
    return stack


def fresh_fakes(placeholders: Sequence[fx.Node], example_inputs: Sequence[Any]) -> list[Any]:
    """Fresh fake inputs for `placeholders`, made inside `fake_execution`."""
    return [
        _fresh_fake(node.meta.get("example_value", node.meta.get("val")), real)
        for node, real in zip(placeholders, example_inputs, strict=True)
    ]


def _fresh_fake(traced: Any, real: Any) -> Any:
    """A new fake tensor shaped like the traced input (its own version counter; never an
    inference tensor, which has none); other inputs (SymInts, ints) as Dynamo traced them."""
    value = traced if traced is not None else real
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
