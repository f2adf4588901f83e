"""Which graph inputs a Dynamo graph writes in place, and which outputs alias an input, found
by running it on fake tensors.

Each tensor placeholder gets a fresh fake tensor of its traced shape and layout (symbolic sizes
included); the graph runs on them under the graph's own fake mode, which computes no data, and
every in-place write bumps the written tensor's version counter: `add_`, `index_copy_`, a copy
into a view (`cache[:, pos] = k`), a custom op's `mutates_args`. Train-mode batch norm writes
its running statistics without saying so in its schema (no version bump): those writes are
seen by op. The placeholders whose counter moved are the mutated inputs. Real models write KV
caches and counters this way; the backend must leave them exactly as one eager call would.
An output that shares storage with an input (a returned buffer, a view of an argument) is an
alias of that input: its memory is the input's, not the graph's.

Dynamo made that run already, on its own fake inputs (each placeholder's `example_value`):
where its record can tell, it is read instead (~1 ms against ~1 s for a 16-layer Hugging Face
Llama, development CPU). It cannot where two inputs share storage (one version counter), an op
writes unmarked (batch norm) or a node lacks a fake value; then the graph runs on fresh fakes.

    effects = find_effects(gm, example_inputs)
    effects.mutated, effects.output_aliases      # e.g. (0, 5), {1: 5}: placeholder positions
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
    is_fake,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

logger = logging.getLogger(__name__)

ANALYSIS_ERRORS = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
    GuardOnDataDependentSymNode,
)
"""What a fake run of a graph Dynamo traced can still raise: an op whose output fake tensors
cannot describe. The analyses give up on the graph (it runs without CUDA graphs), never on the
model (a backend error would make Dynamo break the model into many graphs)."""


@dataclasses.dataclass(frozen=True)
class Effects:
    """What one run of a graph does to its inputs."""

    mutated: tuple[int, ...]
    """Placeholders the graph writes in place."""
    output_aliases: dict[int, int]
    """Output position -> the placeholder whose storage it shares."""


Watch = Callable[[list[Any]], tuple[fx.Interpreter, contextlib.AbstractContextManager[Any]]]
"""An analysis riding along the fake run: given the fake inputs, the interpreter to run them with
and a context to run it in (`pad_safety.PadCheck.watch`)."""


def find_effects(
    gm: fx.GraphModule, example_inputs: Sequence[Any], watch: Watch | None = None
) -> Effects:
    """The inputs `gm` writes in place and the outputs that alias an input; `watch` lets another
    analysis see the same run (one fake run of a large graph costs about a second). Without
    `watch`, the run takes each symbolic size at its example value when every size has one
    (what is written and aliased does not depend on the sizes, and a run without symbols costs
    a fraction; an unbacked size, which has no hint, at the real example input's size when that
    is 2 or more: at 0 or 1 a reshape may alias where larger sizes copy), else, or where that
    run fails (a value read from data), it keeps the symbols."""
    if watch is None:
        recorded = recorded_effects(gm)
        if recorded is not None:
            return recorded
        concrete = _concrete_effects(gm, example_inputs)
        if concrete is not None:
            return concrete
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with fake_execution(example_inputs):
        args = fresh_fakes(placeholders, example_inputs)
        before = [a._version if isinstance(a, torch.Tensor) else None for a in args]
        interpreter, watching = (
            watch(args) if watch else (fx.Interpreter(gm), contextlib.nullcontext())
        )
        with _UnmarkedWrites() as unmarked, watching:
            out = interpreter.run(*args)
    return _effects(placeholders, args, before, out, unmarked.written)


def _effects(
    placeholders: Sequence[fx.Node],
    args: Sequence[Any],
    before: Sequence[int | None],
    out: Any,
    written: set[StorageWeakRef],
) -> Effects:
    """What a run of `args` (versions `before`) that returned `out` wrote and aliased."""
    storages = {
        StorageWeakRef(a.untyped_storage()): i
        for i, a in enumerate(args)
        if isinstance(a, torch.Tensor)
    }
    mutated = tuple(
        i
        for i, (a, version) in enumerate(zip(args, before, strict=True))
        if version is not None
        and (a._version != version or StorageWeakRef(a.untyped_storage()) in written)
    )
    outputs = out if isinstance(out, (tuple, list)) else [out]
    aliases = {
        i: storages[StorageWeakRef(o.untyped_storage())]
        for i, o in enumerate(outputs)
        if isinstance(o, torch.Tensor) and StorageWeakRef(o.untyped_storage()) in storages
    }
    logger.debug("mutated inputs: %s", [placeholders[i].name for i in mutated])
    return Effects(mutated, aliases)


def recorded_effects(gm: fx.GraphModule) -> Effects | None:
    """`find_effects` read off the fake values Dynamo traced `gm` with: each in-place write
    moved its input's version counter (a fresh fake's starts at 0), and an output that aliases
    an input shares its fake storage. None where the record cannot tell (module docstring)."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    storages: dict[StorageWeakRef, int] = {}
    mutated = []
    for i, node in enumerate(placeholders):
        value = node.meta.get("example_value")
        if not isinstance(value, torch.Tensor):
            if value is None:
                return None
            continue
        storage = StorageWeakRef(value.untyped_storage())
        if not is_fake(value) or value.is_inference() or storage in storages:
            return None
        storages[storage] = i
        if value._version:
            mutated.append(i)
    unmarked = ("batch_norm", "instance_norm")  # may write running statistics unmarked
    if any(n.op == "call_module" or any(u in str(n.target) for u in unmarked) for n in nodes):
        return None
    returned = nodes[-1].args[0]
    aliases = {}
    for i, out in enumerate(returned if isinstance(returned, (tuple, list)) else [returned]):
        value = out.meta.get("example_value", None) if isinstance(out, fx.Node) else 0
        if value is None:
            return None
        if isinstance(value, torch.Tensor) and StorageWeakRef(value.untyped_storage()) in storages:
            aliases[i] = storages[StorageWeakRef(value.untyped_storage())]
    logger.debug("mutated inputs (Dynamo's record): %s", [placeholders[i].name for i in mutated])
    return Effects(tuple(mutated), aliases)


def _concrete_effects(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Effects | None:
    """`find_effects` on inputs whose symbolic sizes are their example values, in a fake mode
    without symbols; None where a size has no example value or the run needs symbols."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    traced = [n.meta.get("example_value", n.meta.get("val")) for n in placeholders]
    traced = [t if t is not None else real for t, real in zip(traced, example_inputs, strict=True)]
    try:
        unbacked = _unbacked_sizes(traced, example_inputs)
        values = [_concrete(t, unbacked) for t in traced]
    except _NoHint:
        return None
    mode = torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode, enable_python_dispatcher(), torch.no_grad():
            args = [
                torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
                if isinstance(t, torch.Tensor)
                else shape
                for t, (shape, stride) in zip(traced, values, strict=True)
            ]
            before = [a._version if isinstance(a, torch.Tensor) else None for a in args]
            with _UnmarkedWrites() as unmarked:
                out = fx.Interpreter(gm).run(*args)
    except Exception:  # noqa: BLE001 (a shortcut: any failure takes the run with symbols)
        logger.debug("effects: the run without symbols failed; running with them", exc_info=True)
        return None
    return _effects(placeholders, args, before, out, unmarked.written)


class _NoHint(Exception):
    pass


def _concrete(value: Any, unbacked: dict[Any, int]) -> tuple[Any, Any]:
    """(shape, stride) of a tensor with every size at its example value; (value, None) for a
    scalar, its example value if symbolic. Unbacked symbols take their `unbacked` values."""
    if isinstance(value, torch.Tensor):
        shape, stride = value.shape, value.stride()
        return tuple(_hint(s, unbacked) for s in shape), tuple(_hint(s, unbacked) for s in stride)
    return _hint(value, unbacked), None


def _hint(size: Any, unbacked: dict[Any, int]) -> Any:
    if not isinstance(size, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return size
    if size.node.hint is not None:
        return size.node.hint
    expr = size.node.expr
    if isinstance(size, torch.SymInt) and expr.free_symbols <= unbacked.keys():
        try:
            return int(expr.xreplace(unbacked))
        except (TypeError, ValueError):  # an expression sympy does not evaluate to a number
            pass
    raise _NoHint


def _unbacked_sizes(traced: Sequence[Any], example_inputs: Sequence[Any]) -> dict[Any, int]:
    """Unbacked symbols that are a dim of a tensor input, at that dim of the real input Dynamo
    traced, where that is 2 or more (at 0 or 1 a reshape may alias where larger sizes copy)."""
    sizes: dict[Any, int] = {}
    for value, real in zip(traced, example_inputs, strict=True):
        if not isinstance(value, torch.Tensor) or not isinstance(real, torch.Tensor):
            continue
        if is_fake(real) or real.dim() != value.dim():
            continue
        for size, n in zip(value.shape, real.shape, strict=True):
            if isinstance(size, torch.SymInt) and size.node.hint is None and n >= 2:
                if isinstance(size.node.expr, sympy.Symbol):
                    sizes[size.node.expr] = n
    return sizes


_BATCH_NORMS = frozenset(
    """native_batch_norm _native_batch_norm_legit cudnn_batch_norm miopen_batch_norm
    _batch_norm_impl_index""".split()
)


class _UnmarkedWrites(TorchDispatchMode):
    """Storages written by ops whose schema does not mark the write: train-mode batch norm's
    running mean and variance (arguments 3 and 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: set[StorageWeakRef] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name in _BATCH_NORMS and len(args) > 5 and args[5] is True:
            for stat in tree_leaves(args[3:5]):
                if isinstance(stat, torch.Tensor):
                    self.written.add(StorageWeakRef(stat.untyped_storage()))
        return func(*args, **kwargs)


def fake_execution(example_inputs: Sequence[Any]) -> contextlib.AbstractContextManager[Any]:
    """The graph's own fake mode (or a new one), with the Python dispatcher, without grad.

    Scalars read from data (`.item()` of a data-dependent value) become fresh unbacked symbols
    of the graph's shape environment, which these analyses then forget: they bind nothing
    that the compile after them must account for."""
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    if fake_mode is None:
        fake_mode = torch._subclasses.FakeTensorMode()
    stack = contextlib.ExitStack()
    for context in (fake_mode, enable_python_dispatcher(), torch.no_grad()):
        stack.enter_context(context)
    if fake_mode.shape_env is not None:
        stack.enter_context(fake_mode.shape_env.ignore_fresh_unbacked_symbols())
    return stack


def fresh_fakes(placeholders: Sequence[fx.Node], example_inputs: Sequence[Any]) -> list[Any]:
    """Fresh fake inputs for `placeholders`, made inside `fake_execution`."""
    return [
        _fresh_fake(node.meta.get("example_value", node.meta.get("val")), real)
        for node, real in zip(placeholders, example_inputs, strict=True)
    ]


def _fresh_fake(traced: Any, real: Any) -> Any:
    """A new fake tensor shaped like the traced input (its own version counter; never an
    inference tensor, which has none); other inputs (SymInts, ints) as Dynamo traced them.
    A 0-d input Dynamo reads with `.item()` (a float attribute under `dynamic=True`) keeps the
    symbol Dynamo gave that value."""
    value = traced if traced is not None else real
    if not isinstance(value, torch.Tensor):
        return value
    fresh = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    memo = getattr(value, "item_memo", None)
    if memo is not None:
        fresh.item_memo = memo
    return fresh
