"""Where the batch lives in a graph's inputs and outputs, and the buffers that pin them.

`InputPlan.from_graph` reads Dynamo's placeholders once. Dim 0 of every user tensor whose dim 0
is dynamic is the batch (token) dim: those tensors are copied into static buffers and padded.
Other user tensors are copied into same-shape buffers. Parameters, module buffers and
`mark_static_address` tensors are never copied. `StaticInputs.fill` then gives every call the
same addresses, which is what a replayed graph reads.

    plan = InputPlan.from_graph(gm, example_inputs)
    args = static.fill(args, n=5, padded=8)       # tensors now live in buf[:8], rows 5..7 zero
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx


@dataclasses.dataclass(frozen=True)
class InputPlan:
    batch_exprs: frozenset[Any]
    """Symbols of dim 0 of the user's dynamic tensors: all are the batch. Empty: static batch."""
    size_indices: tuple[int, ...]
    """Positions of the int arguments that carry the batch size."""
    batch_tensors: tuple[int, ...]
    """Positions of tensors whose dim 0 is the batch: copied and padded."""
    copied_tensors: tuple[int, ...]
    """Other user tensors: copied into same-shape static buffers."""
    batch_outputs: tuple[int, ...]
    """Positions of outputs whose dim 0 is the batch: sliced back to the real size."""
    static_batch: int | None
    """The batch size of a graph without a symbolic batch (dim 0 of its first user tensor)."""
    static_tensors: tuple[int, ...] = ()
    """Parameters and buffers: used in place, so graphs bake in their addresses."""
    int_args: tuple[int, ...] = ()
    """Positions of all int (dynamic size) arguments: with the descriptor, a graph's key."""
    min_batch: int = 1
    """The smallest batch this graph's guards admit: 2 for a backed batch (Dynamo traces batch 1
    separately), so capture sizes below it would record graphs no call can reach."""

    @classmethod
    def from_graph(cls, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> InputPlan:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        values = [n.meta.get("example_value", n.meta.get("val")) for n in placeholders]
        user = [
            i
            for i, (node, value) in enumerate(zip(placeholders, values, strict=True))
            if isinstance(value, torch.Tensor) and not _is_static(node, example_inputs[i])
        ]
        exprs = frozenset(
            values[i].shape[0].node.expr
            for i in user
            if values[i].dim() > 0 and isinstance(values[i].shape[0], torch.SymInt)
        )
        batch_tensors = tuple(i for i in user if _dim0_in(values[i], exprs))
        size_indices = tuple(
            i for i, v in enumerate(values) if isinstance(v, torch.SymInt) and v.node.expr in exprs
        )
        static_batch = None
        if not exprs and user and values[user[0]].dim() > 0:
            static_batch = int(values[user[0]].shape[0])
            batch_tensors = (user[0],)
        outputs = _output_values(gm)
        batch_outputs = tuple(i for i, v in enumerate(outputs) if _dim0_in(v, exprs))
        copied = tuple(i for i in user if i not in batch_tensors)
        static = tuple(
            i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and i not in user
        )
        ints = tuple(i for i, v in enumerate(values) if isinstance(v, torch.SymInt))
        dims = [values[i].shape[0] for i in batch_tensors]
        bounds = [_lower_bound(d) for d in dims if isinstance(d, torch.SymInt)]
        return cls(
            exprs,
            size_indices,
            batch_tensors,
            copied,
            batch_outputs,
            static_batch,
            static,
            ints,
            max([1, *bounds]),
        )

    def batch_size(self, args: Sequence[Any]) -> int | None:
        """The batch of this call, or None when the user's batch tensors disagree on it."""
        if not self.batch_tensors:
            return None
        n = args[self.batch_tensors[0]].shape[0]
        if any(args[i].shape[0] != n for i in self.batch_tensors[1:]):
            return None
        return n


def _lower_bound(size: torch.SymInt) -> int:
    """The least value the shape environment allows for a symbolic size (0 if unbounded)."""
    node = size.node
    try:
        return int(node.shape_env.bound_sympy(node.expr).lower)
    except (TypeError, ValueError, OverflowError):  # -oo
        return 0


def _is_static(node: fx.Node, example: Any) -> bool:
    """Parameters, module buffers and `mark_static_address` tensors keep their address."""
    if isinstance(example, torch.nn.Parameter):
        return True
    return bool(node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type"))


def _dim0_in(value: Any, exprs: frozenset[Any]) -> bool:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    d0 = value.shape[0]
    return isinstance(d0, torch.SymInt) and d0.node.expr in exprs


def _output_values(gm: fx.GraphModule) -> list[Any]:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    flat = output.args[0]
    if not isinstance(flat, (tuple, list)):
        flat = [flat]
    return [
        a.meta.get("example_value", a.meta.get("val")) if isinstance(a, fx.Node) else a
        for a in flat
    ]


class StaticInputs:
    """Persistent buffers for a graph's user inputs, allocated on first use per shape."""

    def __init__(self, plan: InputPlan, max_batch: int) -> None:
        self.plan = plan
        self.max_batch = max_batch
        self.buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def _buffer(self, index: int, like: torch.Tensor, rows: int | None) -> torch.Tensor:
        shape = tuple(like.shape) if rows is None else (rows, *like.shape[1:])
        key = (index, shape, like.dtype, like.device)
        buf = self.buffers.get(key)
        if buf is None:
            buf = torch.zeros(shape, dtype=like.dtype, device=like.device)
            self.buffers[key] = buf
        return buf

    def fill(self, args: Sequence[Any], n: int, padded: int) -> list[Any]:
        """Copy user tensors into the static buffers; batch tensors padded to `padded` rows."""
        out = list(args)
        for i in self.plan.batch_tensors:
            buf = self._buffer(i, args[i], max(self.max_batch, padded))
            buf[:n].copy_(args[i])
            if padded > n:
                buf[n:padded].zero_()
            out[i] = buf[:padded]
        for i in self.plan.copied_tensors:
            buf = self._buffer(i, args[i], None)
            buf.copy_(args[i])
            out[i] = buf
        for i in self.plan.size_indices:
            out[i] = padded
        return out

    def at_size(self, args: Sequence[Any], rows: int) -> list[Any]:
        """Arguments for a run at `rows` rows on the static buffers, whatever they hold now;
        `args` (any earlier call's) supply the layout, parameters and buffers."""
        out = list(args)
        for i in self.plan.batch_tensors:
            out[i] = self._buffer(i, args[i], max(self.max_batch, rows))[:rows]
        for i in self.plan.copied_tensors:
            out[i] = self._buffer(i, args[i], None)
        for i in self.plan.size_indices:
            out[i] = rows
        return out

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())
