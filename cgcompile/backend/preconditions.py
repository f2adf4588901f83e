"""Facts about a Dynamo graph that decide which CUDA graphs it may have, checked once when it
compiles: whether padding a batch could change what the caller sees (`passes.pad_safety`),
whether its outputs need autograd, which attention ops no splitting op splits, and whether a
batch was marked outside dim 0 (refused in graph modes); and, for the user, whether Dynamo
compiled the graph again for a batch that was never marked.

    check = pad_check(gm, plan)   # find_effects(gm, example_inputs, check.watch); check.verdict()
    needs_autograd(gm), unsplit_attention_of(config, scan_ops(gm, matcher, specs))
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from cgcompile.backend.attention import GraphOps, attention_support_of
from cgcompile.calls.input_plan import InputPlan
from cgcompile.config import AttentionCGSupport, CompilationConfig, CUDAGraphMode
from cgcompile.dynamic import BATCH_DIM_ATTRIBUTE, is_marked_batch
from cgcompile.errors import ConfigError
from cgcompile.passes.op_match import op_names
from cgcompile.passes.pad_safety import PadCheck

logger = logging.getLogger(__name__)


def pad_check(gm: fx.GraphModule, plan: InputPlan) -> PadCheck:
    """The pad-safety check of `plan`'s batch, to ride along the effects' fake run (its verdict
    is `plan.pad_unsafe`); registered attention ops are trusted."""
    padded = [i for i, _ in plan.pad_values]
    return PadCheck(gm, plan.batch_exprs, _is_attention, plan.names, padded, plan.batch_state)


def _is_attention(target: Any) -> bool:
    return attention_support_of(target, op_names(target)) is not None


def needs_autograd(gm: fx.GraphModule) -> bool:
    """Whether an output requires grad: Dynamo guards on grad mode and on each input's
    requires_grad, so every call of this graph needs autograd, or none does."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = [a.meta.get("example_value") for a in output.all_input_nodes]
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


def unsplit_attention_of(config: CompilationConfig, ops: GraphOps) -> dict[str, AttentionCGSupport]:
    """Attention ops no splitting op splits, with their support (or the configured override)."""
    if config.attention_cg_support is None:
        return ops.unsplit
    return dict.fromkeys(ops.unsplit, config.attention_cg_support)


def check_batch_dims(example_inputs: Sequence[Any], plan: InputPlan, mode: CUDAGraphMode) -> None:
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


def note_unmarked_recompile(
    graph_id: int, gm: fx.GraphModule, example_inputs: Sequence[Any], plan: InputPlan
) -> None:
    """One INFO line for a graph whose batch Dynamo made dynamic itself: a recompile of the same
    code (its compile id `F/k`, k > 0) with a dynamic dim 0 that no one marked, which is what
    Dynamo does when an unmarked input changes size. The first graph, of one size, stays."""
    compile_id = gm.meta.get("dynamo_compile_id")
    if not plan.batch_exprs or getattr(compile_id, "frame_compile_id", None) in (None, 0):
        return
    if any(is_marked_batch(example_inputs[i]) for i in plan.batch_tensors):
        return
    names = ", ".join(plan.names[i] for i in plan.batch_tensors)
    logger.info(
        "graph %d: Dynamo compiled this code again (compile %s) because dim 0 of %s changed "
        "size, which was never marked: the first call's graph, of one size, stays beside this "
        "one. Call cgcompile.mark_dynamic_batch(...) on the batch inputs before the first call, "
        "so one graph serves every size",
        graph_id,
        compile_id,
        names,
    )
