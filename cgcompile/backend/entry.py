"""The Dynamo backend `cudagraph_modes`, registered through the `torch_dynamo_backends`
entry point, so `torch.compile(m, backend="cudagraph_modes", options={...})` needs no import.

    compiled = torch.compile(model, backend="cudagraph_modes",
                             options={"cudagraph_mode": "FULL_AND_PIECEWISE"})
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import fx

from cgcompile.backend.analyses import Analyses
from cgcompile.backend.batch_one_sharing import remember_dynamic, serve_batch_one
from cgcompile.backend.input_analysis import plan_inputs
from cgcompile.backend.pipeline import compile_graph
from cgcompile.calls.compiled_graph import CompiledGraph
from cgcompile.calls.padded_batch_one import PaddedBatchOne
from cgcompile.config import CompilationConfig
from cgcompile.errors import ConfigError
from cgcompile.passes.runtime_checks import checks_as_asserts


def cudagraph_modes(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> CompiledGraph | PaddedBatchOne:
    """Dynamo calls this once per traced graph; `options` is the dict given to torch.compile."""
    if mode is not None:
        raise ConfigError(
            f"backend 'cudagraph_modes' takes its settings through options=, got mode={mode!r}; "
            f"e.g. options={{'cudagraph_mode': 'FULL_AND_PIECEWISE'}}"
        )
    return compile_dynamo_graph(gm, example_inputs, CompilationConfig.from_options(options))


def compile_dynamo_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    config: CompilationConfig,
    analyses: Analyses | None = None,
) -> CompiledGraph | PaddedBatchOne:
    """One Dynamo graph: served by a live dynamic graph if it is that graph at batch 1, else
    compiled (`analyses`: the saving process's, for a graph rebuilt from a precompiled file).
    The graph's inputs are read once, here, for both."""
    checks_as_asserts(gm)  # before anything reads its code: a cacheable graph on torch 2.11
    plan = plan_inputs(gm, example_inputs)
    served, not_shared = serve_batch_one(gm, example_inputs, plan, config)
    if served is not None:  # Dynamo's batch-1 graph: the dynamic graph's compile serves it
        return served
    graph = compile_graph(gm, example_inputs, config, plan, analyses)
    graph.report.batch_one_not_shared = not_shared
    remember_dynamic(graph, gm, config)
    return graph
