"""The shared harness of the decode benchmark: workloads, settings, the model and its inputs,
the eager reference, per-peer measurement, and the cold-start sweep.

    bench = Bench(Settings.from_args(args), Stopwatch())
    result = bench.measure(lambda wl: make_step(wl))    # {"check": ..., "latency_ms": ...}
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
from collections.abc import Callable
from typing import Any

import torch

from benchmarks._timing import (
    Step,
    Stopwatch,
    compare,
    memory_delta_mb,
    memory_snapshot,
    time_steps,
    timed_call,
)
from examples.llama import Llama, LlamaConfig, make_inputs

try:
    from tqdm import tqdm
except ImportError:  # plain prints without it
    tqdm = None


@dataclasses.dataclass(frozen=True)
class Workload:
    kind: str  # "decode": one token per request; "mixed": anything else
    num_tokens: int

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.num_tokens}"

    @property
    def uniform_decode(self) -> bool:
        return self.kind == "decode"


@dataclasses.dataclass(frozen=True)
class Settings:
    cfg: LlamaConfig
    device: torch.device
    dtype: torch.dtype
    workloads: tuple[Workload, ...]
    max_capture_size: int
    modes: tuple[str, ...]
    compilers: tuple[str, ...]
    warmup: int
    repeats: int
    steps: int
    skip: tuple[str, ...] = ()
    isolate: bool = False
    tol: float = 0.05

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        cuda = torch.cuda.is_available()
        decode, mixed = ((1, 4), (16,)) if args.quick else ((1, 8, 32, 128, 256), (64, 256, 1024))
        return cls(
            cfg=LlamaConfig.tiny() if args.quick else LlamaConfig.bench(),
            device=torch.device("cuda" if cuda else "cpu"),
            dtype=torch.bfloat16 if cuda else torch.float32,
            workloads=tuple(Workload("decode", n) for n in decode)
            + tuple(Workload("mixed", n) for n in mixed),
            max_capture_size=32 if args.quick else 1024,
            modes=tuple(args.modes),
            compilers=tuple(args.compilers),
            warmup=args.warmup or (1 if args.quick else 3),
            repeats=args.repeats or (5 if args.quick else 20),
            steps=args.steps or (3 if args.quick else 10),
            skip=tuple(args.skip),
            isolate=getattr(args, "isolate", False),
        )

    @property
    def check_workload(self) -> Workload:
        """The workload every peer's output is checked on against eager's."""
        return next((w for w in self.workloads if w.num_tokens > 1), self.workloads[0])


class Bench:
    """The model, inputs, eager reference and results shared by every peer."""

    def __init__(self, settings: Settings, clock: Stopwatch) -> None:
        self.s = settings
        self.clock = clock
        self.model = Llama(settings.cfg).to(settings.device, settings.dtype).eval()
        self.peers: dict[str, dict[str, Any]] = {}
        self._initial_state = {k: v.clone() for k, v in self.model.named_buffers()}
        tokens, positions = self.inputs(settings.check_workload.num_tokens)
        self.reference = self.model(tokens, positions).clone()

    @torch.no_grad()
    def reset_state(self) -> None:
        """Give the model its first KV caches back (every step writes them), so each peer's
        check starts where the eager reference did."""
        for name, buffer in self.model.named_buffers():
            buffer.copy_(self._initial_state[name])

    def inputs(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh tensors with the same values for every peer (seeded by n)."""
        g = torch.Generator().manual_seed(1000 + n)
        return make_inputs(self.s.cfg, n, self.s.device, generator=g)

    def log(self, message: str) -> None:
        line = f"[{self.clock.elapsed():7.1f}s] {message}"
        tqdm.write(line) if tqdm is not None else print(line, flush=True)

    def measure(self, make_step: Callable[[Workload], Step]) -> dict[str, Any]:
        """Check one workload against eager, then time every workload (errors recorded)."""
        s = self.s
        result: dict[str, Any] = {"latency_ms": {}}
        self.reset_state()
        result["check"] = {
            "workload": s.check_workload.name,
            **compare(make_step(s.check_workload)(), self.reference, s.tol),
        }
        for wl in s.workloads:
            try:
                step = make_step(wl)
                result["latency_ms"][wl.name] = time_steps(
                    step, s.device, s.warmup, s.repeats, s.steps
                )
            except Exception as e:  # one failing workload must not end the peer
                result["latency_ms"][wl.name] = {"error": describe(e)}
        return result


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:400]}"


def release() -> None:
    """Drop compiled code and graphs between peers so memory deltas stay per peer."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


Results = dict[str, dict[str, Any]]  # peer name -> its results


def capture_sizes(max_size: int) -> list[int]:
    """cgcompile's default capture sizes up to max_size, largest first (capture order)."""
    from cgcompile.config import default_capture_sizes

    return sorted(default_capture_sizes(max_size), reverse=True)


def cold_start(
    bench: Bench,
    call: Callable[..., Any],
    inputs: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    sizes: list[int],
    hints: tuple[bool, ...],
    calls_per_size: int = 1,
) -> dict[str, Any]:
    """The first call (above every capture size: compile only), a batch-1 call when 1 is a
    capture size (Dynamo traces and compiles batch 1 apart from the rest), then one capture
    sweep per hint, so the sweep's time is capture alone.

    `call(tokens, positions, uniform=...)` runs the compiled model once; `inputs(n)` makes new
    input tensors of n tokens. Memory is the growth over the sweeps.
    """
    first = inputs(max(sizes) + 1)
    _, first_s = timed_call(lambda: call(*first, uniform=False), bench.s.device)
    batch1_s = None
    if 1 in sizes:
        one = inputs(1)
        _, batch1_s = timed_call(
            lambda: call(*one, uniform=hints[0] if hints else False), bench.s.device
        )
    sweep_inputs = {n: inputs(n) for n in sizes}

    def sweep() -> None:
        for uniform in hints:
            for n in sizes:  # largest first: smaller graphs reuse the pool's memory
                for _ in range(calls_per_size):
                    call(*sweep_inputs[n], uniform=uniform)

    before = memory_snapshot(bench.s.device)
    _, capture_s = timed_call(sweep, bench.s.device)
    return {
        "first_call_s": first_s,
        "first_call_tokens": max(sizes) + 1,
        "batch1_call_s": batch1_s,
        "capture_s": capture_s,
        "capture_sizes": len(sizes),
        "sweeps": ["decode" if u else "mixed" for u in hints],
        **memory_delta_mb(before, memory_snapshot(bench.s.device)),
    }
