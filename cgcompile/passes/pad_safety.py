"""Whether padding a batch can change what the caller sees, decided from the graph.

Padding appends rows to dim 0 of the batch inputs and slices batch outputs back to the real
rows. That is exact only when rows stay independent and every output that involves the batch
is batch-major. `check_pad_safety` decides it once per graph, without running anything (the
backend judges it during the fake run that finds the graph's effects, `PadCheck`):

1. inputs: the batch (a symbol `s` of Dynamo's shape environment) is dim 0 of the batch
   inputs and in no other dim of any input, and dim 0 of no input at a fixed address (a cache
   allocated per batch size: padding cannot grow it);
2. ops: the graph runs on fresh fake tensors with symbolic sizes, and every aten op it
   dispatches is judged by `batch_rules.check_op` from the shapes it sees (rows vanish,
   sizes move, mixing along the batch, the batch size as a value). SDPA is judged as one call
   (queries over the batch are row-wise, keys over it are not, unless causal); attention ops
   the user registered are trusted to keep rows apart, like the engines whose padded batches
   they serve;
   Writes into state (a KV cache) at rows read from a batch input need that input's pad value
   (`state_writes`; at several indices, the pad value of the one that chooses the row), and a
   write of a batch-sized region of state is never padded;
3. outputs: a tensor involving `s` has it as dim 0 only, exactly `s`; no int output
   involves `s` (`return y, x.shape[0]` would return the padded size).

The first failure names the op, where the user's code called it, and why:

    safety = check_pad_safety(gm, example_inputs, plan.batch_exprs, trusted=is_attention)
    safety.reason   # "`y.sum(0)` (model.py:12, aten.sum.dim_IntList) reduces, ... batch dim"

A graph that is not pad-safe still gets graphs for batches of a capture size; other sizes run
without graphs (the backend warns once).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from cgcompile.passes.batch_rules import BatchDims, State, check_op, check_sdpa
from cgcompile.passes.mutation import ANALYSIS_ERRORS, find_effects
from cgcompile.passes.state_writes import StateWrites

_SDPA = torch._C._nn.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


@dataclasses.dataclass(frozen=True)
class PadSafety:
    """The verdict for one graph."""

    reason: str | None = None
    """Why padding could change what the caller sees (op, place, rule); None: it cannot."""

    @property
    def is_safe(self) -> bool:
        return self.reason is None


def check_pad_safety(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    batch_exprs: frozenset[Any],
    trusted: Callable[[Any], bool] = lambda target: False,
    names: Sequence[str] = (),
    padded: Collection[int] = (),
) -> PadSafety:
    """Whether batches of `gm` may be padded; `batch_exprs` are dim 0 of its batch inputs,
    `trusted` says which call targets keep rows apart, `names` name the placeholders,
    `padded` are the placeholders with a declared pad value."""
    check = PadCheck(gm, batch_exprs, trusted, names, padded)
    if check.needs_run:
        with contextlib.suppress(*ANALYSIS_ERRORS):  # recorded by the check
            find_effects(gm, example_inputs, check.watch)
    return check.verdict()


class PadCheck:
    """`check_pad_safety` in two halves around the fake run that `mutation.find_effects` makes:
    `watch` judges the ops as they run, `verdict` then judges the outputs. The backend runs the
    graph once for both analyses:

        check = PadCheck(gm, batch_exprs, ...)
        effects = find_effects(gm, example_inputs, check.watch)
        check.verdict().reason
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        batch_exprs: frozenset[Any],
        trusted: Callable[[Any], bool] = lambda target: False,
        names: Sequence[str] = (),
        padded: Collection[int] = (),
        fixed: Collection[int] = (),
    ) -> None:
        self.gm, self.batch_exprs, self.trusted, self.padded = gm, batch_exprs, trusted, padded
        self.batch = BatchDims(frozenset(s for e in batch_exprs for s in e.free_symbols))
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.names = list(names) or [n.name for n in self.placeholders]
        self.reason: str | None = None
        self.checker: _OpChecker | None = None
        if self.batch.symbols:
            self.reason = _check_inputs(self.placeholders, self.names, self.batch, batch_exprs)
        if self.batch.symbols and self.reason is None and fixed:
            self.reason = (
                f"input {self.names[min(fixed)]} has the batch as dim 0 and a fixed address (a "
                f"parameter, buffer or static-address tensor, e.g. a cache per batch size): "
                f"padding cannot grow it"
            )

    @property
    def needs_run(self) -> bool:
        """Whether the ops are still to judge (a batch, and inputs that passed)."""
        return bool(self.batch.symbols) and self.reason is None

    def watch(self, args: list[Any]) -> tuple[fx.Interpreter, contextlib.AbstractContextManager]:
        """The interpreter and dispatch mode that judge each op of a run on the fake `args`."""
        if not self.needs_run:
            return fx.Interpreter(self.gm), contextlib.nullcontext()
        batch_inputs = [i for i, a in enumerate(args) if _has_batch(self.batch, a)]
        checker = self.checker = _OpChecker(self.batch)
        interpreter = _Interpreter(self.gm, checker, self.trusted)
        writes = StateWrites(
            self.placeholders,
            args,
            self.names,
            self.batch,
            batch_inputs,
            self.padded,
            lambda: interpreter.env,
            checker.at,
        )
        checker.state = writes.state
        return interpreter, _checking(checker)

    def verdict(self) -> PadSafety:
        """After the run: the first failure of the inputs, the ops or the outputs."""
        if not self.batch.symbols:
            return PadSafety()
        if self.needs_run and self.checker is None:
            return PadSafety("could not be checked for padding (the graph did not run)")
        reason = self.reason or (self.checker.reason if self.checker else None)
        if reason is None:
            reason = _check_outputs(self.gm, self.batch, self.batch_exprs)
        return PadSafety(reason)


@contextlib.contextmanager
def _checking(checker: _OpChecker) -> Iterator[None]:
    try:
        with checker:
            yield
    except ANALYSIS_ERRORS as exc:
        checker.record(f"could not be checked for padding ({type(exc).__name__})", "run")
        raise


def _check_inputs(
    placeholders: list[fx.Node], names: list[str], batch: BatchDims, batch_exprs: frozenset[Any]
) -> str | None:
    for node, name in zip(placeholders, names, strict=True):
        value = _value(node)
        if isinstance(value, torch.Tensor):
            for dim, expr in batch.dims(value):
                if dim != 0 or expr not in batch_exprs:
                    return (
                        f"input {name} has size {expr} in dim {dim}; padding extends "
                        f"dim 0 of the batch inputs only"
                    )
        elif batch.expr(value) is not None and batch.expr(value) not in batch_exprs:
            return f"input {name} is {batch.expr(value)}, derived from the batch size"
    return None


def _check_outputs(gm: fx.GraphModule, batch: BatchDims, batch_exprs: frozenset[Any]) -> str | None:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    flat = output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    for i, node in enumerate(flat):
        value = _value(node) if isinstance(node, fx.Node) else node
        if isinstance(value, torch.Tensor):
            dims = batch.dims(value)
            if dims and (len(dims) > 1 or dims[0][0] != 0 or dims[0][1] not in batch_exprs):
                shape = tuple(batch.expr(s) or s for s in value.shape)
                return (
                    f"output {i} has shape {shape}: only outputs whose dim 0 is the batch "
                    f"(and no other dim) are sliced back to the real rows"
                )
        elif batch.expr(value) is not None:
            return f"output {i} is {batch.expr(value)}, a size that padding would change"
    return None


def _has_batch(batch: BatchDims, value: Any) -> bool:
    return isinstance(value, torch.Tensor) and bool(batch.dims(value))


class _OpChecker(TorchDispatchMode):
    """Sees every aten op the graph dispatches on fake tensors; keeps the first failure."""

    def __init__(self, batch: BatchDims) -> None:
        super().__init__()
        self.batch = batch
        self.state = State(lambda t: False)
        self.node: fx.Node | None = None
        self.reason: str | None = None
        self.paused = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.paused and self.reason is None:
            self.record(self._check(func, args, kwargs, out), f"aten.{func.name().split('::')[-1]}")
        return out

    def _check(self, func: Any, args: Any, kwargs: Any, out: Any) -> str | None:
        try:
            return check_op(func, args, kwargs, out, self.batch, self.state)
        except Exception as exc:  # an overload the rules do not know: do not pad, say why
            return f"could not be checked for padding ({type(exc).__name__}: {exc})"

    def at(self) -> fx.Node | None:
        """The node whose ops run now."""
        return self.node

    def record(self, why: str | None, op: str) -> None:
        if why is not None and self.reason is None:
            self.reason = f"{source_of(self.node)} ({op}) {why}"

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        self.paused = True
        try:
            yield
        finally:
            self.paused = False


class _Interpreter(fx.Interpreter):
    """Tells the checker which node runs; judges SDPA whole and skips trusted attention."""

    def __init__(
        self, gm: fx.GraphModule, checker: _OpChecker, trusted: Callable[[Any], bool]
    ) -> None:
        super().__init__(gm)
        self.checker = checker
        self.trusted = trusted

    def run_node(self, n: fx.Node) -> Any:
        self.checker.node = n
        if n.op != "call_function" or not (n.target is _SDPA or self.trusted(n.target)):
            return super().run_node(n)
        if n.target is _SDPA:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            bound = {**dict(zip(_SDPA_ARGS, args, strict=False)), **kwargs}
            why = check_sdpa(self.checker.batch, bound)
            self.checker.record(why, "scaled_dot_product_attention")
        with self.checker.pause():
            return super().run_node(n)


def _value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def source_of(node: fx.Node | None) -> str:
    """`code` (file:line) of the user's call behind a node, from Dynamo's stack trace."""
    if node is None:
        return "an op"
    lines = [line.strip() for line in node.meta.get("stack_trace", "").strip().splitlines()]
    frames = [i for i, line in enumerate(lines) if line.startswith("File ")]
    if not frames or frames[-1] + 1 >= len(lines):
        return f"`{node.name}`"
    parts = lines[frames[-1]].split('"')
    place = os.path.basename(parts[1]) if len(parts) > 2 else "?"
    line_no = lines[frames[-1]].split("line ")[-1].split(",")[0]
    return f"`{lines[frames[-1] + 1]}` ({place}:{line_no})"
