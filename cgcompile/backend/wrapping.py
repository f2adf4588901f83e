"""How the backend wraps a compiled graph: a PIECEWISE `CUDAGraphWrapper` per piece or partition
(`piecewise_factory`, shared by both compile paths) and a FULL one around the whole graph
(`full_wrapper`). All wrappers of one compiled graph share one graph runtime (one pool).

    make = piecewise_factory(runtime, config, graph_id, wrappers)
    piece = make(compiled_piece, name="submod_0", copy_arg_indices=[0])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cgcompile.calls.cuda_graph_wrapper import CUDAGraphWrapper, WrapperFactory
from cgcompile.calls.input_plan import InputPlan
from cgcompile.config import CompilationConfig, CUDAGraphMode
from cgcompile.graphs import GraphRuntime


def full_wrapper(
    runnable: Callable[..., Any],
    full_runnable: Callable[..., Any] | None,
    runtime: GraphRuntime | None,
    config: CompilationConfig,
    graph_id: int,
    plan: InputPlan,
) -> CUDAGraphWrapper:
    """The FULL wrapper around the whole compiled graph (`full_runnable` where full graphs
    have a compile of their own; other calls then run `runnable`); parameters and buffers are
    the graph inputs whose addresses the backend checks by instance, not per replay."""
    return CUDAGraphWrapper(
        full_runnable or runnable,
        CUDAGraphMode.FULL,
        runtime,
        name=f"graph{graph_id}.full",
        num_warmups=config.num_warmups,
        fixed_arg_indices=plan.static_tensors,
        weak_output=True,
        passthrough=None if full_runnable is None else runnable,
    )


def piecewise_factory(
    runtime: GraphRuntime | None,
    config: CompilationConfig,
    graph_id: int,
    made: list[CUDAGraphWrapper],
) -> WrapperFactory:
    """How both paths wrap a piece or partition PIECEWISE; each wrapper is kept for reports."""

    def make(
        runnable: Callable[..., Any],
        *,
        name: str,
        copy_arg_indices: Sequence[int] = (),
        fixed_arg_indices: Sequence[int] = (),
        weak_output: bool = False,
    ) -> CUDAGraphWrapper:
        wrapper = CUDAGraphWrapper(
            runnable,
            CUDAGraphMode.PIECEWISE,
            runtime,
            name=f"graph{graph_id}.{name}",
            num_warmups=config.num_warmups,
            copy_arg_indices=copy_arg_indices,
            fixed_arg_indices=fixed_arg_indices,
            weak_output=weak_output,
        )
        made.append(wrapper)
        return wrapper

    return make
