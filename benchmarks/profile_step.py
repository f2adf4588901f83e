"""Where the time of one cgcompile step goes: CPU time per step, GPU time, top ops.

For each mode given, compiles the benchmark model, runs a workload, and reports the host time
of one step without synchronising (the CPU cost of launching it), the device time from CUDA
events, and the profiler's top ops by self CPU time. With --out, the text and Chrome traces go
to DIR for a closer look.

    python benchmarks/profile_step.py --modes PIECEWISE FULL --tokens 8 [--mixed] [--out DIR]
    python benchmarks/profile_step.py --modes PIECEWISE --paths fx partition fx partition
    python benchmarks/profile_step.py --modes PIECEWISE --paths fx partition --python  # cProfile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cgcompile  # noqa: E402
from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch  # noqa: E402


def host_and_device_ms(step, device: torch.device, n: int = 50) -> tuple[float, float]:
    """Median host ms to issue one step, and median device ms per step."""
    host, dev = [], []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize(device)
        dev.append(start.elapsed_time(end))
    return statistics.median(host), statistics.median(dev)


PATHS = {"default": None, "partition": True, "fx": False}  # use_inductor_graph_partition


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds used so far by each thread of this process (Linux), by 'tid name'."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        seconds[f"{task.name} {name}"] = (int(fields[11]) + int(fields[12])) / tick
    return seconds


def op_cost_us(n: int = 2000) -> str:
    """Host cost of two cheap ops outside any step: a process-wide slowdown shows here."""
    x = torch.randn(64, 64, device="cuda")
    t0 = time.perf_counter()
    for _ in range(n):
        x.t()
    t1 = time.perf_counter()
    for _ in range(n):
        torch.empty(256, device="cuda")
    t2 = time.perf_counter()
    return f"transpose {(t1 - t0) / n * 1e6:.2f} us, empty {(t2 - t1) / n * 1e6:.2f} us"


def python_profile(step, n: int = 50, rows: int = 25) -> str:
    """cProfile of `n` steps (host side): the Python functions the host time goes to, the
    threads that used CPU meanwhile, and the cost of cheap ops outside a step."""
    profiler = cProfile.Profile()
    before = thread_cpu_seconds()
    profiler.enable()
    for _ in range(n):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    after = thread_cpu_seconds()
    busy = sorted(((after[t] - before.get(t, 0.0), t) for t in after), reverse=True)[:4]
    threads = ", ".join(f"{t}: {s:.2f}s" for s, t in busy)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(rows)
    return (
        f"-- threads' CPU during {n} steps: {threads}\n-- outside a step: {op_cost_us()}\n"
        f"-- cProfile of {n} steps, by own time\n{text.getvalue()}"
    )


def profile_mode(
    model: Llama,
    mode: str,
    tokens: int,
    uniform: bool,
    out: Path | None,
    path: str = "default",
    with_python: bool = False,
) -> str:
    torch._dynamo.reset()
    options = {
        "cudagraph_mode": mode,
        "max_cudagraph_capture_size": 1024,
        "use_inductor_graph_partition": PATHS[path],
    }
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    inputs = make_inputs(model.cfg, tokens, "cuda")
    mark_batch(model.cfg, *inputs)

    def step():
        with cgcompile.batch_hint(uniform_decode=uniform):
            return compiled(*inputs)

    for _ in range(5):
        step()
    host, dev = host_and_device_ms(step, inputs[0].device)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    if out is not None:
        prof.export_chrome_trace(str(out / f"trace-{mode}-{path}-{tokens}.json"))
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    if with_python:
        table += "\n" + python_profile(step)
    head = (
        f"== {mode} ({path} path) tokens={tokens} uniform={uniform}: host {host:.3f} ms, "
        f"device {dev:.3f} ms"
    )
    return f"{head}\n{table}\n{cgcompile.compiled_graphs()[-1].format_report()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write profile.txt and Chrome traces here")
    parser.add_argument("--modes", nargs="+", default=["FULL", "PIECEWISE", "NONE"])
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--mixed", action="store_true", help="mixed batch (default: decode)")
    parser.add_argument(
        "--paths",
        nargs="+",
        choices=sorted(PATHS),
        default=["default"],
        help="use_inductor_graph_partition per run: None, True or False; repeat a path to "
        "interleave runs (e.g. fx partition fx partition)",
    )
    parser.add_argument(
        "--python", action="store_true", help="add a cProfile of 50 steps (host Python time)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("profile_step needs a CUDA GPU")
        return 0
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.enable_cudnn_sdp(False)  # see docs/BENCHMARKS.md
    model = Llama(LlamaConfig.bench()).to("cuda", torch.bfloat16).eval()
    reports = []
    with torch.no_grad():
        for mode in args.modes:
            for path in args.paths:
                report = profile_mode(
                    model, mode, args.tokens, not args.mixed, args.out, path, args.python
                )
                print(report.splitlines()[0], flush=True)
                reports.append(report)
    text = "\n\n".join(reports)
    if args.out is not None:
        (args.out / "profile.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
