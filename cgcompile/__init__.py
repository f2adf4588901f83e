"""cgcompile: CUDA-graph modes for any PyTorch model through `torch.compile`.

compiled = torch.compile(model, backend="cudagraph_modes",
                         options={"cudagraph_mode": "FULL_AND_PIECEWISE"})
"""

from cgcompile.backend import cudagraph_modes
from cgcompile.backend.attention import register_attention_op
from cgcompile.backend.resolution import Downgrade, Resolution, Rule, resolve_cudagraph_mode
from cgcompile.calls.background import BackgroundCapture
from cgcompile.calls.compiled_graph import CompiledGraph
from cgcompile.calls.cuda_graph_wrapper import CUDAGraphWrapper
from cgcompile.calls.dispatcher import CudagraphDispatcher
from cgcompile.calls.forward_context import (
    BatchDescriptor,
    ForwardContext,
    batch_hint,
    get_forward_context,
    is_forward_context_available,
    set_forward_context,
)
from cgcompile.calls.live_graphs import capture_all, compiled_graphs
from cgcompile.calls.trusted import guarded, trusted
from cgcompile.config import (
    AttentionCGSupport,
    CompilationConfig,
    CUDAGraphMode,
    validate_options,
)
from cgcompile.counters import Counters, counters
from cgcompile.dynamic import mark_dynamic_batch
from cgcompile.errors import CaptureError, CGCompileError, ConfigError, ConfigTypeError
from cgcompile.restart.compile_cache import load_compile_cache, save_compile_cache
from cgcompile.restart.precompile import Precompiled, precompile

__all__ = [
    "AttentionCGSupport",
    "BackgroundCapture",
    "BatchDescriptor",
    "CGCompileError",
    "CUDAGraphMode",
    "CUDAGraphWrapper",
    "CaptureError",
    "CompilationConfig",
    "CompiledGraph",
    "ConfigError",
    "ConfigTypeError",
    "Counters",
    "CudagraphDispatcher",
    "Downgrade",
    "ForwardContext",
    "Precompiled",
    "Resolution",
    "Rule",
    "batch_hint",
    "capture_all",
    "compiled_graphs",
    "counters",
    "cudagraph_modes",
    "get_forward_context",
    "guarded",
    "is_forward_context_available",
    "load_compile_cache",
    "mark_dynamic_batch",
    "precompile",
    "register_attention_op",
    "resolve_cudagraph_mode",
    "save_compile_cache",
    "set_forward_context",
    "trusted",
    "validate_options",
]
