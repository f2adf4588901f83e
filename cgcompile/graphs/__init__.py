"""Graph runtimes: record one callable into a graph and replay it, on CUDA (`cuda`) or with a
CUDA graph's semantics on the CPU (`simulated`, for tests). This is the code inside every capture
and replay; it knows no batch, key or model, and it is the only package that touches
`torch.cuda`. It stands apart from `cgcompile.calls`, which decides per call what to capture
and replay, so the device layer and its simulated twin can be read, tested and swapped alone.

    runtime = make_graph_runtime("simulated")     # one per compiled model: one shared pool
    graph, output = runtime.capture(fn, (x,), weak_output=False, dry_run=False)
"""

from cgcompile.graphs.cuda import (
    CapturedCUDAGraph,
    CUDAGraphRuntime,
    device_name,
    weak_ref_tensors,
)
from cgcompile.graphs.graph_runtime import CapturedGraph, GraphRuntime, make_graph_runtime
from cgcompile.graphs.simulated import SimulatedGraph, SimulatedGraphRuntime, poison_value

__all__ = [
    "CUDAGraphRuntime",
    "CapturedCUDAGraph",
    "CapturedGraph",
    "GraphRuntime",
    "SimulatedGraph",
    "SimulatedGraphRuntime",
    "device_name",
    "make_graph_runtime",
    "poison_value",
    "weak_ref_tensors",
]
