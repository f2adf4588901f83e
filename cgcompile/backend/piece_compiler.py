"""Compile each capturable piece of a split graph once, with symbolic shapes.

`compile_pieces` compiles each capturable piece with the fake arguments it receives
(FakeTensors with the symbolic batch size, plus SymInts), so one compiled artifact serves
every batch size. Those arguments are Dynamo's own fake values, which the split copies onto
each piece's placeholders (`meta["example_value"]`); only when a placeholder lacks one (a node
a pass added without it) does it run the stitching graph on fake inputs with an
`fx.Interpreter` to find them, a run that costs seconds on a large model. Splitting pieces stay
eager; with `compiler="eager"` every piece is its generated forward, built without arguments.
Pieces with the same structure (identical layers) share one compiled artifact: N layers cost
one compile, not N.

    compiled = compile_pieces(split, example_inputs, compiler="inductor")
    compiled["submod_0"](*args)

Optional `compile_sizes` add artifacts specialised to a concrete batch size; `PieceRunner`
picks one by the batch-size argument at call time (`piece_artifacts`: each piece's artifacts,
and what runs where Inductor fails). Dynamo's `RestartAnalysis` propagates.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor

from cgcompile.backend.piece_artifacts import (
    Compiled,
    PieceRunner,
    compile_for_size,
    compile_one,
    has_tuple_output,
    warn_compile_failed,
)
from cgcompile.passes.split import SplitItem, SplitResult, graph_signature

logger = logging.getLogger(__name__)


class _Pieces:
    """Compiles capturable pieces, sharing one artifact between pieces of equal structure."""

    def __init__(self, split_gm: fx.GraphModule, compiler: str) -> None:
        self.split_gm = split_gm
        self.compiler = compiler
        self.cache: dict[Any, tuple[str, Compiled]] = {}
        self.runners: dict[str, PieceRunner] = {}
        self.piece_args: dict[str, tuple[list[Any], bool]] = {}

    def compile(self, name: str, args: list[Any]) -> None:
        gm = self.split_gm.get_submodule(name)
        # Inductor rewrites a bare output into a tuple in place: remember the original.
        self.piece_args[name] = (args, has_tuple_output(gm))
        key = _dedupe_key(gm, self.compiler)
        if key in self.cache:
            owner, compiled = self.cache[key]
            self.runners[name] = PieceRunner(compiled, shares_compile_with=owner)
            return
        start = time.perf_counter()
        compiled = compile_one(gm, args, self.compiler)
        logger.debug(
            "compiled %s with %s in %.2fs", name, self.compiler, time.perf_counter() - start
        )
        if key is not None:
            self.cache[key] = (name, compiled)
        self.runners[name] = PieceRunner(compiled)


class _Interpreter(fx.Interpreter):
    """Propagates fake values through the stitching graph, compiling capturable pieces."""

    def __init__(self, split: SplitResult, pieces: _Pieces) -> None:
        super().__init__(split.split_gm)
        self.capturable = {item.name for item in split.capturable}
        self.pieces = pieces

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        out = super().call_module(target, args, kwargs)
        if target in self.capturable:
            self.pieces.compile(target, list(args))
        return out


def recorded_args(item: SplitItem, graph_args: Sequence[Any], fake_mode: Any) -> list[Any] | None:
    """A piece's arguments without a fake run: the graph's own (fake) argument where the piece
    takes one, else the value Dynamo traced, which the split copied onto the piece's
    placeholder and which is moved into `fake_mode` here (Dynamo hands the backend a fake mode
    of its own over the tracing's shape environment); None when such a value is missing or has
    other symbols."""
    args = []
    placeholders = item.graph.graph.find_nodes(op="placeholder")
    if len(placeholders) != len(item.input_args):
        return None
    for node, graph_input in zip(placeholders, item.input_args, strict=True):
        if graph_input is not None:
            args.append(graph_args[graph_input])
            continue
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor):
            traced_in = getattr(value, "fake_mode", None)
            if traced_in is None or traced_in.shape_env is not fake_mode.shape_env:
                return None
            value = fake_mode.from_tensor(value)
        elif isinstance(value, torch.SymInt):
            if value.node.shape_env is not fake_mode.shape_env:
                return None
        elif not isinstance(value, (int, float, bool)):
            return None
        args.append(value)
    return args


def compile_pieces(
    split: SplitResult,
    example_inputs: Sequence[Any],
    compiler: str,
    compile_sizes: Sequence[int] = (),
    batch_exprs: frozenset[Any] = frozenset(),
) -> dict[str, PieceRunner]:
    """Compile every capturable piece; returns piece name -> runner."""
    pieces = _Pieces(split.split_gm, compiler)
    if compiler == "eager":  # a piece's generated forward needs no arguments to be built
        for item in split.capturable:
            pieces.compile(item.name, [])
        return pieces.runners
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    fake_args = [_fake(a, fake_mode) for a in example_inputs]
    recorded = {item.name: recorded_args(item, fake_args, fake_mode) for item in split.capturable}
    with fake_mode, enable_python_dispatcher():
        if all(args is not None for args in recorded.values()):
            for name, args in recorded.items():
                pieces.compile(name, args)  # type: ignore[arg-type]
        else:
            logger.debug("a piece's input has no fake value: running the split graph on fakes")
            _Interpreter(split, pieces).run(*fake_args)
    if compile_sizes and compiler == "inductor":
        for name, runner in pieces.runners.items():
            args, returns_tuple = pieces.piece_args[name]
            gm = split.split_gm.get_submodule(name)
            _specialize(runner, gm, args, returns_tuple, compile_sizes, batch_exprs)
    return pieces.runners


def _fake(value: Any, fake_mode: Any) -> Any:
    """`value` in `fake_mode`: a real tensor's fake (Dynamo's, memoised), a fake of that mode as
    it is (a precompiled graph's rebuilt examples: `from_tensor` made a new fake of each, 0.63 s
    under cProfile for the 16-layer bf16 Llama's load on the H100)."""
    if isinstance(value, FakeTensor) and value.fake_mode is fake_mode:
        return value
    return fake_mode.from_tensor(value) if isinstance(value, torch.Tensor) else value


def _specialize(
    runner: PieceRunner,
    gm: fx.GraphModule,
    args: list[Any],
    returns_tuple: bool,
    sizes: Sequence[int],
    batch_exprs: frozenset[Any],
) -> None:
    """Add artifacts with the batch fixed to each of `sizes` (pieces that see the batch)."""
    index = next(
        (
            i
            for i, a in enumerate(args)
            if isinstance(a, torch.SymInt) and a.node.expr in batch_exprs
        ),
        None,
    )
    if index is None:
        return
    runner.size_index = index
    for size in sizes:
        try:
            runner.by_size[size] = compile_for_size(gm, args, size, batch_exprs, returns_tuple)
        except torch._dynamo.exc.RestartAnalysis:
            raise
        except Exception as exc:  # noqa: BLE001 - the general artifact serves every size
            warn_compile_failed(
                gm, f" for batch {size}", exc, "its general artifact serves that size"
            )


def _dedupe_key(gm: fx.GraphModule, compiler: str) -> Any:
    """Pieces holding constants (get_attr) are never shared: their code embeds the constant."""
    if any(n.op == "get_attr" for n in gm.graph.nodes):
        return None
    return (compiler, graph_signature(gm))


def count_compilations(runners: dict[str, PieceRunner]) -> int:
    """Compiler invocations behind these runners: shared artifacts count once."""
    return sum((r.shares_compile_with is None) + len(r.by_size) for r in runners.values())
