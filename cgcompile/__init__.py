"""cgcompile: CUDA-graph modes for any PyTorch model through `torch.compile`.

compiled = torch.compile(model, backend="cudagraph_modes",
                         options={"cudagraph_mode": "FULL_AND_PIECEWISE"})
"""

from cgcompile.attention import register_attention_op
from cgcompile.backend import cudagraph_modes
from cgcompile.backend.compile_cache import load_compile_cache, save_compile_cache
from cgcompile.backend.precompile import Precompiled, precompile
from cgcompile.config import (
    AttentionCGSupport,
    CompilationConfig,
    CUDAGraphMode,
    validate_options,
)
from cgcompile.counters import Counters, counters
from cgcompile.dispatcher import CudagraphDispatcher
from cgcompile.dynamic import mark_dynamic_batch
from cgcompile.errors import CaptureError, CGCompileError, ConfigError, ConfigTypeError
from cgcompile.forward_context import (
    BatchDescriptor,
    ForwardContext,
    batch_hint,
    get_forward_context,
    is_forward_context_available,
    set_forward_context,
)
from cgcompile.resolution import Downgrade, Resolution, Rule, resolve_cudagraph_mode
from cgcompile.runtime import CompiledGraph, capture_all, compiled_graphs
from cgcompile.runtime.background import BackgroundCapture
from cgcompile.runtime.trusted import trusted
from cgcompile.wrappers import CUDAGraphWrapper

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
