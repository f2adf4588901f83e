"""FULL_AND_PIECEWISE's decode steps against FULL's, on each model family, peers in turns.

One process per family (`--family`): three builds of the model (each with its own state)
compiled as `FULL`, `FULL_AND_PIECEWISE` (its full graphs replay the pieces, the default) and
`FULL_AND_PIECEWISE/whole` (`full_graph_compile="whole"`). Each captures its decode graphs at
batch 1 and 8; then, in `--rounds` rounds whose peer order rotates, each peer replays `--steps`
back-to-back decode steps on fixed random inputs, timed with CUDA events (no host syncs inside
the loop). Printed per batch size: each peer's median ms per step and the median over rounds of
its ratio to FULL in the same round. `--kernels`: then each peer's kernels per step under
torch's profiler, and the kernel names whose time per step differs most from FULL's.

    python benchmarks/fp_vs_full.py --out DIR --family rows [--kernels]
    python benchmarks/fp_vs_full.py --out DIR --family llama --quick    # tiny model, CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._families import NAMES, build  # noqa: E402
from benchmarks._timing import _loop_ms as loop_ms  # noqa: E402
from benchmarks._timing import gpu_time_per_step_ms, sync  # noqa: E402

PEERS = {
    "FULL": {"cudagraph_mode": "FULL"},
    "FULL_AND_PIECEWISE": {},
    "FULL_AND_PIECEWISE/whole": {"full_graph_compile": "whole"},
}
BATCHES = (1, 8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--family", choices=NAMES, required=True)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="tiny model, simulated on CPU")
    parser.add_argument("--kernels", action="store_true", help="profile each peer's kernels")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    extra = {} if cuda else {"graph_runtime": "simulated", "compiler": "eager"}
    steps: dict[tuple[str, int], Any] = {}
    with torch.inference_mode():
        for peer, options in PEERS.items():
            # a family per peer: its own model and state (an HF model's static caches)
            family = build(args.family, device.type, dtype, args.quick)
            compiled = torch.compile(
                family.model, backend="cudagraph_modes", options=options | extra
            )
            for b in BATCHES:
                inputs = family.inputs(b)
                for _ in range(3):  # warm-up, capture, replay
                    family.run(compiled, inputs)
                steps[peer, b] = lambda c=compiled, i=inputs, f=family: f.run(c, i)
        sync(device)
        times: dict[tuple[str, int], list[float]] = {key: [] for key in steps}
        names = list(PEERS)
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for b in BATCHES:
                for peer in order:
                    times[peer, b].append(loop_ms(steps[peer, b], device, args.steps) / args.steps)
    result: dict[str, Any] = {"family": args.family, "device": str(device), "rows": []}
    if cuda:
        result |= {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for b in BATCHES:
        for peer in names:
            ratios = [t / f for t, f in zip(times[peer, b], times["FULL", b], strict=True)]
            row = {
                "batch": b,
                "peer": peer,
                "ms": round(statistics.median(times[peer, b]), 4),
                "ratio_to_full": round(statistics.median(ratios), 4),
            }
            result["rows"].append(row)
            ms, ratio = row["ms"], row["ratio_to_full"]
            print(f"{args.family:9} batch {b}: {peer:26} {ms:.4f} ms  x{ratio:.3f}")
    if args.kernels:
        with torch.inference_mode():
            result["kernels"] = kernel_differences(steps, device)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"fp-vs-full-{args.family}.json").write_text(json.dumps(result, indent=1))
    return 0


def kernel_differences(steps: dict[tuple[str, int], Any], device: torch.device) -> dict[str, Any]:
    """Per peer and batch: GPU ms and kernels per step, and the kernel names (all of them, us
    per step) whose time differs most from FULL's, printed."""
    found: dict[str, Any] = {}
    for (peer, b), step in steps.items():
        found[f"{peer} {b}"] = gpu_time_per_step_ms(step, device, steps=10, top=1000)
    for peer, b in steps:
        mine, full = found[f"{peer} {b}"], found[f"FULL {b}"]
        print(
            f"  batch {b} {peer:26} GPU {mine['median_ms']:.4f} ms, "
            f"{mine['kernels_per_step']:.0f} kernels"
        )
        if peer == "FULL":
            continue
        ours, theirs = mine.get("top_kernels_us", {}), full.get("top_kernels_us", {})
        delta = {k: ours.get(k, 0.0) - theirs.get(k, 0.0) for k in {*ours, *theirs}}
        for name, us in sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:8]:
            calls = mine.get("top_kernel_calls", {}).get(name, 0)
            print(f"    {us:+8.2f} us  ({calls:g} calls)  {name}")
    return found


if __name__ == "__main__":
    raise SystemExit(main())
