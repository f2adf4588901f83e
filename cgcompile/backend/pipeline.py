"""From a Dynamo graph to a `CompiledGraph`: the backend's steps, in order.

1. find the attention ops in the graph and the lowest CUDA-graph support among them, the
   inputs the graph writes in place (`passes.mutation`) and whether padding a batch could
   change what the caller sees (`passes.pad_safety`);
2. resolve the requested mode against that support (`resolution`), logging every downgrade;
3. split at the splitting ops (`passes.split`) if the mode has piecewise graphs; otherwise the
   whole graph is one piece, so Inductor can fuse across attention;
4. compile each capturable piece once, with the symbolic batch (`piece_compiler`);
5. wrap each piece in a PIECEWISE `CUDAGraphWrapper` and the stitched graph in a FULL one,
   as the resolved mode needs, all sharing one graph runtime (one memory pool);
6. build the dispatcher's keys and return the runtime entry.
Counters are updated only once all steps succeeded: Dynamo may restart analysis mid-way.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from cgcompile.attention import (
    attention_ops,
    attention_support_of,
    find_attention,
    is_split_at,
    unsplit_attention,
)
from cgcompile.backend.compiled_graph import CompiledGraph
from cgcompile.backend.dry_run import shapes_only
from cgcompile.backend.inputs import InputPlan
from cgcompile.backend.piece_compiler import PieceRunner, compile_pieces, count_compilations
from cgcompile.backend.report import GraphReport, PieceInfo
from cgcompile.config import AttentionCGSupport, CompilationConfig, CUDAGraphMode
from cgcompile.counters import counters
from cgcompile.dispatcher import CudagraphDispatcher
from cgcompile.dynamic import BATCH_DIM_ATTRIBUTE
from cgcompile.errors import ConfigError
from cgcompile.passes.mutation import find_mutated_inputs
from cgcompile.passes.op_match import OpMatcher, unknown_op_names
from cgcompile.passes.pad_safety import check_pad_safety
from cgcompile.passes.split import SplitResult, split_graph
from cgcompile.resolution import Resolution, resolve_cudagraph_mode
from cgcompile.wrappers import CUDAGraphWrapper, GraphRuntime, make_graph_runtime

logger = logging.getLogger(__name__)
_graph_ids = itertools.count()


def compile_graph(
    gm: fx.GraphModule, example_inputs: Sequence[Any], config: CompilationConfig
) -> CompiledGraph:
    start = time.perf_counter()
    graph_id = next(_graph_ids)
    matcher = OpMatcher(attention_ops() if config.splitting_ops is None else config.splitting_ops)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    _warn_unknown_ops(graph_id, config, targets)
    attention = find_attention(targets)
    support = config.attention_cg_support
    if support is None:  # NEVER is 0: test for None, not truthiness
        support = min(attention.values(), default=AttentionCGSupport.ALWAYS)
    plan = InputPlan.from_graph(gm, example_inputs, find_mutated_inputs(gm, example_inputs))
    runtime_kind, device = _choose_runtime(config, example_inputs)
    if config.cudagraph_mode != CUDAGraphMode.NONE and runtime_kind is not None:
        safety = check_pad_safety(gm, example_inputs, plan.batch_exprs, _is_attention, plan.names)
        plan = dataclasses.replace(plan, pad_unsafe=safety.reason)
    resolution = resolve_cudagraph_mode(
        config.cudagraph_mode,
        support,
        splits_attention=is_split_at(matcher, targets),
        piecewise_available=bool(matcher),
        graphs_available=runtime_kind is not None,
        needs_autograd=_needs_autograd(gm),
        unsplit_attention=_unsplit(config, matcher, targets),
        uniform_decode_query_len=config.uniform_decode_query_len,
        capture_sizes=_capture_sizes(config, plan),
    )
    if resolution.mode != CUDAGraphMode.NONE:
        _check_batch_dims(example_inputs, plan, resolution.mode)
    # Only piecewise graphs need the split; otherwise Inductor sees (and fuses) the whole graph.
    needs_split = resolution.mode.requires_piecewise_compilation()
    split = split_graph(gm, matcher if needs_split else OpMatcher(()))
    runners = compile_pieces(
        split, example_inputs, config.compiler, config.compile_sizes, plan.batch_exprs
    )
    mode = resolution.mode
    runtime = make_graph_runtime(runtime_kind, device) if mode != CUDAGraphMode.NONE else None
    wrappers = _install_pieces(split, runners, mode, runtime, config, graph_id, plan)
    runnable: Any = split.split_gm.forward  # skips nn.Module.__call__ on the hot path
    if mode.has_full_cudagraphs():
        runnable = CUDAGraphWrapper(
            runnable,
            CUDAGraphMode.FULL,
            runtime,
            name=f"graph{graph_id}.full",
            num_warmups=config.num_warmups,
            fixed_arg_indices=plan.static_tensors,
            weak_output=True,
        )
        wrappers.insert(0, runnable)
    dispatcher = CudagraphDispatcher(config, resolution.capture_sizes)
    dispatcher.initialize_cudagraph_keys(mode, config.uniform_decode_query_len)
    _count(split, runners)
    report = _report(graph_id, config, resolution, attention, support, runtime_kind, split, runners)
    report.compile_seconds = time.perf_counter() - start
    report.pad_unsafe = plan.pad_unsafe
    _log_resolution(graph_id, resolution, attention, split)
    return CompiledGraph(
        runnable,
        dispatcher,
        plan,
        report,
        wrappers,
        runtime,
        functools.partial(shapes_only, split),
        traced=gm.forward,
    )


def _check_batch_dims(example_inputs: Sequence[Any], plan: InputPlan, mode: CUDAGraphMode) -> None:
    """Graph modes pad and slice dim 0: a batch marked in another dim is refused clearly."""
    for i, value in enumerate(example_inputs):
        dim = getattr(value, BATCH_DIM_ATTRIBUTE, 0)
        if dim != 0:
            raise ConfigError(
                f"mark_dynamic_batch(dim={dim}) marked dim {dim} of {plan.names[i]} as the "
                f"batch, but cudagraph_mode={mode} pads and slices the batch in dim 0 only; "
                f"move the batch to dim 0 (e.g. x.transpose(0, {dim})) and mark dim 0, or use "
                f"cudagraph_mode='NONE'"
            )


def _unsplit(
    config: CompilationConfig, matcher: OpMatcher, targets: list[Any]
) -> dict[str, AttentionCGSupport]:
    """Attention ops no splitting op splits, with their support (or the configured override)."""
    unsplit = unsplit_attention(matcher, targets)
    if config.attention_cg_support is None:
        return unsplit
    return dict.fromkeys(unsplit, config.attention_cg_support)


def _needs_autograd(gm: fx.GraphModule) -> bool:
    """Whether an output requires grad: Dynamo guards on grad mode and on each input's
    requires_grad, so every call of this graph needs autograd, or none does."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = [a.meta.get("example_value") for a in output.all_input_nodes]
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


def _is_attention(target: Any) -> bool:
    return attention_support_of(target) is not None


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


def _install_pieces(
    split: SplitResult,
    runners: dict[str, PieceRunner],
    mode: CUDAGraphMode,
    runtime: GraphRuntime | None,
    config: CompilationConfig,
    graph_id: int,
    plan: InputPlan,
) -> list[CUDAGraphWrapper]:
    """Shadow each capturable submodule with its compiled runner, wrapped if PIECEWISE."""
    wrappers = []
    static = set(plan.static_tensors)
    last = split.capturable[-1].name if split.capturable else None
    for item in split.capturable:
        runner = runners[item.name]
        piece: Any = runner if runner.by_size else runner.general  # one call less per piece
        if mode.has_piecewise_cudagraphs():
            piece = CUDAGraphWrapper(
                piece,
                CUDAGraphMode.PIECEWISE,
                runtime,
                name=f"graph{graph_id}.{item.name}",
                num_warmups=config.num_warmups,
                copy_arg_indices=item.fresh_arg_indices,
                fixed_arg_indices=[i for i, j in enumerate(item.input_args) if j in static],
                weak_output=item.name == last,
            )
            wrappers.append(piece)
        # An instance attribute wins over nn.Module's submodule lookup in forward().
        split.split_gm.__dict__[item.name] = piece
    for item in split.splitting:  # eager attention: skip nn.Module.__call__ per call
        split.split_gm.__dict__[item.name] = item.graph.forward
    return wrappers


def _count(split: SplitResult, runners: dict[str, PieceRunner]) -> None:
    counters.num_graphs_seen += 1
    counters.num_piecewise_graphs_seen += len(split.items)
    counters.num_piecewise_capturable_graphs_seen += len(split.capturable)
    counters.num_backend_compilations += count_compilations(runners)


def _report(
    graph_id: int,
    config: CompilationConfig,
    resolution: Resolution,
    attention: dict[str, AttentionCGSupport],
    support: AttentionCGSupport,
    runtime_kind: str | None,
    split: SplitResult,
    runners: dict[str, PieceRunner],
) -> GraphReport:
    pieces = [
        PieceInfo(
            item.name,
            not item.is_splitting,
            item.ops,
            None if item.is_splitting else runners[item.name].shares_compile_with,
        )
        for item in split.items
    ]
    return GraphReport(
        graph_id=graph_id,
        requested_mode=str(resolution.requested),
        mode=str(resolution.mode),
        reasons=[str(r) for r in resolution.reasons],
        attention_ops={name: str(s) for name, s in attention.items()},
        attention_support=str(support),
        graph_runtime=runtime_kind if resolution.mode != CUDAGraphMode.NONE else None,
        compiler=config.compiler,
        pieces=pieces,
        capture_sizes=list(resolution.capture_sizes),
        compile_seconds=0.0,
    )


def _log_resolution(
    graph_id: int, resolution: Resolution, attention: dict[str, Any], split: SplitResult
) -> None:
    for reason in resolution.reasons:
        logger.warning("graph %d: cudagraph mode %s", graph_id, reason)
    logger.info(
        "graph %d: mode %s, %d pieces (%d capturable), attention %s",
        graph_id,
        resolution.mode,
        len(split.items),
        len(split.capturable),
        attention or "none",
    )
