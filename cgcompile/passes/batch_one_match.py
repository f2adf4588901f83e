"""Whether Dynamo's batch-1 graph is the dynamic graph at batch 1, node by node.

Dynamo specialises size 1: a backed dynamic batch is traced once for sizes >= 2 (with the guard
`2 <= s`) and once more when a batch of 1 arrives. When the second graph calls the same ops on
the same arguments, with the batch symbols set to 1, and every value has the same dtype, shape
and strides (but those of size-1 dims, which never address memory), then running the dynamic
graph at batch 1 computes what the batch-1 graph computes, and the dynamic graph's compiled
code, padded to 2 rows and sliced back to 1 (exact wherever it pads any batch), serves it: no
second compile, no graphs of its own. Anything else (another branch taken at size 1, a
squeezed batch dim, another symbol) is a mismatch, and the batch-1 graph compiles on its own.

Dynamic graph (s = batch)                     batch-1 graph
    s0: SymInt, tokens: [s0]                      tokens: [1]
    gt = s0 > 0; _assert_scalar(gt)               (nothing: sizes only)
    x = embedding(tokens, w)   [s0, 64]           x = embedding(tokens, w)   [1, 64]
    v = x.view(-1, 4, 16)      [s0, 4, 16]        v = x.view(-1, 4, 16)      [1, 4, 16]

    match = match_batch_one(dynamic_gm, static_gm, batch_exprs)
    match.size_positions    # (0, 5): where the dynamic graph takes the batch size as an int
"""

from __future__ import annotations

import dataclasses
from typing import Any

import sympy
import torch
from torch import fx

_SYM = (torch.SymInt, torch.SymBool, torch.SymFloat)


@dataclasses.dataclass(frozen=True)
class BatchOneMatch:
    """The verdict: the dynamic graph serves the batch-1 graph, or why not."""

    size_positions: tuple[int, ...] = ()
    """Positions of the dynamic graph's batch-size placeholders: the batch-1 graph's arguments
    with 1 inserted there are the dynamic graph's arguments."""
    mismatch: str | None = None
    """The first difference found; None: the graphs match."""


class _Mismatch(Exception):
    pass


def match_batch_one(
    dynamic: fx.GraphModule, static: fx.GraphModule, batch_exprs: frozenset[Any]
) -> BatchOneMatch:
    """Compare the graphs placeholder by placeholder, then node by node (see the module
    docstring); nodes that compute only sizes and size asserts are left out on both sides."""
    symbols = {s for e in batch_exprs for s in getattr(e, "free_symbols", ())}
    if not symbols:
        return BatchOneMatch(mismatch="the first graph has no symbolic batch")
    try:
        return BatchOneMatch(_Matcher(symbols).run(dynamic, static))
    except _Mismatch as exc:
        return BatchOneMatch(mismatch=str(exc))


class _Matcher:
    def __init__(self, symbols: set[Any]) -> None:
        self.at_one = {s: sympy.Integer(1) for s in symbols}
        self.pairs: dict[fx.Node, fx.Node] = {}

    def run(self, dynamic: fx.GraphModule, static: fx.GraphModule) -> tuple[int, ...]:
        positions = self._placeholders(dynamic, static)
        dyn = [n for n in dynamic.graph.nodes if n.op != "placeholder" and not _sizes_only(n)]
        sta = [n for n in static.graph.nodes if n.op != "placeholder" and not _sizes_only(n)]
        if len(dyn) != len(sta):
            raise _Mismatch(f"{len(dyn)} nodes against {len(sta)} at batch 1")
        for d, s in zip(dyn, sta, strict=True):
            if d.op != s.op or d.target != s.target:
                raise _Mismatch(f"node {d.name} ({d.op} {d.target}) against {s.name} ({s.target})")
            self._same(d.args, s.args, d.name)
            self._same(d.kwargs, s.kwargs, d.name)
            self._same_value(_value(d), _value(s), d.name)
            self.pairs[d] = s
        return positions

    def _placeholders(self, dynamic: fx.GraphModule, static: fx.GraphModule) -> tuple[int, ...]:
        sta = [n for n in static.graph.nodes if n.op == "placeholder"]
        positions, k = [], 0
        for i, d in enumerate(n for n in dynamic.graph.nodes if n.op == "placeholder"):
            value = _value(d)
            if isinstance(value, torch.SymInt):
                if value.node.expr not in self.at_one:
                    raise _Mismatch(f"input {d.name} is a size other than the batch")
                positions.append(i)
                continue
            if k == len(sta) or sta[k].name != d.name:
                raise _Mismatch(f"input {d.name} has no counterpart in order")
            self._same_value(value, _value(sta[k]), d.name)
            self.pairs[d] = sta[k]
            k += 1
        if k != len(sta):
            raise _Mismatch(f"the batch-1 graph has {len(sta) - k} more inputs")
        return tuple(positions)

    def _same(self, d: Any, s: Any, where: str) -> None:
        """Arguments: paired nodes, sizes that are the literal at batch 1, equal literals."""
        if isinstance(d, fx.Node):
            if d in self.pairs:
                if self.pairs[d] is not s:
                    raise _Mismatch(f"{where} reads {d.name} where the batch-1 graph reads {s}")
                return
            self._same(self._concrete(_value(d), where), s, where)
        elif isinstance(d, (tuple, list)):
            if type(d) is not type(s) or len(d) != len(s):
                raise _Mismatch(f"{where}: argument {d} against {s}")
            for a, b in zip(d, s, strict=True):
                self._same(a, b, where)
        elif isinstance(d, dict):
            if not isinstance(s, dict) or d.keys() != s.keys():
                raise _Mismatch(f"{where}: keyword arguments differ")
            for key in d:
                self._same(d[key], s[key], where)
        elif isinstance(d, slice):
            if not isinstance(s, slice):
                raise _Mismatch(f"{where}: slice against {s}")
            self._same((d.start, d.stop, d.step), (s.start, s.stop, s.step), where)
        elif isinstance(d, _SYM):
            self._same(self._concrete(d, where), s, where)
        elif type(d) is not type(s) or d != s:
            raise _Mismatch(f"{where}: argument {d!r} against {s!r}")

    def _same_value(self, d: Any, s: Any, where: str) -> None:
        """What a node produces: dtype, device, shape, strides and kind of every tensor."""
        if isinstance(d, torch.Tensor):
            if not isinstance(s, torch.Tensor):
                raise _Mismatch(f"{where} gives a tensor where the batch-1 graph gives {s}")
            meta = (type(d), d.dtype, d.device, d.requires_grad)
            if meta != (type(s), s.dtype, s.device, s.requires_grad):
                raise _Mismatch(f"{where}: tensor kind, dtype or device differ")
            shape = self._concrete(tuple(d.shape), where)
            if shape != tuple(s.shape) or _layout(shape, self._concrete(d.stride(), where)) != (
                _layout(shape, s.stride())
            ):
                raise _Mismatch(
                    f"{where}: shape {shape} strides {self._concrete(d.stride(), where)} at "
                    f"batch 1 against {tuple(s.shape)} {s.stride()}"
                )
        elif isinstance(d, (tuple, list)):
            if not isinstance(s, (tuple, list)) or len(d) != len(s):
                raise _Mismatch(f"{where}: {len(d)} values against {s}")
            for a, b in zip(d, s, strict=True):
                self._same_value(a, b, where)
        elif isinstance(d, _SYM) or type(d) is not type(s):
            raise _Mismatch(f"{where} gives {type(d).__name__} against {type(s).__name__}")

    def _concrete(self, value: Any, where: str) -> Any:
        """A size (or a tuple of them) with the batch set to 1, as a Python number."""
        if isinstance(value, (tuple, list, torch.Size)):
            return tuple(self._concrete(v, where) for v in value)
        if not isinstance(value, _SYM):
            return value
        expr = value.node.expr.xreplace(self.at_one)
        if not expr.is_number:
            raise _Mismatch(f"{where}: size {value} involves symbols other than the batch")
        if isinstance(value, torch.SymBool):
            return bool(expr)
        return int(expr) if isinstance(value, torch.SymInt) else float(expr)


def _layout(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int | None, ...]:
    """Strides that address memory: a dim of size 1 is only ever read at index 0."""
    return tuple(None if n == 1 else st for n, st in zip(shape, stride, strict=True))


def _value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _sizes_only(node: fx.Node) -> bool:
    """A node that computes a size or checks one (`sym_size`, `s0 > 0`, `_assert_scalar`):
    its value is symbolic or None, and it reads no tensor but through a size."""
    value = _value(node)
    if node.op == "output" or not (value is None or isinstance(value, _SYM)):
        return False
    if node.target is torch.ops.aten.sym_size.int:
        return True
    inputs = node.all_input_nodes  # none at all: a call for its effect (`_set_grad_enabled`)
    reads = [a for a in inputs if not isinstance(_value(a), _SYM)]
    return bool(inputs) and not reads and node.op == "call_function"
