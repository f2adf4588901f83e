"""Serving while capturing: call latency during `capture_all(background=True)` and after it.

One process, the example Llama (`LlamaConfig.bench()`, bf16, KV cache written in place, default
options). After the first calls (8 tokens mixed, 1 token decode), the background capture starts
and the same list of random calls (sizes 1..512, decode or mixed, random tokens) runs while it
captures; each call is timed as a decode loop sees it (synchronise, call, synchronise; wall
time). When the capture is done, the calls made during it run again, now all from graphs. Printed:
calls made during the capture, their p50 and p99 latency against the same calls' afterwards, the
capture's seconds, keys and graphs; then a soak of `--soak` random calls: graphs captured and
memory reserved meanwhile (both should be 0).

    python benchmarks/background_capture.py --out DIR [--soak 2000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cgcompile  # noqa: E402
from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch  # noqa: E402

MAX = 512


def timed(compiled: Any, call: tuple[torch.Tensor, torch.Tensor, bool]) -> float:
    """Milliseconds of one call, the stream synchronised before and after (what a decode loop
    waits for its token; a device-wide synchronise is not allowed while the thread captures)."""
    tokens, positions, decode = call
    stream = torch.cuda.current_stream()
    stream.synchronize()
    start = time.perf_counter()
    with cgcompile.batch_hint(uniform_decode=decode):
        compiled(tokens, positions)
    stream.synchronize()
    return (time.perf_counter() - start) * 1e3


def percentiles(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    return {
        "p50": round(statistics.median(ordered), 3),
        "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--soak", type=int, default=2000)
    parser.add_argument("--calls", type=int, default=600, help="random calls prepared")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("background_capture: needs CUDA")
        return 0
    cfg = LlamaConfig.bench()
    model = Llama(cfg).to("cuda", torch.bfloat16).eval()
    compiled = torch.compile(model, backend="cudagraph_modes")
    rng = random.Random(0)
    calls = []
    for i in range(args.calls):
        n = rng.randint(1, MAX)
        tokens, positions = make_inputs(cfg, n, "cuda", torch.Generator().manual_seed(i))
        mark_batch(cfg, tokens, positions, hint=MAX)
        calls.append((tokens, positions, rng.random() < 0.5))
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    with torch.inference_mode():
        for n, decode in ((8, False), (1, True)):
            tokens, positions = make_inputs(cfg, n, "cuda")
            mark_batch(cfg, tokens, positions, hint=MAX)
            timed(compiled, (tokens, positions, decode))
        started = time.perf_counter()
        job = cgcompile.capture_all(background=True)
        result["start_returned_ms"] = (time.perf_counter() - started) * 1e3
        during, log = [], []
        for call in calls:
            if job.done:
                break
            keys = job.keys_done
            during.append(timed(compiled, call))
            log.append((round(during[-1], 3), call[0].shape[0], call[2], keys))
        job.wait()
        result["slowest_during"] = sorted(log, reverse=True)[:8]  # (ms, n, decode, keys done)
        after = [timed(compiled, call) for call in calls[: len(during)]]
        result |= {
            "capture_s": job.seconds,
            "keys": job.total_keys,
            "graphs": job.graphs_captured,
            "calls_during": len(during),
            "during_ms": percentiles(during) if during else None,
            "after_ms": percentiles(after) if after else None,
        }
        result |= soak(compiled, cfg, args.soak)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "background-capture.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


def soak(compiled: Any, cfg: LlamaConfig, calls: int) -> dict[str, Any]:
    """`calls` random calls after the capture: graphs captured and memory reserved meanwhile."""
    rng = random.Random(1)
    before = cgcompile.counters.num_cudagraph_captured
    reserved = torch.cuda.memory_reserved()
    for i in range(calls):
        n = rng.randint(1, MAX)
        tokens, positions = make_inputs(cfg, n, "cuda", torch.Generator().manual_seed(10**6 + i))
        mark_batch(cfg, tokens, positions, hint=MAX)
        with cgcompile.batch_hint(uniform_decode=rng.random() < 0.5):
            compiled(tokens, positions)
    torch.cuda.synchronize()
    return {
        "soak_calls": calls,
        "soak_graphs_captured": cgcompile.counters.num_cudagraph_captured - before,
        "soak_reserved_growth_mib": (torch.cuda.memory_reserved() - reserved) / 2**20,
    }


if __name__ == "__main__":
    raise SystemExit(main())
