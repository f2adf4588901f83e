"""Real CUDA graphs: capture on a side stream into one shared memory pool, replay in one call.

`CUDAGraphRuntime` is the "cuda" `GraphRuntime`. Each instance owns one side stream and a graph
memory pool per module instance (`capture(..., instance=k)`), shared by every wrapper it is given
(the backend makes one runtime per compiled model), so graphs of one module instance captured
largest-first reuse the pool blocks of the larger ones, and a replay for one module instance
never writes the outputs another one handed out. `weak_ref_tensors` turns outputs into
non-owning aliases so their pool blocks are free for later captures.

Capture steps (`CUDAGraphRuntime.capture`):
1. make the side stream wait on the current stream (the default stream cannot capture), so the
   warm-up runs come first; no device synchronise: the pool is private, so nothing in flight
   on other streams can hand the capture memory it still uses;
2. disable the garbage collector: a collection mid-capture can free something the graph uses
   (e.g. a Triton kernel's module) and invalidate the graph;
3. on the side stream: `capture_begin(pool)` (thread-local capture mode: other threads may
   run CUDA work meanwhile), run fn, weak-alias the outputs if asked,
   `capture_end`; any failure ends the capture and is raised as `CaptureError`;
4. make the current stream wait on the side stream, restore the collector, add the growth of
   reserved memory to `memory_bytes()`.

`torch.cuda.graph` is not used: its `__enter__` synchronises the device and empties the
allocator cache on every capture, which is slow with one capture per piece and size.

    runtime = CUDAGraphRuntime(torch.device("cuda"))
    graph, out = runtime.capture(fn, (x,), weak_output=False); graph.replay()  # fills out
"""

from __future__ import annotations

import contextlib
import gc
import logging
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from cgcompile.errors import CaptureError, capture_failed

logger = logging.getLogger(__name__)


class CapturedCUDAGraph:
    """A `torch.cuda.CUDAGraph` and the output tensors its replays write."""

    __slots__ = ("graph", "output", "__weakref__")

    def __init__(self, graph: torch.cuda.CUDAGraph, output: Any) -> None:
        self.graph = graph
        self.output = output

    def replay(self) -> Any:
        """Launch the graph on the current stream; return the (overwritten) output object."""
        self.graph.replay()
        return self.output

    @property
    def launch(self) -> Callable[[], None]:
        """The C++ graph's replay, bound: `torch.cuda.CUDAGraph.replay` is a Python method that
        calls it (one frame less per call), and checks input liveness only where a capture
        asked for it (ours never do: then its own method)."""
        replay = getattr(torch._C._CUDAGraph, "replay", None)
        if replay is None or getattr(self.graph, "_tracker", None) is not None:
            return self.graph.replay
        return types.MethodType(replay, self.graph)


class CUDAGraphRuntime:
    """The "cuda" `GraphRuntime`: one pool and one side stream for all its captures."""

    name = "cuda"

    def __init__(self, device: torch.device | str | None = None) -> None:
        device = torch.device("cuda" if device is None else device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.pools: dict[int, Any] = {}
        """Module instance -> the pool its graphs are captured into."""
        self.stream = torch.cuda.Stream(device=self.device)
        self._reserved_bytes = 0
        self._live_graphs: dict[int, int] = {}
        """Module instance -> graphs captured into its pool and not yet freed."""

    def memory_bytes(self) -> int:
        """Bytes the caching allocator newly reserved while this runtime captured.

        That is the growth of the graph pool's segments (blocks reused by later captures count
        once); it excludes the driver's own memory for instantiated graphs and anything reserved
        outside captures (warm-up runs, static input buffers).
        """
        return self._reserved_bytes

    def _graph_freed(self, instance: int) -> None:
        self._live_graphs[instance] -= 1

    def borrow(self, tensors: Iterable[torch.Tensor]) -> None:
        """Nothing to do: a CUDA graph keeps addresses, never its input tensors."""

    def prepare_thread(self) -> None:
        """Create this thread's cuBLAS, cuBLASLt and cuDNN handles (torch keeps them per
        thread; creating one inside a capture fails with CUBLAS_STATUS_NOT_INITIALIZED) by small
        matmuls and an attention call on the capture stream and the current one."""
        for stream in (self.stream, torch.cuda.current_stream(self.device)):
            with torch.cuda.stream(stream), torch.no_grad():
                for dtype in (torch.float32, torch.bfloat16, torch.float16):
                    a = torch.ones(64, 64, device=self.device, dtype=dtype)
                    torch.addmm(a, a, a)  # cuBLASLt for half types
                    torch.mm(a, a)
                    q = a.view(1, 1, 64, 64)
                    with contextlib.suppress(RuntimeError):  # no backend for this dtype
                        torch.nn.functional.scaled_dot_product_attention(q, q, q)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def capture(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        *,
        weak_output: bool,
        dry_run: bool = False,
        instance: int = 0,
    ) -> tuple[CapturedCUDAGraph, Any]:
        """Record fn(*args) into a new graph in the pool of module instance `instance` (steps
        in the module doc).

        Recording runs no kernel, so no tensor changes; `dry_run` changes nothing here."""
        if self._live_graphs.get(instance, 0) == 0:
            # the allocator retires a pool id once every graph captured into it is freed (e.g.
            # the graphs of a deleted module instance): capturing into it again trips its
            # `use_count > 0` assert, so a pool with no live graph is replaced by a fresh one
            self.pools[instance] = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        reserved_before = _reserved_bytes(self.device)
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            output = self._record(graph, fn, args, weak_output, self.pools[instance])
        finally:
            if gc_was_enabled:
                gc.enable()
        grown = _reserved_bytes(self.device) - reserved_before
        self._reserved_bytes += max(grown, 0)
        captured = CapturedCUDAGraph(graph, weak_ref_tensors(output))
        self._live_graphs[instance] = self._live_graphs.get(instance, 0) + 1
        weakref.finalize(captured, self._graph_freed, instance)
        # Replays hand out non-owning aliases, so between forwards every block of this graph is
        # free for other captures in the pool; the capture call's caller gets `output` (strong
        # unless weak_output) so the blocks stay reserved while the rest of its forward captures.
        return captured, output

    def _record(
        self,
        graph: torch.cuda.CUDAGraph,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        weak_output: bool,
        pool: Any,
    ) -> Any:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            # thread_local: CUDA calls of other threads (the eager calls of threads that do not
            # own the graphs) neither fail nor invalidate this capture
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                output = fn(*args)
                if weak_output:
                    # drop the strong refs inside the capture so the blocks return to the pool
                    output = weak_ref_tensors(output)
            except BaseException as exc:
                _end_failed_capture(graph, self.device, pool)
                if not isinstance(exc, Exception):
                    raise
                raise capture_failed(fn, exc) from exc
            try:
                graph.capture_end()
            except RuntimeError as exc:
                raise capture_failed(fn, exc) from exc
        current.wait_stream(self.stream)
        return output


def device_name() -> str:
    """The GPU this process compiles for (CUDA device 0), or "cpu": what compiled kernels fit."""
    if not torch.cuda.is_available():
        return "cpu"
    major, minor = torch.cuda.get_device_capability(0)
    return f"{torch.cuda.get_device_name(0)} (sm_{major}{minor}, CUDA {torch.version.cuda})"


def weak_ref_tensors(value: Any) -> Any:
    """`value` with each CUDA tensor replaced by a non-owning alias of the same memory.

    The alias does not keep its memory alive: once the owner is gone the allocator may hand the
    block to another allocation (in a graph pool: to a later capture, whose replays then write
    it). Safe only for outputs nothing later in the same forward reads. Needs a CUDA build.
    """
    return tree_map_only(torch.Tensor, _weak_alias, value)


def _weak_alias(t: torch.Tensor) -> torch.Tensor:
    if not t.is_cuda or t.numel() == 0:
        return t
    if not hasattr(torch._C, "_construct_CUDA_Tensor_From_Storage_And_Metadata"):
        raise CaptureError(
            "weak_output needs torch._C._construct_CUDA_Tensor_From_Storage_And_Metadata, which "
            f"this torch build ({torch.__version__}) lacks; capture with weak_output=False"
        )
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), t.device, storage.nbytes()
    )
    metadata = {
        "dtype": t.dtype,
        "size": tuple(t.shape),
        "stride": t.stride(),
        "storage_offset": t.storage_offset(),
    }
    return torch._C._construct_CUDA_Tensor_From_Storage_And_Metadata(metadata, alias)


def _end_failed_capture(graph: torch.cuda.CUDAGraph, device: torch.device, pool: Any) -> None:
    """End a capture whose callable raised, so the stream leaves capture mode and the allocator
    stops routing allocations to the pool (or the pool's next capture fails with "already
    recording to mempool_id")."""
    try:
        graph.capture_end()
    except RuntimeError as exc:
        # an invalidated capture cannot end cleanly: torch then skipped ending its allocations
        # to the pool, which is left to do here
        logger.debug("ending a failed capture raised %s", exc)
        end_allocating = getattr(torch._C, "_cuda_endAllocateToPool", None)
        with contextlib.suppress(RuntimeError):  # "not currently recording": it had ended
            if end_allocating is not None:
                end_allocating(device.index, pool)


def _reserved_bytes(device: torch.device) -> int:
    """`torch.cuda.memory_reserved(device)` without flattening every allocator statistic into
    a new dict (0.4 ms a call on the H200, twice per capture)."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    return stats.get("reserved_bytes", {}).get("all", {}).get("current", 0)
