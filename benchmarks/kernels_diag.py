"""Why a cgcompile step is slower than its hand-built ideal: per step, the time, the host time,
the GPU busy time and the number of kernels, on the benchmark model (CUDA only).

Rows: the hand whole graph and hand piecewise step (static Inductor compiles, from the
benchmark), and cgcompile FULL (default backed batch, unbacked batch, a size hint of 1024,
`compile_sizes`), PIECEWISE (default, hint 1024, module guards skipped) and FULL_AND_PIECEWISE,
each at 1, 8 and 256 decode tokens and 1024 mixed tokens. Every row runs in a fresh process and
is timed before the profiler counts its kernels, so no row sees another's compiled code or a
profiler's after-effects. `ms - gpu` is the time per step the GPU sat idle. diag.json also names
each row's costliest kernels at 256 and 1024 tokens. `--trace` writes Chrome traces of the hand
graph and of FULL at 8 tokens, to see where the idle time falls.

    python benchmarks/kernels_diag.py --out DIR [--rows FULL hand_full] [--trace]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cgcompile  # noqa: E402
from benchmarks._hand_graphs import HandFullGraph, HandPiecewise  # noqa: E402
from benchmarks._timing import gpu_time_per_step_ms, time_steps  # noqa: E402
from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch  # noqa: E402

WORKLOADS = [(1, True), (8, True), (256, True), (1024, False)]  # (tokens, uniform decode)
SKIP_MODULE_GUARDS = {"guard_filter_fn": "skip_guard_on_all_nn_modules_unsafe"}
ROWS: dict[str, dict[str, Any]] = {  # cgcompile rows: options, and the batch marking
    "FULL": {"cudagraph_mode": "FULL"},
    "FULL unbacked": {"cudagraph_mode": "FULL", "unbacked": True},
    "FULL hint=1024": {"cudagraph_mode": "FULL", "hint": 1024},
    "FULL+sizes": {"cudagraph_mode": "FULL", "compile_sizes": [n for n, _ in WORKLOADS]},
    "PIECEWISE": {"cudagraph_mode": "PIECEWISE"},
    "PIECEWISE hint=1024": {"cudagraph_mode": "PIECEWISE", "hint": 1024},
    "PIECEWISE skip-module-guards": {"cudagraph_mode": "PIECEWISE", **SKIP_MODULE_GUARDS},
    "FULL_AND_PIECEWISE": {"cudagraph_mode": "FULL_AND_PIECEWISE"},
    "FULL_AND_PIECEWISE pieces": {
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "full_graph_compile": "pieces",
    },
    "FULL_AND_PIECEWISE partition": {
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "use_inductor_graph_partition": True,
    },
}
HAND = ("hand_full", "hand_piecewise")
TRACED = ("hand_full", "FULL")
Step = Callable[[], Any]


def host_ms(step: Step, calls: int = 30) -> float:
    """Median wall time to issue one step from an idle GPU (the host's share)."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def step_maker(row: str, model: Llama) -> Callable[[int, bool], Step]:
    """make(tokens, uniform) -> a step of this row on fresh, seeded inputs."""

    def inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return make_inputs(model.cfg, n, "cuda", generator=torch.Generator().manual_seed(1000 + n))

    if row == "hand_full":
        hand = HandFullGraph(model)
        return lambda n, uniform: hand.step_for(*inputs(n))
    if row == "hand_piecewise":
        pieces = HandPiecewise(model)
        return lambda n, uniform: pieces.step_for(*inputs(n))
    options = dict(ROWS[row])
    unbacked = options.pop("unbacked", False)
    hint = options.pop("hint", None)
    if "guard_filter_fn" in options:
        options["guard_filter_fn"] = getattr(torch.compiler, options["guard_filter_fn"])
    options["max_cudagraph_capture_size"] = 1024
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)

    def make(n: int, uniform: bool) -> Step:
        tokens, positions = inputs(n)
        mark_batch(model.cfg, tokens, positions, unbacked=unbacked, hint=hint)

        def step() -> Any:
            with cgcompile.batch_hint(uniform_decode=uniform):
                return compiled(tokens, positions)

        return step

    return make


def run_row(row: str, out: Path, trace: bool, top: int) -> dict[str, Any]:
    """Every workload of one row: timings first, then the profiler's kernel count; the `top`
    costliest kernels by name at every size (15 at 256 tokens and more when `top` is 0)."""
    torch.backends.cuda.enable_cudnn_sdp(False)  # as in the benchmark
    device = torch.device("cuda")
    model = Llama(LlamaConfig.bench()).to(device, torch.bfloat16).eval()
    results: dict[str, Any] = {}
    with torch.no_grad():
        make = step_maker(row, model)
        steps = {n: make(n, uniform) for n, uniform in WORKLOADS}
        for n, step in steps.items():
            for _ in range(3):
                step()  # compile, capture
            timed = time_steps(step, device, warmup=3, repeats=10, steps=10)
            results[str(n)] = {"ms": timed["median_ms"], "host_ms": host_ms(step)}
        for n, step in steps.items():
            gpu = gpu_time_per_step_ms(step, device, steps=5, top=top or (15 if n >= 256 else 0))
            results[str(n)] |= {"gpu_ms": gpu["median_ms"], "kernels": gpu["kernels_per_step"]}
            results[str(n)]["top_kernels_us"] = gpu.get("top_kernels_us")
            results[str(n)]["top_kernel_calls"] = gpu.get("top_kernel_calls")
        if trace and row in TRACED:
            with torch.profiler.profile(
                activities=[
                    torch.profiler.ProfilerActivity.CPU,
                    torch.profiler.ProfilerActivity.CUDA,
                ]
            ) as prof:
                for _ in range(5):
                    steps[8]()
                torch.cuda.synchronize()
            prof.export_chrome_trace(str(out / f"trace-{row.replace(' ', '_')}-8.json"))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", nargs="+", default=[*HAND, *ROWS], choices=[*HAND, *ROWS])
    parser.add_argument("--trace", action="store_true", help="Chrome traces at 8 tokens")
    parser.add_argument("--top", type=int, default=0, help="name the N costliest kernels")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: one row, this process
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.row:
        print(json.dumps(run_row(args.row, args.out, args.trace, args.top)))
        return
    if not torch.cuda.is_available():
        print("kernels_diag needs a CUDA GPU")
        return
    table: dict[str, Any] = {}
    for row in args.rows:
        cmd = [sys.executable, __file__, "--out", str(args.out), "--row", row]
        cmd += ["--top", str(args.top)]
        done = subprocess.run(cmd + ["--trace"] * args.trace, capture_output=True, text=True)
        if done.returncode != 0:
            table[row] = {"error": done.stderr.strip().splitlines()[-1:]}
        else:
            table[row] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{row}: {table[row]}", flush=True)
    (args.out / "diag.json").write_text(json.dumps(table, indent=1) + "\n")
    print("\n| row | tokens | ms/step | host ms | GPU ms | idle ms | kernels/step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row, cells in table.items():
        for n, c in cells.items() if "error" not in cells else []:
            c.pop("top_kernels_us", None)  # in diag.json
            c.pop("top_kernel_calls", None)
            idle = c["ms"] - c["gpu_ms"]
            print(
                f"| {row} | {n} | {c['ms']:.3f} | {c['host_ms']:.3f} | {c['gpu_ms']:.3f} | "
                f"{idle:.3f} | {c['kernels']:.0f} |"
            )


if __name__ == "__main__":
    main()
