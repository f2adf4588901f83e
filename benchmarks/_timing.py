"""Timing, kernel-time, memory and correctness helpers shared by the benchmarks.

Latency is the MEDIAN per-step time over `repeats` loops of `steps` calls each, bracketed by CUDA
events (wall clock on CPU), after `warmup` untimed loops; slow peers get fewer loops (>= 5).
The kernel floor is the GPU time that torch.profiler's CUDA activity records for a loop of
steps, divided by the number of steps.

    stats = time_steps(step, device, warmup=3, repeats=20, steps=10)    # {"median_ms": ...}
"""

from __future__ import annotations

import gc
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

Step = Callable[[], torch.Tensor]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loop_ms(step: Step, device: torch.device, steps: int) -> float:
    """Milliseconds for `steps` back-to-back calls, measured on the device's own clock."""
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - start) * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(steps):
        step()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end)


def time_steps(
    step: Step, device: torch.device, warmup: int, repeats: int, steps: int, budget_s: float = 1.0
) -> dict[str, float]:
    """Median, min and max per-step milliseconds over up to `repeats` loops of `steps` steps.

    Slow peers get fewer loops (at least 5): as many as fit in about `budget_s` seconds.
    """
    loop_ms = min(_loop_ms(step, device, steps) for _ in range(max(warmup, 1)))
    repeats = max(min(repeats, 5), min(repeats, int(budget_s * 1e3 / max(loop_ms, 1e-3))))
    sync(device)
    gc.collect()
    gc.disable()  # no collector pauses inside a timed loop, for every peer alike
    try:
        per_step = [_loop_ms(step, device, steps) / steps for _ in range(repeats)]
    finally:
        gc.enable()
    return {
        "median_ms": statistics.median(per_step),
        "min_ms": min(per_step),
        "max_ms": max(per_step),
        "repeats": repeats,
    }


def gpu_time_per_step_ms(
    step: Step, device: torch.device, steps: int, top: int = 0
) -> dict[str, Any]:
    """GPU time per step recorded by torch.profiler's CUDA activity (kernels, copies, sets);
    `top` > 0 adds the `top` kernel names with the most time, in us per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step()
    sync(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Profiler clears events at the end of each cycle"
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            sync(device)
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    kernels = [e for e in events if not e.name.startswith(("Memcpy", "Memset"))]
    total_us = sum(e.time_range.elapsed_us() for e in events)
    kernel_us = sum(e.time_range.elapsed_us() for e in kernels)
    result: dict[str, Any] = {
        "median_ms": total_us / steps / 1e3,
        "kernels_only_ms": kernel_us / steps / 1e3,
        "kernels_per_step": len(kernels) / steps,
    }
    if top:
        by_name: dict[str, float] = {}
        calls: dict[str, int] = {}
        for e in kernels:
            by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us() / steps
            calls[e.name] = calls.get(e.name, 0) + 1
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
        result["top_kernels_us"] = {name[:90]: round(us, 2) for name, us in ranked}
        result["top_kernel_calls"] = {name[:90]: calls[name] / steps for name, _ in ranked}
    return result


def memory_snapshot(device: torch.device) -> dict[str, int] | None:
    """Bytes reserved by PyTorch's allocator and bytes free on the device; None off CUDA."""
    if device.type != "cuda":
        return None
    sync(device)
    free, _ = torch.cuda.mem_get_info(device)
    return {"reserved": torch.cuda.memory_reserved(device), "free": free}


def memory_delta_mb(
    before: dict[str, int] | None, after: dict[str, int] | None
) -> dict[str, float | None]:
    """Growth of reserved memory and drop of free device memory, in MiB."""
    if before is None or after is None:
        return {"reserved_delta_mb": None, "free_delta_mb": None}
    mib = 1024 * 1024
    return {
        "reserved_delta_mb": (after["reserved"] - before["reserved"]) / mib,
        "free_delta_mb": (before["free"] - after["free"]) / mib,
    }


def compare(out: torch.Tensor, ref: torch.Tensor, tol: float) -> dict[str, Any]:
    """Max |out - ref| relative to max |ref|; `ok` when within `tol`."""
    out, ref = out.detach().float().cpu(), ref.detach().float().cpu()
    if out.shape != ref.shape:
        return {"ok": False, "reason": f"shape {list(out.shape)} != {list(ref.shape)}"}
    scale = ref.abs().max().item()
    max_abs = (out - ref).abs().max().item()
    rel = max_abs / scale if scale > 0 else max_abs
    return {"ok": rel <= tol, "max_abs_diff": max_abs, "ref_scale": scale, "rel": rel, "tol": tol}


class Stopwatch:
    """Seconds since the benchmark started; `lap` returns the seconds since the last lap."""

    def __init__(self) -> None:
        self.start = self._last = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        return seconds


def timed_call(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """Result of fn() and its wall seconds, device work included."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - start


def take_arguments(*args: Any) -> None:
    """A Python call taking the arguments Dynamo passes (every parameter and buffer): the toll
    of the calling convention, paid by any backend."""
