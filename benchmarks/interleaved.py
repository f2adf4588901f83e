"""Peers timed in turns in one process: step-time ratios to about 1%.

Between processes and device machines the same peer's step time moves by several percent
(docs/BENCHMARKS.md), more than some targets allow (FULL_AND_PIECEWISE decode <= 1.01x FULL).
This script compiles every peer once, in one process, on one model, then times them in turns:
each round times one loop of `--steps` steps of every peer on a workload, in an order that
rotates from round to round, so drift of the machine hits every peer alike. Each peer's output
is first checked against eager's, as in the decode benchmark. It reports each
peer's median ms per step and, per round, the ratio of each peer to the first one: the median of
those ratios is the figure to read.

A peer is `MODE` (the FX split), `MODE/partition` (`use_inductor_graph_partition=True`),
`MODE/pieces` (the FX split with `full_graph_compile='pieces'`: FULL_AND_PIECEWISE's full graphs
replay the split's pieces instead of a whole-graph compile) or `MODE/own` (`batch_one='own'`:
batch 1 compiled and captured on its own, where `MODE` replays the dynamic graph padded to 2), with
Inductor pieces and the batch marked with `hint=` the largest capture size, as the decode
benchmark's `cg/MODE/inductor/hint` and `cg/MODE/partition` peers.

    python benchmarks/interleaved.py --out DIR        # FULL against FULL_AND_PIECEWISE, each path
    python benchmarks/interleaved.py --out DIR --peers PIECEWISE PIECEWISE/partition --mixed
    python benchmarks/interleaved.py --out DIR --peers FULL_AND_PIECEWISE FULL_AND_PIECEWISE/own
    python benchmarks/interleaved.py --out DIR --quick    # tiny model, CPU smoke test
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._cg_peers import CGCompileRun  # noqa: E402
from benchmarks._harness import Bench, Settings, Workload  # noqa: E402
from benchmarks._timing import Stopwatch, _loop_ms, compare, sync  # noqa: E402

DEFAULT_PEERS = (
    "FULL",
    "FULL_AND_PIECEWISE",
    "FULL_AND_PIECEWISE/partition",
    "FULL_AND_PIECEWISE/pieces",
)
MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


def peer_options(spec: str, max_capture_size: int) -> dict[str, Any]:
    mode, _, path = spec.partition("/")
    if mode not in MODES or path not in ("", "partition", "pieces", "own"):
        raise SystemExit(
            f"peer {spec!r}: expected MODE, MODE/partition, MODE/pieces or MODE/own, MODE one of "
            f"{MODES}"
        )
    return {
        "cudagraph_mode": mode,
        "compiler": "inductor",
        "max_cudagraph_capture_size": max_capture_size,
        "use_inductor_graph_partition": path == "partition",
        "full_graph_compile": "pieces" if path == "pieces" else "whole",
        "batch_one": "own" if path == "own" else "padded",
    }


def workloads(args: argparse.Namespace) -> list[Workload]:
    default = ([16] if args.quick else [64, 256, 1024]) if args.mixed else None
    sizes = args.tokens or default or ([1, 4] if args.quick else [1, 8, 32, 128])
    return [Workload("mixed" if args.mixed else "decode", n) for n in sizes]


def time_in_turns(
    bench: Bench, runs: dict[str, CGCompileRun], wl: Workload, rounds: int, steps: int
) -> dict[str, list[float]]:
    """Per peer, ms per step of each round; peers take turns in a rotating order."""
    device = bench.s.device
    step_of = {name: run.make_step(wl) for name, run in runs.items()}
    for step in step_of.values():  # compile, warm up, capture this size before any timing
        for _ in range(3):
            _loop_ms(step, device, steps)
    names = list(runs)
    per_round: dict[str, list[float]] = {name: [] for name in names}
    sync(device)
    gc.collect()
    gc.disable()  # no collector pauses inside a timed loop
    try:
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                per_round[name].append(_loop_ms(step_of[name], device, steps) / steps)
    finally:
        gc.enable()
    return per_round


def summarise(per_round: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    base = next(iter(per_round))
    return {
        name: {
            "median_ms": statistics.median(times),
            "min_ms": min(times),
            "ratio_to_first": statistics.median(
                t / b for t, b in zip(times, per_round[base], strict=True)
            ),
        }
        for name, times in per_round.items()
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--out", required=True, type=Path, help="folder for interleaved-{decode,mixed}.json"
    )
    p.add_argument("--peers", nargs="+", default=list(DEFAULT_PEERS), help="the first is the base")
    p.add_argument(
        "--tokens", nargs="+", type=int, help="batch sizes (default 1 8 32 128; mixed 64 256 1024)"
    )
    p.add_argument("--mixed", action="store_true", help="mixed batches (default: uniform decode)")
    p.add_argument("--rounds", type=int, default=30, help="timed loops per peer and workload")
    p.add_argument("--steps", type=int, default=10, help="steps per loop")
    p.add_argument("--quick", action="store_true", help="tiny model, few sizes (CPU smoke test)")
    args = p.parse_args(argv)
    settings = Settings.from_args(
        argparse.Namespace(
            quick=args.quick,
            modes=[],
            compilers=[],
            warmup=0,
            repeats=0,
            steps=args.steps,
            skip=[],
        )
    )
    torch._dynamo.config.recompile_limit = 64  # the peers share the model's forward
    if settings.device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # as in benchmarks/decode.py
    results: dict[str, Any] = {
        "metadata": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": os.environ.get("CGCOMPILE_COMMIT", "unknown"),
            "device": torch.cuda.get_device_name() if settings.device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "dtype": str(settings.dtype),
            "peers": args.peers,
            "timing": f"{args.rounds} rounds of {args.steps} steps per peer, peers in turns "
            f"(rotating order); median ms per step and median per-round ratio to {args.peers[0]}",
        },
        "workloads": {},
    }
    with torch.no_grad():
        bench = Bench(settings, Stopwatch())
        hint = settings.max_capture_size
        runs = {
            spec: CGCompileRun(bench, peer_options(spec, hint), hint=hint) for spec in args.peers
        }
        check = settings.check_workload
        for spec, run in runs.items():  # each peer's first call against eager, as decode.py does
            bench.reset_state()
            result = compare(run.make_step(check)(), bench.reference, settings.tol)
            results.setdefault("check", {})[spec] = result
            if not result["ok"]:
                raise SystemExit(f"{spec} differs from eager on {check.name}: {result}")
        for wl in workloads(args):
            per_round = time_in_turns(bench, runs, wl, args.rounds, args.steps)
            results["workloads"][wl.name] = {"per_round_ms": per_round, **summarise(per_round)}
            row = "  ".join(
                f"{name} {s['median_ms']:.3f} ms ({s['ratio_to_first']:.3f})"
                for name, s in summarise(per_round).items()
            )
            print(f"{wl.name}: {row}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"interleaved-{'mixed' if args.mixed else 'decode'}.json"
    (args.out / name).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
