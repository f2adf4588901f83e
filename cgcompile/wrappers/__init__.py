"""CUDA-graph wrappers and the graph runtimes they capture with (real CUDA or simulated).

The backend makes one runtime per compiled model and wraps each piece (and the whole graph):

    runtime = make_graph_runtime("cuda")          # one per compiled model: one shared pool
    piece = CUDAGraphWrapper(compiled_piece, CUDAGraphMode.PIECEWISE, runtime, name="piece_0")
"""

from cgcompile.wrappers.cuda import (
    CapturedCUDAGraph,
    CUDAGraphRuntime,
    device_name,
    weak_ref_tensors,
)
from cgcompile.wrappers.cuda_graph_wrapper import CUDAGraphWrapper
from cgcompile.wrappers.graph_entry import GraphEntry, GraphKey
from cgcompile.wrappers.runtime import CapturedGraph, GraphRuntime, make_graph_runtime
from cgcompile.wrappers.simulated import SimulatedGraph, SimulatedGraphRuntime, poison_value

__all__ = [
    "CUDAGraphRuntime",
    "CUDAGraphWrapper",
    "CapturedCUDAGraph",
    "CapturedGraph",
    "GraphEntry",
    "GraphKey",
    "GraphRuntime",
    "SimulatedGraph",
    "SimulatedGraphRuntime",
    "device_name",
    "make_graph_runtime",
    "poison_value",
    "weak_ref_tensors",
]
