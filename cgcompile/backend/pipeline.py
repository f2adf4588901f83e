"""From a Dynamo graph to a `CompiledGraph`: the backend's steps, in order.

1. find the attention ops in the graph and the lowest CUDA-graph support among them, the
   inputs the graph writes in place (`passes.mutation`) and whether padding a batch could
   change what the caller sees (`passes.pad_safety`): two runs on fake tensors, whose results
   (`Analyses`) a graph rebuilt from a precompiled file takes from the file instead;
2. resolve the requested mode against that support, the attention left unsplit and whether
   the outputs need autograd (`resolution`), logging every downgrade;
3. choose the path: with `use_inductor_graph_partition` and a mode with piecewise graphs,
   Inductor compiles the whole graph and partitions it (`partition`) where it can; otherwise,
   or when it cannot (logged at WARNING with the reason), the FX split (`fx_split`) compiles
   each piece; either way each piece or partition gets a PIECEWISE `CUDAGraphWrapper`;
4. wrap the whole compiled graph in a FULL `CUDAGraphWrapper` if the mode has full graphs
   (FULL_AND_PIECEWISE on the FX split with Inductor: a second compile of the unsplit graph,
   `full_graph_compile`, other calls passing through to the split); all wrappers share one
   graph runtime (one memory pool);
5. build the dispatcher's keys and return the runtime entry.
Counters are updated only once all steps succeeded: Dynamo may restart analysis mid-way.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from cgcompile.attention import attention_ops, find_attention, is_split_at
from cgcompile.backend.build import BuildRequest, Built
from cgcompile.backend.compile_cache import cache_delta, inductor_cache_counts, note_compiled
from cgcompile.backend.fx_split import build_split
from cgcompile.backend.partition import (
    Fallback,
    FallbackRule,
    PartitionedCompile,
    compile_partitioned,
    unavailable_reason,
)
from cgcompile.backend.preconditions import (
    check_batch_dims,
    needs_autograd,
    pad_check,
    unsplit_attention_of,
)
from cgcompile.backend.wrapping import full_wrapper, piecewise_factory
from cgcompile.config import AttentionCGSupport, CompilationConfig, CUDAGraphMode
from cgcompile.counters import counters
from cgcompile.dispatcher import CudagraphDispatcher
from cgcompile.errors import ConfigError
from cgcompile.passes.mutation import ANALYSIS_ERRORS, Effects, find_effects
from cgcompile.passes.op_match import OpMatcher, unknown_op_names
from cgcompile.passes.pad_safety import PadCheck
from cgcompile.passes.split import generated_forward
from cgcompile.resolution import Resolution, resolve_cudagraph_mode
from cgcompile.runtime.compiled_graph import CompiledGraph
from cgcompile.runtime.inputs import InputPlan
from cgcompile.runtime.report import INDUCTOR_PARTITION, GraphReport, PieceInfo
from cgcompile.wrappers import CUDAGraphWrapper, make_graph_runtime

logger = logging.getLogger(__name__)
_graph_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class Analyses:
    """What step 1's runs of the graph on fake tensors found; a graph rebuilt from a
    precompiled file reuses its saving process's (`CompiledGraph.analyses`)."""

    effects: Effects
    not_analysed: str | None
    """Why the effects are unknown (the fake run failed), if so."""
    pad_unsafe: str | None
    """Why padding could change what the caller sees, if so."""


def compile_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    config: CompilationConfig,
    analyses: Analyses | None = None,
) -> CompiledGraph:
    start = time.perf_counter()
    graph_id = next(_graph_ids)
    specs = attention_ops() if config.splitting_ops is None else config.splitting_ops
    matcher = OpMatcher(specs)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    attention = find_attention(targets)
    support = _lowest_support(config, attention)
    _warn_unknown_ops(graph_id, config, targets)
    runtime_kind, device = _choose_runtime(config, example_inputs)
    pads = config.cudagraph_mode != CUDAGraphMode.NONE and runtime_kind is not None
    plan, analyses = _analysed_plan(graph_id, gm, example_inputs, pads, analyses)
    if runtime_kind == "cuda":
        plan = plan.with_host_scalars(example_inputs)
    if support == AttentionCGSupport.ALWAYS:
        plan = plan.with_decode_by_shape(gm, config.uniform_decode_query_len)
    resolution = resolve_cudagraph_mode(
        config.cudagraph_mode,
        support,
        splits_attention=is_split_at(matcher, targets),
        piecewise_available=bool(matcher),
        graphs_available=runtime_kind is not None,
        not_analysed=analyses.not_analysed,
        needs_autograd=needs_autograd(gm),
        unsplit_attention=unsplit_attention_of(config, matcher, targets),
        uniform_decode_query_len=config.uniform_decode_query_len,
        capture_sizes=_capture_sizes(config, plan),
    )
    mode = resolution.mode
    if mode != CUDAGraphMode.NONE:
        check_batch_dims(example_inputs, plan, mode)
    runtime = make_graph_runtime(runtime_kind, device) if mode != CUDAGraphMode.NONE else None
    wrappers: list[CUDAGraphWrapper] = []
    make_wrapper = piecewise_factory(runtime, config, graph_id, wrappers)
    request = BuildRequest(gm, example_inputs, config, plan, mode, specs, make_wrapper)
    cache_before = inductor_cache_counts()
    built = _build(request, graph_id)
    runnable = built.runnable
    if mode.has_full_cudagraphs():
        runnable = full_wrapper(runnable, built.full_runnable, runtime, config, graph_id, plan)
        wrappers.insert(0, runnable)
    dispatcher = CudagraphDispatcher(config, resolution.capture_sizes)
    dispatcher.initialize_cudagraph_keys(mode, config.uniform_decode_query_len)
    _count(built.counts)
    report = _report(graph_id, config, resolution, attention, support, runtime_kind, built)
    report.compile_seconds = time.perf_counter() - start
    report.inductor_cache = cache_delta(cache_before, inductor_cache_counts())
    note_compiled(graph_id)
    report.pad_unsafe = plan.pad_unsafe
    _log_resolution(graph_id, resolution, attention, built)
    shapes_only, traced = built.shapes_only, generated_forward(gm)
    graph = CompiledGraph(
        runnable, dispatcher, plan, report, wrappers, runtime, shapes_only, traced
    )
    graph.analyses = analyses
    return graph


def _lowest_support(
    config: CompilationConfig, attention: dict[str, AttentionCGSupport]
) -> AttentionCGSupport:
    """The configured support, else the lowest among the graph's attention ops."""
    if config.attention_cg_support is not None:  # NEVER is 0: test for None, not truthiness
        return config.attention_cg_support
    return min(attention.values(), default=AttentionCGSupport.ALWAYS)


def _analysed_plan(
    graph_id: int,
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    pads: bool,
    saved: Analyses | None,
) -> tuple[InputPlan, Analyses]:
    """The input plan with step 1's analyses (`pads`: whether padding safety matters): run
    now, in one fake run of the graph, or taken from `saved`."""
    if saved is not None:
        plan = InputPlan.from_graph(gm, example_inputs, saved.effects)
        if pads:
            plan = dataclasses.replace(plan, pad_unsafe=saved.pad_unsafe)
        return plan, Analyses(saved.effects, saved.not_analysed, plan.pad_unsafe)
    # the batch, names and pad values do not depend on the effects
    check = pad_check(gm, InputPlan.from_graph(gm, example_inputs)) if pads else None
    effects, not_analysed = _effects(graph_id, gm, example_inputs, check)
    plan = InputPlan.from_graph(gm, example_inputs, effects)
    if check is not None:
        plan = dataclasses.replace(plan, pad_unsafe=check.verdict().reason)
    return plan, Analyses(effects, not_analysed, plan.pad_unsafe)


def _effects(
    graph_id: int, gm: fx.GraphModule, example_inputs: Sequence[Any], check: PadCheck | None
) -> tuple[Effects, str | None]:
    """The graph's effects on its inputs, or (none, why they are unknown); `check` judges
    padding during the same run."""
    try:
        return find_effects(gm, example_inputs, check.watch if check else None), None
    except ANALYSIS_ERRORS as exc:
        logger.debug("graph %d: fake run failed", graph_id, exc_info=True)
        return Effects((), {}), f"{type(exc).__name__}: {exc}".strip().split("\n")[0]


def _warn_unknown_ops(graph_id: int, config: CompilationConfig, targets: list[Any]) -> None:
    unknown = unknown_op_names(config.splitting_ops or (), targets)
    if unknown:
        logger.warning(
            "graph %d: splitting_ops %s name no op that torch knows, and this graph calls none "
            "of them; check the spelling ('ns::op' as given to torch.library.custom_op) or "
            "define the op before the first call",
            graph_id,
            unknown,
        )


def _build(request: BuildRequest, graph_id: int) -> Built:
    """Inductor's partition where asked for and possible, else the FX split (logged why)."""
    fallback = None
    wasted = 0
    asked = request.config.use_inductor_graph_partition
    if asked is not False:  # True, or None: where available
        fallback = unavailable_reason(request)
        if fallback is None:
            result = compile_partitioned(request)
            if result.num_partitions:
                return _partition_built(result)
            wasted = result.num_compilations
            cause = "every node was a boundary (non-CUDA or cudagraph-unsafe ops) or no kernels"
            fallback = Fallback(FallbackRule.NO_PARTITION_FORMED, cause)
        _log_fallback(graph_id, fallback, loud=asked is True)
    built = build_split(request)
    built.counts["num_backend_compilations"] += wasted
    built.partition_fallback = None if fallback is None else str(fallback)
    return built


def _log_fallback(graph_id: int, fallback: Fallback, loud: bool) -> None:
    # Without piecewise graphs both paths compile the same whole graph: nothing is lost.
    if loud and fallback.rule is not FallbackRule.NO_PIECEWISE_GRAPHS:
        log = logger.warning
    else:
        log = logger.info
    log("graph %d: Inductor graph partition not used, the FX split is: %s", graph_id, fallback)


def _partition_built(result: PartitionedCompile) -> Built:
    n = result.num_partitions
    counts = {
        "num_graphs_seen": 1,
        "num_piecewise_graphs_seen": 1,  # Dynamo's graph, whole
        "num_piecewise_capturable_graphs_seen": 1,
        "num_backend_compilations": result.num_compilations,
        "num_inductor_partitions": n,
    }
    pieces = [PieceInfo(f"partition_{i}", True, ()) for i in range(n)]
    return Built(result.runnable, pieces, counts, INDUCTOR_PARTITION, n)


def _choose_runtime(
    config: CompilationConfig, example_inputs: Sequence[Any]
) -> tuple[str | None, torch.device | None]:
    cuda = next(
        (t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda), None
    )
    if config.graph_runtime == "simulated":
        return "simulated", None
    if config.graph_runtime == "cuda":
        if cuda is None:
            raise ConfigError(
                "graph_runtime='cuda' but no input of this graph is on a CUDA device; move the "
                "model and inputs to CUDA, or use graph_runtime='auto' or 'simulated'"
            )
        return "cuda", cuda
    return ("cuda", cuda) if cuda is not None else (None, None)


def _capture_sizes(config: CompilationConfig, plan: InputPlan) -> tuple[int, ...]:
    """The sizes this graph can run at: a static batch only its own; a backed batch not 1,
    which Dynamo sends to a graph of its own."""
    if plan.static_batch is not None:
        return (plan.static_batch,)
    sizes = tuple(s for s in config.cudagraph_capture_sizes if s >= plan.min_batch)
    if len(sizes) < len(config.cudagraph_capture_sizes):
        logger.info(
            "capture sizes below %d dropped: this graph's guards exclude them", plan.min_batch
        )
    return sizes


def _count(deltas: dict[str, int]) -> None:
    for name, delta in deltas.items():
        setattr(counters, name, getattr(counters, name) + delta)


def _report(
    graph_id: int,
    config: CompilationConfig,
    resolution: Resolution,
    attention: dict[str, AttentionCGSupport],
    support: AttentionCGSupport,
    runtime_kind: str | None,
    built: Built,
) -> GraphReport:
    return GraphReport(
        graph_id=graph_id,
        requested_mode=str(resolution.requested),
        mode=str(resolution.mode),
        reasons=[str(r) for r in resolution.reasons],
        attention_ops={name: str(s) for name, s in attention.items()},
        attention_support=str(support),
        graph_runtime=runtime_kind if resolution.mode != CUDAGraphMode.NONE else None,
        compiler=config.compiler,
        pieces=built.pieces,
        capture_sizes=list(resolution.capture_sizes),
        compile_seconds=0.0,
        compile_path=built.path,
        num_partitions=built.num_partitions,
        partition_fallback=built.partition_fallback,
        full_graph_compile=built.full_graph_compile(resolution.mode),
        compile_parts=built.compile_parts,
    )


def _log_resolution(
    graph_id: int, resolution: Resolution, attention: dict[str, Any], built: Built
) -> None:
    for reason in resolution.reasons:
        logger.warning("graph %d: cudagraph mode %s", graph_id, reason)
    logger.info(
        "graph %d: mode %s, %s, %d pieces (%d capturable), attention %s",
        graph_id,
        resolution.mode,
        built.path,
        len(built.pieces),
        sum(p.capturable for p in built.pieces),
        attention or "none",
    )
