"""From a Dynamo graph to a `CompiledGraph`: the backend's steps, in order.

1. complete the graph's input plan (read once, `input_analysis`), find its attention ops and
   the lowest CUDA-graph support among them (one pass over its calls, `attention.scan_ops`),
   the inputs the graph writes in place and whether padding a batch could change what the
   caller sees: one run on fake tensors (`analyses`), whose results a graph rebuilt from a
   precompiled file takes from the file instead;
2. resolve the requested mode against that support, the attention left unsplit and whether
   the outputs need autograd (`resolution`), logging every downgrade;
3. choose the path: with `use_inductor_graph_partition` and a mode with piecewise graphs,
   Inductor compiles the whole graph and partitions it (`partition`) where it can; otherwise,
   or when it cannot (logged at WARNING with the reason), the FX split (`fx_split`) compiles
   each piece; either way each piece or partition gets a PIECEWISE `CUDAGraphWrapper`;
4. wrap the whole compiled graph in a FULL `CUDAGraphWrapper` if the mode has full graphs
   (FULL_AND_PIECEWISE on the FX split: the split's pieces recorded as one graph, or with
   `full_graph_compile="whole"` a second compile of the unsplit graph); all wrappers share one
   graph runtime (one memory pool);
5. build the dispatcher's keys and return the runtime entry.
Counters are updated only once all steps succeeded: Dynamo may restart analysis mid-way.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from cgcompile.backend.analyses import Analyses, analysed_plan
from cgcompile.backend.attention import attention_ops, scan_ops
from cgcompile.backend.build import BuildRequest, Built
from cgcompile.backend.fx_split import build_split
from cgcompile.backend.inductor_cache import cache_delta, inductor_cache_counts, note_compiled
from cgcompile.backend.input_analysis import with_decode_by_shape, with_host_scalars
from cgcompile.backend.partition import (
    PartitionedCompile,
    Refusal,
    RefusalRule,
    compile_partitioned,
    unavailable_reason,
)
from cgcompile.backend.preconditions import (
    check_batch_dims,
    needs_autograd,
    note_unmarked_recompile,
    unsplit_attention_of,
)
from cgcompile.backend.resolution import Resolution, resolve_cudagraph_mode
from cgcompile.backend.wrapping import full_wrapper, piecewise_factory
from cgcompile.calls import live_graphs
from cgcompile.calls.compiled_graph import CompiledGraph
from cgcompile.calls.cuda_graph_wrapper import CUDAGraphWrapper
from cgcompile.calls.dispatcher import CudagraphDispatcher
from cgcompile.calls.input_plan import InputPlan
from cgcompile.calls.report import INDUCTOR_PARTITION, GraphReport, PieceInfo
from cgcompile.config import AttentionCGSupport, CompilationConfig, CUDAGraphMode
from cgcompile.counters import counters
from cgcompile.errors import ConfigError
from cgcompile.graphs import make_graph_runtime
from cgcompile.passes.op_match import OpMatcher
from cgcompile.passes.split import generated_forward

logger = logging.getLogger(__name__)
_graph_ids = itertools.count()


def compile_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    config: CompilationConfig,
    plan: InputPlan,
    analyses: Analyses | None = None,
) -> CompiledGraph:
    """Steps 1-5 of the module doc for one Dynamo graph (`plan`: `plan_inputs`' for it;
    `analyses`: a saving process's)."""
    start = time.perf_counter()
    graph_id = next(_graph_ids)
    specs = attention_ops() if config.splitting_ops is None else config.splitting_ops
    matcher = OpMatcher(specs)
    ops = scan_ops(gm, matcher, config.splitting_ops or ())
    attention = ops.attention
    support = _lowest_support(config, attention)
    _warn_unknown_ops(graph_id, ops.unknown)
    runtime_kind, device = _choose_runtime(config, example_inputs)
    plan, analyses = _plan(
        graph_id, gm, example_inputs, config, plan, runtime_kind, support, analyses
    )
    note_unmarked_recompile(graph_id, gm, example_inputs, plan)
    resolution = resolve_cudagraph_mode(
        config.cudagraph_mode,
        support,
        splits_attention=ops.splits_attention,
        piecewise_available=bool(matcher),
        graphs_available=runtime_kind is not None,
        not_analysed=analyses.not_analysed,
        needs_autograd=needs_autograd(gm),
        unsplit_attention=unsplit_attention_of(config, ops),
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
    report.pad_unsafe = plan.pad_unsafe
    note_compiled(graph_id)
    _log_resolution(graph_id, resolution, attention, built)
    shapes_only, traced = built.shapes_only, generated_forward(gm)
    graph = CompiledGraph(
        runnable, dispatcher, plan, report, wrappers, runtime, shapes_only, traced
    )
    graph.analyses = analyses
    live_graphs.register(graph)
    return graph


def _plan(
    graph_id: int,
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    config: CompilationConfig,
    plan: InputPlan,
    runtime_kind: str | None,
    support: AttentionCGSupport,
    saved: Analyses | None,
) -> tuple[InputPlan, Analyses]:
    """Step 1 completes the input plan: the analyses, host scalars on CUDA, decode batches by
    shape."""
    pads = config.cudagraph_mode != CUDAGraphMode.NONE and runtime_kind is not None
    plan, analyses = analysed_plan(graph_id, gm, example_inputs, plan, pads, saved)
    if runtime_kind == "cuda":
        plan = with_host_scalars(plan, example_inputs)
    if support == AttentionCGSupport.ALWAYS:
        plan = with_decode_by_shape(plan, gm, config.uniform_decode_query_len)
    if plan.one_row is not None:
        logger.warning("graph %d: calls of one row will raise: %s", graph_id, plan.one_row)
    return plan, analyses


def _lowest_support(
    config: CompilationConfig, attention: dict[str, AttentionCGSupport]
) -> AttentionCGSupport:
    """The configured support, else the lowest among the graph's attention ops."""
    if config.attention_cg_support is not None:  # NEVER is 0: test for None, not truthiness
        return config.attention_cg_support
    return min(attention.values(), default=AttentionCGSupport.ALWAYS)


def _warn_unknown_ops(graph_id: int, unknown: list[str]) -> None:
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
    refusal = None
    wasted = 0
    asked = request.config.use_inductor_graph_partition
    if asked is not False:  # True, or None: where available
        refusal = unavailable_reason(request)
        if refusal is None:
            result = compile_partitioned(request)
            if result.num_partitions:
                return _partition_built(result)
            wasted = result.num_compilations
            cause = "every node was a boundary (non-CUDA or cudagraph-unsafe ops) or no kernels"
            refusal = Refusal(RefusalRule.NO_PARTITION_FORMED, cause)
        _log_refusal(graph_id, refusal, loud=asked is True)
    built = build_split(request)
    built.counts["num_backend_compilations"] += wasted
    built.partition_fallback = None if refusal is None else str(refusal)
    return built


def _log_refusal(graph_id: int, refusal: Refusal, loud: bool) -> None:
    # Without piecewise graphs both paths compile the same whole graph: nothing is lost.
    if loud and refusal.rule is not RefusalRule.NO_PIECEWISE_GRAPHS:
        log = logger.warning
    else:
        log = logger.info
    log("graph %d: Inductor graph partition not used, the FX split is: %s", graph_id, refusal)


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
    which Dynamo sends to a graph of its own, nor a batch whose one-row calls raise."""
    if plan.static_batch is not None:
        return (plan.static_batch,)
    least = max(plan.min_batch, 2 if plan.one_row is not None else 1)
    sizes = tuple(s for s in config.cudagraph_capture_sizes if s >= least)
    if len(sizes) < len(config.cudagraph_capture_sizes):
        logger.info("capture sizes below %d dropped: no call of this graph runs them", least)
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
