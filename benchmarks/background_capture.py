"""Serving while capturing: call latency during `capture_all(background=True)` and after it.

One process, one model family (`--family`, `benchmarks/_families.py`: the example Llama by
default, bf16, default options). After the first calls (8 tokens mixed and 1 token decode; a
family with a static cache per batch size: one call of each size), the background capture
starts and the same list of random calls (sizes 1..512 or the family's sizes, decode or mixed,
random tokens) runs while it captures; each call is timed as a decode loop sees it (synchronise,
call, synchronise; wall time). When the capture is done, the calls made during it run again, now
all from graphs. Then the control: a fresh process builds the same model, makes the same first
calls, runs `capture_all()` in the foreground and times the same calls, each for the first time in
that process as during the capture (a call's first-time costs, e.g. an attention plan for a new
shape, are paid in both). Printed: calls made during the capture, their p50 and p99 latency
against the control's and against the same calls' repeated afterwards, the capture's seconds,
keys and graphs; then a soak of `--soak` random calls: graphs captured and memory reserved
meanwhile (both should be 0).

    python benchmarks/background_capture.py --out DIR [--soak 2000] [--family rows]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cgcompile  # noqa: E402
from benchmarks._families import NAMES, Family, Inputs, build  # noqa: E402

MAX = 512


def timed(family: Family, compiled: Any, call: tuple[Inputs, bool]) -> float:
    """Milliseconds of one call, the stream synchronised before and after (what a decode loop
    waits for its token; a device-wide synchronise is not allowed while the thread captures)."""
    inputs, decode = call
    stream = torch.cuda.current_stream()
    stream.synchronize()
    start = time.perf_counter()
    family.run(compiled, inputs, decode)
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
    parser.add_argument("--family", choices=NAMES, default="llama")
    parser.add_argument("--control", type=int, help=argparse.SUPPRESS)  # the fresh process
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("background_capture: needs CUDA")
        return 0
    torch.manual_seed(0)
    family = build(args.family, "cuda", torch.bfloat16)
    compiled = torch.compile(family.model, backend="cudagraph_modes")
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "family": args.family,
    }
    with torch.inference_mode():
        # made as the calls run, under inference mode (an input made outside it has another
        # dispatch key set: Dynamo would compile the first such call again)
        rng = random.Random(0)
        calls = [(family.inputs(size(family, rng)), rng.random() < 0.5) for _ in range(args.calls)]
        for n, decode in [(n, True) for n in family.sizes or ()] or [(8, False), (1, True)]:
            timed(family, compiled, (family.inputs(n), decode))
        if args.control is not None:
            cgcompile.capture_all(progress=False)
            ms = [timed(family, compiled, call) for call in calls[: args.control]]
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "control.json").write_text(json.dumps(ms))
            return 0
        started = time.perf_counter()
        job = cgcompile.capture_all(background=True)
        result["start_returned_ms"] = (time.perf_counter() - started) * 1e3
        during, log = [], []
        for call in calls:
            if job.done:
                break
            keys = job.keys_done
            during.append(timed(family, compiled, call))
            positional, keywords = call[0]
            tensors = (t for t in (*positional, *keywords.values()) if torch.is_tensor(t))
            batch = next(tensors).shape[0]
            log.append((round(during[-1], 3), batch, call[1], keys))
        job.wait()
        result["slowest_during"] = sorted(log, reverse=True)[:8]  # (ms, n, decode, keys done)
        after = [timed(family, compiled, call) for call in calls[: len(during)]]
        result |= {
            "capture_s": job.seconds,
            "keys": job.total_keys,
            "graphs": job.graphs_captured,
            "calls_during": len(during),
            "during_ms": percentiles(during) if during else None,
            "after_ms": percentiles(after) if after else None,
        }
        result |= soak(family, compiled, args.soak)
    if during:
        control = run_control(args.family, len(during))
        result["control_ms"] = percentiles(control)
        result["during_over_control_p50"] = round(
            result["during_ms"]["p50"] / result["control_ms"]["p50"], 2
        )
        triples = zip(during, control, after, strict=True)
        result["per_call_ms"] = [  # (during, control, after) of each call
            (round(d, 3), round(c, 3), round(a, 3)) for d, c, a in triples
        ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"background-capture-{args.family}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


def run_control(family: str, calls: int) -> list[float]:
    """The first `calls` calls' milliseconds in a fresh process with no capture under way."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, __file__, "--out", tmp, "--family", family]
        subprocess.run([*command, "--control", str(calls)], check=True)
        return json.loads((Path(tmp) / "control.json").read_text())


def size(family: Family, rng: random.Random) -> int:
    """A random batch size the family's calls may have."""
    return rng.choice(family.sizes) if family.sizes else rng.randint(1, MAX)


def soak(family: Family, compiled: Any, calls: int) -> dict[str, Any]:
    """`calls` random calls after the capture: graphs captured and memory reserved meanwhile."""
    rng = random.Random(1)
    before = cgcompile.counters.num_cudagraph_captured
    reserved = torch.cuda.memory_reserved()
    for _ in range(calls):
        family.run(compiled, family.inputs(size(family, rng)), rng.random() < 0.5)
    torch.cuda.synchronize()
    return {
        "soak_calls": calls,
        "soak_graphs_captured": cgcompile.counters.num_cudagraph_captured - before,
        "soak_reserved_growth_mib": (torch.cuda.memory_reserved() - reserved) / 2**20,
    }


if __name__ == "__main__":
    raise SystemExit(main())
