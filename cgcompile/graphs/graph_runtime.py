"""What a graph runtime promises, and the factory that picks one.

A `GraphRuntime` records a callable once (`capture`) into a `CapturedGraph` that re-runs the
recorded work on the captured inputs (`replay`) and returns the same output objects every time.
Two runtimes exist: `"cuda"` (real CUDA graphs, `cuda.py`) and `"simulated"` (CPU semantics of a
CUDA graph for tests, `simulated.py`). The backend creates one runtime per compiled model; every
wrapper of that model shares it, and so shares one memory pool per module instance.

    runtime = make_graph_runtime("simulated")
    graph, output = runtime.capture(fn, (x,), weak_output=False, dry_run=False)  # not computed
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from cgcompile.errors import ConfigError
from cgcompile.graphs.cuda import CUDAGraphRuntime
from cgcompile.graphs.simulated import SimulatedGraphRuntime


class CapturedGraph(Protocol):
    """One recorded graph; `replay` runs it and returns the captured output object."""

    output: Any
    """The tensors replays write (what `replay` returns)."""

    def replay(self) -> Any: ...

    @property
    def launch(self) -> Callable[[], Any]:
        """`replay` without its result, as cheap a callable as the runtime has (the steady
        state calls it on every call)."""
        ...


class GraphRuntime(Protocol):
    """Captures callables into graphs; one instance per compiled model (one shared pool)."""

    name: str
    """"cuda" or "simulated"."""

    def capture(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        *,
        weak_output: bool,
        dry_run: bool,
        instance: int = 0,
    ) -> tuple[CapturedGraph, Any]:
        """Record fn(*args) without changing any tensor; return (graph, output).

        `output` is what the capture call produced: tensors at the addresses replays write to,
        holding no computed values yet (callers must replay to get values). `dry_run`: no
        replay follows, the output only feeds other captures. `instance`: the module instance
        whose memory pool the graph uses (graphs of different instances never share memory).
        Capture failures are raised as `CaptureError` with the reason.
        """
        ...

    def memory_bytes(self) -> int:
        """Device memory this runtime's captures took (0 where nothing is measured)."""
        ...

    def prepare_thread(self) -> None:
        """Make the calling thread able to capture: what a capture cannot create itself (CUDA
        libraries' per-thread handles) is created here, outside any capture."""
        ...

    def borrow(self, tensors: Iterable[torch.Tensor]) -> None:
        """Tensors owned elsewhere (a model's parameters and buffers): graphs captured on them
        must not keep them alive, so a deleted model frees them."""
        ...


def make_graph_runtime(kind: str, device: torch.device | None = None) -> GraphRuntime:
    """Build the runtime named `kind` ("cuda" or "simulated") for `device`."""
    if kind == "simulated":
        return SimulatedGraphRuntime()
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                "graph runtime 'cuda' needs a CUDA GPU, but torch.cuda.is_available() is False; "
                "use graph_runtime='simulated' for CPU tests or 'auto'"
            )
        return CUDAGraphRuntime(device)
    raise ConfigError(f"graph runtime must be 'cuda' or 'simulated', got {kind!r}")
