"""One compile for every batch size: Dynamo's batch-1 graph served by the dynamic graph.

A backed dynamic batch gets two Dynamo graphs, one for sizes >= 2 and one for size 1 (Dynamo
specialises 1). With `batch_one="padded"` (the default), the backend compiles the first and,
when the second arrives, compares it with each live dynamic graph of the same options
(`passes.batch_one_match`); on a match it hands Dynamo a `PaddedBatchOne` instead of compiling:
batch-1 calls replay the dynamic graph's graphs of 2 rows. The dynamic graph must pad freely
(`plan.pad_unsafe` is None) and use graphs; otherwise, or on a mismatch, or when batch 1 came
first (no dynamic graph yet), or with `batch_one="own"`, the batch-1 graph compiles on its own
as any graph does (the log and the report say why).

    served, why_not = serve_batch_one(gm, example_inputs, plan, config)  # None: compile gm
    remember_dynamic(compiled, gm, config)                  # after compiling a dynamic graph
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

from cgcompile.backend.input_analysis import plan_inputs
from cgcompile.calls.compiled_graph import CompiledGraph
from cgcompile.calls.input_plan import InputPlan
from cgcompile.calls.padded_batch_one import PaddedBatchOne
from cgcompile.config import CompilationConfig
from cgcompile.counters import counters
from cgcompile.dynamic import is_marked_batch
from cgcompile.errors import CGCompileError
from cgcompile.passes.batch_one_match import match_batch_one
from cgcompile.passes.split import generated_forward

logger = logging.getLogger(__name__)

_dynamic: weakref.WeakKeyDictionary[CompiledGraph, tuple[fx.GraphModule, CompilationConfig]] = (
    weakref.WeakKeyDictionary()
)
"""Live compiled graphs of a backed dynamic batch that can serve batch 1, with their Dynamo
graph and options."""


def remember_dynamic(graph: CompiledGraph, gm: fx.GraphModule, config: CompilationConfig) -> None:
    """Keep `graph` as a candidate for batch-1 graphs to come, if it can serve them."""
    plan = graph.plan
    if plan.batch_exprs and plan.min_batch == 2 and graph.uses_graphs and not plan.pad_unsafe:
        if graph.dispatcher.max_capture_size >= 2:
            _dynamic[graph] = (gm, config)


def _tensor_names(plan: InputPlan) -> list[str]:
    """The graph's input names but the batch sizes': Dynamo's sources (`L['tokens']`) in a
    just-in-time trace, node names under AOT compile, which `cgcompile.trusted` binds by."""
    return [n for i, n in enumerate(plan.names) if i not in plan.size_indices]


def _candidates(plan: InputPlan, config: CompilationConfig) -> list[tuple[CompiledGraph, Any]]:
    """Live dynamic graphs of the same options and input names, newest first."""
    return [
        (graph, dynamic_gm)
        for graph, (dynamic_gm, dynamic_config) in sorted(
            _dynamic.items(), key=lambda item: -item[0].report_id
        )
        # other options, or another trace's sources (AOT against JIT, ...)
        if dynamic_config == config and _tensor_names(graph.plan) == _tensor_names(plan)
    ]


def _serve(
    graph: CompiledGraph, size_positions: tuple[int, ...], traced: Callable[..., Any]
) -> PaddedBatchOne:
    logger.info(
        "Dynamo's batch-1 graph is graph %d at batch 1: served by it, padded to 2 rows "
        "(no compile, no graphs of its own)",
        graph.report_id,
    )
    counters.num_graphs_seen += 1
    counters.num_graphs_shared += 1
    graph.report.serves_batch_one = True
    return PaddedBatchOne(graph, size_positions, traced)


def serve_batch_one(
    gm: fx.GraphModule, example_inputs: Sequence[Any], plan: InputPlan, config: CompilationConfig
) -> tuple[PaddedBatchOne | None, str | None]:
    """(a server for `gm`, None) if it is a batch-1 graph some live dynamic graph computes at
    batch 1; else (None, why not) for a batch-1 graph a dynamic graph could have served, or
    (None, None)."""
    if config.batch_one != "padded" or plan.static_batch != 1:
        return None, None
    candidates = _candidates(plan, config)
    if not candidates:
        return None, _came_first(example_inputs)
    mismatches = []
    for graph, dynamic_gm in candidates:
        match = match_batch_one(dynamic_gm, gm, graph.plan.batch_exprs)
        if match.mismatch is None:
            return _serve(graph, match.size_positions, generated_forward(gm)), None
        mismatches.append(f"not graph {graph.report_id} at batch 1: {match.mismatch}")
    why = "; ".join(mismatches)
    logger.info("Dynamo's batch-1 graph compiles on its own: it is %s", why)
    return None, why


def _came_first(example_inputs: Sequence[Any]) -> str | None:
    """Why a batch-1 graph of a marked batch found no dynamic graph to serve it: it came first.
    None for a graph whose inputs were never marked (a static batch of 1, not Dynamo's)."""
    if not any(is_marked_batch(value) for value in example_inputs):
        return None
    why = (
        "it came first, before any graph of a dynamic batch with the same options; a first "
        "call of 2 or more rows lets batch 1 share that graph's compile"
    )
    logger.info("Dynamo's batch-1 graph compiles on its own: %s", why)
    return why


def code_digest(gm: fx.GraphModule) -> str:
    """Which dynamic graph a batch-1 graph was matched with, as its saving process saw it."""
    return hashlib.sha256(gm.code.encode()).hexdigest()


def serve_matched_batch_one(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    config: CompilationConfig,
    size_positions: tuple[int, ...],
    dynamic_digest: str,
    traced: Callable[..., Any],
) -> PaddedBatchOne:
    """A batch-1 graph rebuilt from a precompiled file, whose saving process matched it with a
    dynamic graph saved before it in the same file: served by the live dynamic graph of the
    same options, input names and code (`code_digest`), without matching the nodes again (a
    saved batch-1 graph keeps its placeholders alone in `gm`; `traced` runs its nodes)."""
    plan = plan_inputs(gm, example_inputs)
    for graph, dynamic_gm in _candidates(plan, config):
        if code_digest(dynamic_gm) == dynamic_digest:
            return _serve(graph, size_positions, traced)
    raise CGCompileError(
        "a precompiled batch-1 graph was served by a dynamic graph that is not loaded"
    )


def dynamic_gm_of(graph: CompiledGraph) -> fx.GraphModule:
    """The Dynamo graph of a live dynamic graph that serves batch 1."""
    return _dynamic[graph][0]
