"""Step 1 of the backend: what one run of a Dynamo graph on fake tensors finds.

The run (`passes.mutation.find_effects`) finds the inputs the graph writes in place; the pad
check (`passes.pad_safety`) rides along and says whether padding a batch could change what the
caller sees. Where nothing is left to judge by op (a static batch, or the inputs decided it),
the run takes each size at its example value: a 16-layer Hugging Face Llama's backend took
1.1-1.3 s instead of 2.3-2.5 s (development CPU, eager pieces). A run that fails leaves the
effects unknown, with the reason (the mode resolves to NONE). A graph rebuilt from a
precompiled file takes the saving process's `Analyses` instead of running anything. Either way
they complete the graph's `plan_inputs` plan (`with_effects`).

    plan, analyses = analysed_plan(graph_id, gm, example_inputs, plan, pads=True, saved=None)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from torch import fx

from cgcompile.backend.input_analysis import with_effects
from cgcompile.backend.preconditions import pad_check
from cgcompile.calls.input_plan import InputPlan
from cgcompile.passes.mutation import ANALYSIS_ERRORS, Effects, find_effects
from cgcompile.passes.pad_safety import PadCheck

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Analyses:
    """What step 1's run of the graph on fake tensors found; a graph rebuilt from a
    precompiled file reuses its saving process's (`CompiledGraph.analyses`)."""

    effects: Effects
    not_analysed: str | None
    """Why the effects are unknown (the fake run failed), if so."""
    pad_unsafe: str | None
    """Why padding could change what the caller sees, if so."""


def analysed_plan(
    graph_id: int,
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    plan: InputPlan,
    pads: bool,
    saved: Analyses | None,
) -> tuple[InputPlan, Analyses]:
    """`plan` (`plan_inputs`') with step 1's analyses (`pads`: whether padding safety
    matters): run now, in one fake run of the graph, or taken from `saved`."""
    if saved is not None:
        plan = with_effects(plan, saved.effects)
        if pads:
            plan = dataclasses.replace(plan, pad_unsafe=saved.pad_unsafe)
        return plan, Analyses(saved.effects, saved.not_analysed, plan.pad_unsafe)
    # the batch, names and pad values do not depend on the effects
    check = pad_check(gm, plan) if pads else None
    effects, not_analysed = _effects(graph_id, gm, example_inputs, check)
    plan = with_effects(plan, effects)
    if check is not None:
        plan = dataclasses.replace(plan, pad_unsafe=check.verdict().reason)
    return plan, Analyses(effects, not_analysed, plan.pad_unsafe)


def _effects(
    graph_id: int, gm: fx.GraphModule, example_inputs: Sequence[Any], check: PadCheck | None
) -> tuple[Effects, str | None]:
    """The graph's effects on its inputs, or (none, why they are unknown); `check` judges
    padding during the same run."""
    try:
        watch = check.watch if check is not None and check.needs_run else None
        return find_effects(gm, example_inputs, watch), None
    except ANALYSIS_ERRORS as exc:
        logger.debug("graph %d: fake run failed", graph_id, exc_info=True)
        return Effects((), {}), f"{type(exc).__name__}: {exc}".strip().split("\n")[0]
