"""Per-step latency of every cgcompile CUDA-graph mode next to hand-built ideals, on one GPU.

Runs the example Llama (`LlamaConfig.bench()`, bf16, random weights) on uniform-decode batches
(one token per request) and mixed batches, for: eager, compile_default, reduce_overhead,
hand_full_graph, hand_piecewise, cgcompile's 5 modes x 2 piece compilers and, last (it runs the
profiler), kernel_floor, plus the cold start (compile, capture, graph memory) of the modes.
Writes DIR/decode-results.json and DIR/BENCHMARKS.md and prints a summary.

    python benchmarks/decode.py --out benchmarks/results            # the GPU run (~8 min)
    python benchmarks/decode.py --out /tmp/bench --quick            # tiny model, CPU or GPU
    python benchmarks/decode.py --out DIR --isolate --only cg/PIECEWISE hand_piecewise
        # chosen peers (name prefixes), each in a fresh process: no state of earlier peers
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report  # noqa: E402
from benchmarks._cg_peers import describe_backend, run_cgcompile, run_cold_start_default  # noqa: E402
from benchmarks._hand_graphs import HandFullGraph, HandPiecewise  # noqa: E402
from benchmarks._harness import (  # noqa: E402
    Bench,
    Results,
    Settings,
    Workload,
    capture_sizes,
    cold_start,
    describe,
    release,
    tqdm,
)
from benchmarks._timing import Step, Stopwatch, gpu_time_per_step_ms  # noqa: E402
from examples.llama import Llama  # noqa: E402

MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
COMPILERS = ("inductor", "eager")
JOB_FILE = "job.json"  # what `--job NAME` writes for `--isolate`
CUDA_ONLY = ("reduce_overhead", "hand_full_graph", "kernel_floor", "hand_piecewise")


def run_eager(bench: Bench) -> Results:
    def make_step(wl: Workload) -> Step:
        tokens, positions = bench.inputs(wl.num_tokens)
        return lambda: bench.model(tokens, positions)

    return {"eager": {"method": "plain model", **bench.measure(make_step)}}


def run_compile_default(bench: Bench) -> Results:
    compiled = torch.compile(bench.model)

    def make_step(wl: Workload) -> Step:
        tokens, positions = bench.inputs(wl.num_tokens)
        return lambda: compiled(tokens, positions)

    method = (
        "torch.compile(model): Inductor, no graphs, dynamic=None (the first size static, "
        "then automatic-dynamic recompiles; size 1 is always specialized)"
    )
    return {"compile_default": {"method": method, **bench.measure(make_step)}}


def run_reduce_overhead(bench: Bench) -> Results:
    compiled = torch.compile(bench.model, mode="reduce-overhead")

    def call(tokens: torch.Tensor, positions: torch.Tensor, uniform: bool = False) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(tokens, positions)

    def make_step(wl: Workload) -> Step:
        tokens, positions = bench.inputs(wl.num_tokens)
        return lambda: call(tokens, positions)

    sizes = capture_sizes(bench.s.max_capture_size)
    cold = cold_start(bench, call, bench.inputs, sizes, hints=(False,), calls_per_size=2)
    method = (
        "torch.compile(model, mode='reduce-overhead'): cudagraph trees; a new size warms up, "
        "then records (2 calls a size in the capture sweep, its recompiles included)"
    )
    return {"reduce_overhead": {"method": method, "cold_start": cold, **bench.measure(make_step)}}


def run_hand_full(bench: Bench) -> Results:
    hand = HandFullGraph(bench.model)

    def make_step(wl: Workload) -> Step:
        return hand.step_for(*bench.inputs(wl.num_tokens))

    method = (
        "torch.compile(model, dynamic=False) per size, captured with torch.cuda.graph per size; "
        "static input buffers, copy in, replay"
    )
    return {"hand_full_graph": {"method": method, **bench.measure(make_step)}}


def run_kernel_floor(bench: Bench) -> Results:
    """Run last: a profiler session can leave later CUDA API calls slower in the process."""
    hand = HandFullGraph(bench.model)
    floor = {
        wl.name: gpu_time_per_step_ms(
            hand.step_for(*bench.inputs(wl.num_tokens)), bench.s.device, bench.s.steps
        )
        for wl in bench.s.workloads
    }
    method = (
        "GPU time per step (kernels + input copies) from torch.profiler's CUDA activity over "
        "hand_full_graph replays; measured after every timed peer"
    )
    return {"kernel_floor": {"method": method, "latency_ms": floor}}


def run_hand_piecewise(bench: Bench) -> Results:
    hand = HandPiecewise(bench.model)

    def make_step(wl: Workload) -> Step:
        return hand.step_for(*bench.inputs(wl.num_tokens))

    method = (
        "split by hand at SDPA; pieces compiled by Inductor (static shapes, one compile shared "
        "by every layer), captured per size into one pool; SDPA eager between pieces, its "
        "result copied into the static buffer the next piece reads"
    )
    return {"hand_piecewise": {"method": method, **bench.measure(make_step)}}


def guarded(bench: Bench, names: tuple[str, ...], job: Callable[[], Results]) -> Results:
    """job()'s results, or an error for each of its peers; compiled state released either way."""
    cuda_only = [n for n in names if n in CUDA_ONLY]
    if cuda_only and bench.s.device.type != "cuda":
        return {n: {"skipped": f"needs CUDA; running on {bench.s.device.type}"} for n in names}
    bench.clock.lap()
    try:
        results = job()
    except Exception as e:  # a failing peer is recorded and the benchmark goes on
        results = {n: {"error": describe(e)} for n in names}
    finally:
        release()
    seconds = bench.clock.lap()
    results[names[0]]["wall_s"] = seconds
    errors = sorted({r["error"] for r in results.values() if "error" in r})
    bench.log(f"{', '.join(names)}: {seconds:.1f}s {' '.join(errors)}".rstrip())
    return results


def jobs(bench: Bench) -> list[tuple[tuple[str, ...], Callable[[], Results]]]:
    """Every peer in run order; the headline cold start first, before any other compile."""
    plain = [
        (("cold_start_default",), run_cold_start_default),
        (("eager",), run_eager),
        (("compile_default",), run_compile_default),
        (("reduce_overhead",), run_reduce_overhead),
        (("hand_full_graph",), run_hand_full),
        (("hand_piecewise",), run_hand_piecewise),
    ]
    listed = [(names, lambda fn=fn: fn(bench)) for names, fn in plain]
    for mode in bench.s.modes:
        for compiler in bench.s.compilers:
            job = lambda m=mode, c=compiler: run_cgcompile(bench, m, c)  # noqa: E731
            listed.append(((f"cg/{mode}/{compiler}",), job))
    if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe") and (
        "inductor" in bench.s.compilers
    ):
        for mode in [m for m in ("PIECEWISE", "FULL") if m in bench.s.modes]:
            job = lambda m=mode: run_cgcompile(bench, m, "inductor", skip_module_guards=True)  # noqa: E731
            listed.append(((f"cg/{mode}/inductor/skip-module-guards",), job))
    for mode in [m for m in ("PIECEWISE", "FULL", "FULL_AND_PIECEWISE") if m in bench.s.modes]:
        if "inductor" in bench.s.compilers:
            job = lambda m=mode: run_cgcompile(bench, m, "inductor", hint=True)  # noqa: E731
            listed.append(((f"cg/{mode}/inductor/hint",), job))
    for mode in [m for m in ("PIECEWISE", "FULL_AND_PIECEWISE") if m in bench.s.modes]:
        if "inductor" in bench.s.compilers:
            for path, partition in (("partition", True), ("fx-split", False)):
                job = lambda m=mode, p=partition: run_cgcompile(bench, m, "inductor", partition=p)  # noqa: E731
                listed.append(((f"cg/{mode}/{path}",), job))
    if "FULL_AND_PIECEWISE" in bench.s.modes and "inductor" in bench.s.compilers:
        job = lambda: run_cgcompile(bench, "FULL_AND_PIECEWISE", "inductor", pieces=True)  # noqa: E731
        listed.append((("cg/FULL_AND_PIECEWISE/pieces",), job))
    listed.append((("kernel_floor",), lambda: run_kernel_floor(bench)))
    return listed


def run_all(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """Run every job, rewriting the results files after each (a killed run leaves them)."""
    todo = [
        (n, job) for n, job in jobs(bench) if not args.only or n[0].startswith(tuple(args.only))
    ]
    for names, job in tqdm(todo, desc="peers", file=sys.stdout) if tqdm is not None else todo:
        if names[0].startswith(bench.s.skip):
            bench.peers.update({n: {"skipped": "--skip"} for n in names})
        elif args.isolate:
            bench.peers.update(run_isolated(bench, names, args))
        else:
            bench.peers.update(guarded(bench, names, job))
        write_results(bench, args.out)
    return write_results(bench, args.out)


def run_isolated(bench: Bench, names: tuple[str, ...], args: argparse.Namespace) -> Results:
    """One job in a fresh Python process (no compiled code, graphs or profiler state of earlier
    peers), its results read back from the JSON file it writes."""
    child = ["--modes", *args.modes, "--compilers", *args.compilers, "--job", names[0]]
    for flag in ("repeats", "steps", "warmup"):
        child += [f"--{flag}", str(getattr(args, flag))]
    child += ["--quick"] if args.quick else []
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run([sys.executable, __file__, *child, "--out", folder], check=False)
        path = Path(folder) / JOB_FILE
        if done.returncode != 0 or not path.exists():
            bench.log(f"{names[0]}: isolated run exited with {done.returncode}")
            return {n: {"error": f"isolated run exited with {done.returncode}"} for n in names}
        return json.loads(path.read_text())


def run_job(bench: Bench, name: str, out: Path) -> None:
    """`--job NAME`: run that one job and write its results to OUT/job.json."""
    found = [(names, job) for names, job in jobs(bench) if names[0] == name]
    if not found:
        raise SystemExit(f"--job {name!r}: no such peer; peers: {[n[0] for n, _ in jobs(bench)]}")
    names, job = found[0]
    out.mkdir(parents=True, exist_ok=True)
    (out / JOB_FILE).write_text(json.dumps(guarded(bench, names, job)) + "\n")


def write_results(bench: Bench, out: Path) -> dict[str, Any]:
    peers = dict(bench.peers)
    results = {
        "metadata": metadata(bench.s, bench.model),
        "cold_start_default": peers.pop("cold_start_default", {"skipped": "not run yet"}),
        "peers": peers,
    }
    results.update(_report.analyse(results))
    results["total_runtime_s"] = bench.clock.elapsed()
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode-results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "BENCHMARKS.md").write_text(_report.markdown(results))
    return results


def metadata(s: Settings, model: Llama) -> dict[str, Any]:
    cuda = s.device.type == "cuda"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": os.environ.get("CGCOMPILE_COMMIT", "unknown"),
        "tree_digest": os.environ.get("CGCOMPILE_TREE", "unknown"),  # tests/gpu/tree_digest.sh
        "device": torch.cuda.get_device_name(s.device) if cuda else platform.processor() or "cpu",
        "device_type": s.device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "model": {
            **dataclasses.asdict(s.cfg),
            "parameters": sum(p.numel() for p in model.parameters()),
        },
        "dtype": str(s.dtype).removeprefix("torch."),
        "workloads": [w.name for w in s.workloads],
        "max_cudagraph_capture_size": s.max_capture_size,
        "timing": (
            f"median over {s.repeats} loops (fewer, >= 5, for peers slower than 1 s per "
            f"workload) of {s.steps} steps, each loop bracketed by "
            f"{'CUDA events' if cuda else 'perf_counter'}, after {s.warmup} warm-up loops; "
            f"same input tensors every step; ms per step"
            + ("; every peer in a fresh process" if s.isolate else "")
        ),
        "check": f"logits vs eager on {s.check_workload.name}: max|diff| / max|eager| <= {s.tol}",
        "cgcompile_backend": describe_backend(),
        "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder for the results files")
    p.add_argument("--quick", action="store_true", help="tiny model, few sizes (CPU smoke test)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--compilers", nargs="+", default=list(COMPILERS), choices=COMPILERS)
    p.add_argument("--skip", nargs="+", default=[], metavar="PREFIX", help="peers to leave out")
    p.add_argument("--only", nargs="+", default=[], metavar="PREFIX", help="peers to run")
    p.add_argument(
        "--isolate", action="store_true", help="each peer in a fresh process (slower start)"
    )
    p.add_argument("--job", help=argparse.SUPPRESS)  # internal: one peer, for --isolate
    p.add_argument("--repeats", type=int, default=0, help="timed loops (default 20, quick 5)")
    p.add_argument("--steps", type=int, default=0, help="steps per loop (default 10, quick 3)")
    p.add_argument("--warmup", type=int, default=0, help="untimed loops (default 3, quick 1)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    clock = Stopwatch()
    args = parse_args(argv)
    settings = Settings.from_args(args)
    # One model, many compiles (peers, sizes, layers): keep Dynamo from falling back to eager.
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096
    if settings.device.type == "cuda":
        # One attention kernel family for every peer (flash / efficient), as in earlier runs;
        # cuDNN attention would also break an unbacked batch's trace (cgcompile.dynamic).
        torch.backends.cuda.enable_cudnn_sdp(False)
    with torch.no_grad():
        bench = Bench(settings, clock)
        if settings.device.type != "cuda":
            bench.log("no CUDA device: CUDA-only peers are skipped, cgcompile runs without graphs")
        if args.job:
            run_job(bench, args.job, args.out)
            return {}
        results = run_all(bench, args)
    print(_report.summary(results, args.out))
    return results


if __name__ == "__main__":
    main()
