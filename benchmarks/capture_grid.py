"""What a capture grid costs in step time: every batch size 1..512, decode and mixed, padded.

One process compiles the example Llama (`LlamaConfig.bench()`, bf16, default options but the
capture sizes) with every size a grid may hold: 1, 2, 4 and the multiples of 8 up to 512. After
`capture_all`, a call of exactly each size is timed, decode (`batch_hint(uniform_decode=True)`:
one full graph) and mixed (piecewise graphs around eager attention): CUDA events around each
call, synchronised, median of 15 after 3 warm-ups, on random tokens. A batch of n tokens costs
what a call of its padded size costs, so each grid's step time at every n in 1..512 is read off
the same timings: `old` (1, 2, 4, multiples of 8 below 256, of 16 from 256: 51 sizes), `new`
(`cgcompile.config.default_capture_sizes(512)`) and the alternatives in `GRIDS`. Printed per
grid and kind: graphs it captures (17 pieces per mixed size with 16 layers, one per decode
size), the mean and worst over n of its step time against `old`'s, and the n where the worst is.

    python benchmarks/capture_grid.py --out DIR
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

import cgcompile  # noqa: E402
from cgcompile.config import default_capture_sizes  # noqa: E402
from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch  # noqa: E402

MAX = 512
ALL_SIZES = (1, 2, 4, *range(8, MAX + 1, 8))
GRIDS = {
    "old": (1, 2, 4, *range(8, 256, 8), *range(256, MAX + 1, 16)),
    "new": default_capture_sizes(MAX),
    "eight_per_doubling": (1, 2, 4, *range(8, 129, 8), *range(144, 257, 16), *range(288, 513, 32)),
}


def padded(grid: tuple[int, ...], n: int) -> int:
    return min(s for s in grid if s >= n)


def time_sizes(compiled: Any, cfg: LlamaConfig, decode: bool) -> dict[int, float]:
    """Median ms of a call of exactly each size (CUDA events, synchronised per call)."""
    times: dict[int, float] = {}
    for n in ALL_SIZES:
        tokens, positions = make_inputs(cfg, n, "cuda")
        mark_batch(cfg, tokens, positions, hint=MAX)
        samples = []
        for i in range(18):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            with cgcompile.batch_hint(uniform_decode=decode):
                compiled(tokens, positions)
            end.record()
            end.synchronize()
            if i >= 3:
                samples.append(start.elapsed_time(end))
        times[n] = statistics.median(samples)
    return times


def compare(times: dict[int, float], grid: tuple[int, ...]) -> dict[str, Any]:
    """Step time of every n in 1..MAX padded to `grid`, against the same n padded to `old`."""
    ratios = {n: times[padded(grid, n)] / times[padded(GRIDS["old"], n)] for n in range(1, MAX + 1)}
    worst = max(ratios, key=ratios.__getitem__)
    return {
        "sizes": len(grid),
        "mean_ratio": round(statistics.fmean(ratios.values()), 4),
        "worst_ratio": round(ratios[worst], 4),
        "worst_n": worst,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("capture_grid: needs CUDA")
        return 0
    cfg = LlamaConfig.bench()
    model = Llama(cfg).to("cuda", torch.bfloat16).eval()
    options = {"cudagraph_capture_sizes": list(ALL_SIZES)}
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    with torch.inference_mode():
        for n in (8, 1):
            tokens, positions = make_inputs(cfg, n, "cuda")
            mark_batch(cfg, tokens, positions, hint=MAX)
            compiled(tokens, positions)
        graphs = cgcompile.capture_all(progress=False)
        times = {kind: time_sizes(compiled, cfg, kind == "decode") for kind in ("decode", "mixed")}
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "graphs_captured_all_sizes": graphs,
        "step_ms": times,
        "grids": {name: list(grid) for name, grid in GRIDS.items()},
        "compare": {
            kind: {name: compare(times[kind], grid) for name, grid in GRIDS.items()}
            for kind in times
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "capture-grid.json").write_text(json.dumps(result, indent=1))
    for kind, per in result["compare"].items():
        for name, row in per.items():
            print(f"{kind:6} {name:20} {row}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
