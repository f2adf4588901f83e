"""The Dynamo backend: compile pipeline, piece compilation, runtime entry, reports."""

from cgcompile.backend.compiled_graph import CompiledGraph, capture_all, compiled_graphs
from cgcompile.backend.entry import cudagraph_modes

__all__ = ["CompiledGraph", "capture_all", "compiled_graphs", "cudagraph_modes"]
