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
picks one by the batch-size argument at call time, when the call's other sizes (ints, tensor
shapes and strides) are the traced ones the artifact was compiled with. A piece Inductor fails
to compile runs its generated forward, a size it fails to specialise runs the general artifact
(one WARNING each); Dynamo's `RestartAnalysis` propagates.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor

from cgcompile.passes.output_addmm import OutputAddmmPass
from cgcompile.passes.split import SplitItem, SplitResult, generated_forward, graph_signature

logger = logging.getLogger(__name__)

Compiled = Callable[..., Any]


class PieceRunner:
    """Calls the general artifact, or the one specialised for the current batch size when the
    call's other sizes are those it was compiled with (`Specialized.matches`)."""

    def __init__(self, general: Compiled, shares_compile_with: str | None = None) -> None:
        self.general = general
        self.shares_compile_with = shares_compile_with
        self.size_index: int | None = None
        self.by_size: dict[int, Specialized] = {}

    def __call__(self, *args: Any) -> Any:
        if self.by_size:
            special = self.by_size.get(args[self.size_index])
            if special is not None and special.matches(args):
                return special.fn(*args)
        return self.general(*args)


@dataclasses.dataclass(frozen=True)
class Specialized:
    """An artifact compiled for one batch size. Every other size in it is the value the graph
    was traced with, so it serves only calls whose other ints and tensor shapes and strides
    are those (`layout`); any other call takes the general artifact."""

    fn: Compiled
    layout: tuple[Any, ...]

    def matches(self, args: Sequence[Any]) -> bool:
        return _layout(args) == self.layout


def _layout(args: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(
        (tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a
        for a in args
        if isinstance(a, (torch.Tensor, int))
    )


def compile_one(gm: fx.GraphModule, args: Sequence[Any], compiler: str) -> Compiled:
    """Compile a piece for the (fake, symbolic) args it receives. A piece Inductor fails to
    compile runs its generated forward instead (captured like any piece), with one WARNING: one piece
    Inductor cannot lower must not fail the model's call. Dynamo's `RestartAnalysis`
    propagates."""
    if compiler == "eager":
        return generated_forward(gm)
    from torch._inductor.compile_fx import compile_fx

    returns_tuple = has_tuple_output(gm)
    try:
        with _piece_passes():
            return compile_fx(gm, list(args))
    except torch._dynamo.exc.RestartAnalysis:
        raise
    except Exception as exc:  # noqa: BLE001 - any compile failure of a piece: it runs eagerly
        _warn_failed(gm, "", exc, "its traced ops run as they are (captured like any piece)")
        eager = generated_forward(gm)  # Inductor's passes may have rewritten gm (equivalently)
        if returns_tuple or not has_tuple_output(gm):
            return eager
        return lambda *a: eager(*a)[0]  # Inductor made its bare output a tuple


def _warn_failed(gm: fx.GraphModule, where: str, exc: Exception, instead: str) -> None:
    first_line = (str(exc).strip().splitlines() or [""])[0][:300]
    logger.warning(
        "Inductor failed to compile a piece%s (%s: %s): %s",
        where,
        type(exc).__name__,
        first_line,
        instead,
    )
    logger.debug("the piece Inductor failed on:\n%s", gm.code, exc_info=True)


def _piece_passes() -> Any:
    """Inductor's config for a piece: its outputs' residual adds stay out of cuBLAS
    (`passes.output_addmm`), as in the unsplit graph."""
    return torch._inductor.config.patch(
        post_grad_custom_post_pass=OutputAddmmPass.after_configured()
    )


def has_tuple_output(gm: fx.GraphModule) -> bool:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return isinstance(output.args[0], (tuple, list))


def compile_for_size(
    gm: fx.GraphModule,
    args: Sequence[Any],
    size: int,
    batch_exprs: frozenset[Any],
    returns_tuple: bool,
) -> Specialized:
    """Inductor artifact for real example inputs with the batch fixed to `size` and every other
    size fixed to its traced value."""
    concrete = [_concretize(a, size, batch_exprs) for a in args]
    with _piece_passes():
        artifact = torch._inductor.standalone_compile(
            gm, concrete, dynamic_shapes="from_example_inputs"
        )
    fn = artifact if returns_tuple else lambda *a: artifact(*a)[0]  # always a sequence
    return Specialized(fn, _layout(concrete))


def _concretize(arg: Any, size: int, batch_exprs: frozenset[Any]) -> Any:
    def dim(d: Any) -> int:
        if isinstance(d, torch.SymInt) and d.node.expr in batch_exprs:
            return size
        return int(d.node.hint) if isinstance(d, torch.SymInt) else int(d)

    if isinstance(arg, torch.SymInt):
        return dim(arg)
    if isinstance(arg, torch.Tensor):
        shape = [dim(d) for d in arg.shape]
        stride = [dim(s) for s in arg.stride()]
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            return torch.empty_strided(shape, stride, dtype=arg.dtype, device=arg.device)
    return arg


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
            _warn_failed(gm, f" for batch {size}", exc, "its general artifact serves that size")


def _dedupe_key(gm: fx.GraphModule, compiler: str) -> Any:
    """Pieces holding constants (get_attr) are never shared: their code embeds the constant."""
    if any(n.op == "get_attr" for n in gm.graph.nodes):
        return None
    return (compiler, graph_signature(gm))


def count_compilations(runners: dict[str, PieceRunner]) -> int:
    """Compiler invocations behind these runners: shared artifacts count once."""
    return sum((r.shares_compile_with is None) + len(r.by_size) for r in runners.values())
