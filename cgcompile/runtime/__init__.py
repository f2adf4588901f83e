"""What runs on every call of a compiled graph: the thread owner, the module instance, the
batch and its graph key, static input buffers, replay, outputs handed to the caller, eager
fallbacks, bulk capture and the live report. The compile side (`cgcompile.backend`) builds a
`CompiledGraph` and hands it to Dynamo; nothing here imports it.

    graph = CompiledGraph(runnable, dispatcher, plan, report, wrappers, runtime)
    out = graph(*args)          # what Dynamo's code calls for each call of the model
"""

from cgcompile.runtime.compiled_graph import CompiledGraph, capture_all, compiled_graphs

__all__ = ["CompiledGraph", "capture_all", "compiled_graphs"]
