"""One capturable piece's compiled artifacts: Inductor's, compiled once with the symbolic batch
(or the piece's generated forward, where Inductor fails: one WARNING, the model's call goes on),
those specialised to a batch size (`compile_sizes`: a failure leaves that size to the general
artifact), and `PieceRunner`, which picks one per call. `piece_compiler` decides which pieces
compile, with which arguments.

    runner = PieceRunner(compile_one(gm, fake_args, "inductor"))
    runner.by_size[4] = compile_for_size(gm, fake_args, 4, batch_exprs, returns_tuple)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from cgcompile.passes.output_addmm import OutputAddmmPass
from cgcompile.passes.split import generated_forward

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
    compile runs its generated forward instead (captured like any piece), with one WARNING:
    one piece Inductor cannot lower must not fail the model's call. Dynamo's
    `RestartAnalysis` propagates."""
    if compiler == "eager":
        return generated_forward(gm)
    from torch._inductor.compile_fx import compile_fx

    returns_tuple = has_tuple_output(gm)
    try:
        with piece_passes():
            return compile_fx(gm, list(args))
    except torch._dynamo.exc.RestartAnalysis:
        raise
    except Exception as exc:  # noqa: BLE001 - any compile failure of a piece: it runs eagerly
        warn_compile_failed(gm, "", exc, "its traced ops run as they are (captured like any piece)")
        eager = generated_forward(gm)  # Inductor's passes may have rewritten gm (equivalently)
        if returns_tuple or not has_tuple_output(gm):
            return eager
        return lambda *a: eager(*a)[0]  # Inductor made its bare output a tuple


def warn_compile_failed(gm: fx.GraphModule, where: str, exc: Exception, instead: str) -> None:
    """One WARNING naming Inductor's error (its first line); the piece's code at DEBUG."""
    first_line = (str(exc).strip().splitlines() or [""])[0][:300]
    logger.warning(
        "Inductor failed to compile a piece%s (%s: %s): %s",
        where,
        type(exc).__name__,
        first_line,
        instead,
    )
    logger.debug("the piece Inductor failed on:\n%s", gm.code, exc_info=True)


def piece_passes() -> Any:
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
    with piece_passes():
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
