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

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher

logger = logging.getLogger(__name__)


def find_mutated_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[int, ...]:
    """Positions of the placeholders that `gm` writes in place."""
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    if fake_mode is None:
        fake_mode = torch._subclasses.FakeTensorMode()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with fake_mode, enable_python_dispatcher(), torch.no_grad():
        args = [
            _fresh_fake(node.meta.get("example_value", node.meta.get("val")), real)
            for node, real in zip(placeholders, example_inputs, strict=True)
        ]
        before = [a._version if isinstance(a, torch.Tensor) else None for a in args]
        fx.Interpreter(gm).run(*args)
    mutated = tuple(
        i
        for i, (a, version) in enumerate(zip(args, before, strict=True))
        if version is not None and a._version != version
    )
    logger.debug("mutated inputs: %s", [placeholders[i].name for i in mutated])
    return mutated


def _fresh_fake(traced: Any, real: Any) -> Any:
    """A new fake tensor shaped like the traced input (its own version counter; never an
    inference tensor, which has none); other inputs (SymInts, ints) as Dynamo traced them."""
    value = traced if traced is not None else real
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
