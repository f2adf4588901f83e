"""Per-step latency of every cgcompile CUDA-graph mode next to hand-built ideals, on one GPU.

Runs the example Llama (`LlamaConfig.bench()`, bf16, random weights) on uniform-decode batches
(one token per request) and mixed batches, for: eager, compile_default, reduce_overhead,
hand_full_graph, hand_piecewise, kernel_floor and cgcompile's 5 modes x 2 piece compilers, plus
the cold start (compile, capture, graph memory) of the modes. Writes DIR/decode-results.json and
DIR/BENCHMARKS.md and prints a summary.

    python benchmarks/decode.py --out benchmarks/results            # the GPU run (~6 min)
    python benchmarks/decode.py --out /tmp/bench --quick            # tiny model, CPU or GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report  # noqa: E402
from benchmarks._hand_graphs import HandFullGraph, HandPiecewise  # noqa: E402
from benchmarks._timing import (  # noqa: E402
    Step,
    Stopwatch,
    compare,
    gpu_time_per_step_ms,
    memory_delta_mb,
    memory_snapshot,
    time_steps,
    timed_call,
)
from examples.llama import Llama, LlamaConfig, make_inputs  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # plain prints without it
    tqdm = None

MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
COMPILERS = ("inductor", "eager")
# Which batch kinds (uniform_decode hint) have their own graphs to capture in each mode.
SWEEP_HINTS = {
    "NONE": (),
    "PIECEWISE": (False,),
    "FULL": (False,),  # decode batches reuse the mixed full graph of their padded size
    "FULL_DECODE_ONLY": (True,),
    "FULL_AND_PIECEWISE": (True, False),
}
CUDA_ONLY = ("reduce_overhead", "hand_full_graph", "kernel_floor", "hand_piecewise")


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
        tokens, positions = self.inputs(settings.check_workload.num_tokens)
        self.reference = self.model(tokens, positions).clone()

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

    sizes = sorted(_capture_sizes(bench.s.max_capture_size), reverse=True)
    cold = cold_start(bench, call, sizes, hints=(False,), calls_per_size=2)
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
    full = {"method": method, **bench.measure(make_step)}
    floor = {
        wl.name: gpu_time_per_step_ms(make_step(wl), bench.s.device, bench.s.steps)
        for wl in bench.s.workloads
    }
    floor_method = (
        "GPU time per step (kernels + input copies) from torch.profiler's CUDA activity over "
        "hand_full_graph replays"
    )
    return {"hand_full_graph": full, "kernel_floor": {"method": floor_method, "latency_ms": floor}}


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


def _capture_sizes(max_size: int) -> list[int]:
    """cgcompile's default capture sizes up to max_size, largest first (capture order)."""
    from cgcompile.config import default_capture_sizes

    return sorted(default_capture_sizes(max_size), reverse=True)


def cold_start(
    bench: Bench,
    call: Callable[..., Any],
    sizes: list[int],
    hints: tuple[bool, ...],
    calls_per_size: int = 1,
) -> dict[str, Any]:
    """First call (above every capture size: compile only), then one capture sweep per hint."""
    first = bench.inputs(max(sizes) + 1)
    _, first_s = timed_call(lambda: call(*first, uniform=False), bench.s.device)
    sweep_inputs = {n: bench.inputs(n) for n in sizes}

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
        "capture_s": capture_s,
        "capture_sizes": len(sizes),
        "sweeps": ["decode" if u else "mixed" for u in hints],
        **memory_delta_mb(before, memory_snapshot(bench.s.device)),
    }


def cg_backend() -> str | Callable[..., Any]:
    """ "cudagraph_modes" when the installed package's entry point registers it, else the
    backend function itself (a source checkout that was never pip-installed)."""
    if "cudagraph_modes" in torch._dynamo.list_backends(exclude_tags=()):
        return "cudagraph_modes"
    import cgcompile

    return cgcompile.cudagraph_modes


class CGCompileRun:
    """One torch.compile of the model with backend="cudagraph_modes" and its marked inputs."""

    def __init__(self, bench: Bench, options: dict[str, Any] | None) -> None:
        import cgcompile

        self.cg = cgcompile
        self.bench = bench
        self.plain_inputs = bench.inputs
        self.compiled = torch.compile(bench.model, backend=cg_backend(), options=options)

    def inputs(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh inputs with the batch dim marked dynamic (done for every new tensor)."""
        tokens, positions = self.plain_inputs(n)
        self.cg.mark_dynamic_batch(tokens, positions)
        return tokens, positions

    def call(self, tokens: torch.Tensor, positions: torch.Tensor, uniform: bool = False) -> Any:
        with self.cg.batch_hint(uniform_decode=uniform):
            return self.compiled(tokens, positions)

    def cold_start(self, sizes: list[int], hints: tuple[bool, ...]) -> dict[str, Any]:
        self.bench.inputs = self.inputs
        try:
            return cold_start(self.bench, self.call, sizes, hints)
        finally:
            self.bench.inputs = self.plain_inputs

    def make_step(self, wl: Workload) -> Step:
        tokens, positions = self.inputs(wl.num_tokens)
        return lambda: self.call(tokens, positions, uniform=wl.uniform_decode)


def run_cgcompile(bench: Bench, mode: str, compiler: str) -> Results:
    options = {
        "cudagraph_mode": mode,
        "compiler": compiler,
        "max_cudagraph_capture_size": bench.s.max_capture_size,
    }
    run = CGCompileRun(bench, options)
    cold = run.cold_start(_capture_sizes(bench.s.max_capture_size), SWEEP_HINTS[mode])
    result = {"options": options, "cold_start": cold, **bench.measure(run.make_step)}
    return {f"cg/{mode}/{compiler}": result}


def run_cold_start_default(bench: Bench) -> Results:
    """The headline cold start: default options (FULL_AND_PIECEWISE, Inductor, max 512)."""
    run = CGCompileRun(bench, None)
    cold = run.cold_start(_capture_sizes(512), SWEEP_HINTS["FULL_AND_PIECEWISE"])
    return {"cold_start_default": {"options": "defaults", **cold}}


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
        (("hand_full_graph", "kernel_floor"), run_hand_full),
        (("hand_piecewise",), run_hand_piecewise),
    ]
    listed = [(names, lambda fn=fn: fn(bench)) for names, fn in plain]
    for mode in bench.s.modes:
        for compiler in bench.s.compilers:
            job = lambda m=mode, c=compiler: run_cgcompile(bench, m, c)  # noqa: E731
            listed.append(((f"cg/{mode}/{compiler}",), job))
    return listed


def run_all(bench: Bench) -> Results:
    todo = jobs(bench)
    for names, job in tqdm(todo, desc="peers", file=sys.stdout) if tqdm is not None else todo:
        if names[0].startswith(bench.s.skip):
            bench.peers.update({n: {"skipped": "--skip"} for n in names})
        else:
            bench.peers.update(guarded(bench, names, job))
    return bench.peers


def metadata(s: Settings, model: Llama) -> dict[str, Any]:
    cuda = s.device.type == "cuda"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(s.device) if cuda else platform.processor() or "cpu",
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
        ),
        "check": f"logits vs eager on {s.check_workload.name}: max|diff| / max|eager| <= {s.tol}",
        "cgcompile_backend": _describe_backend(),
    }


def _describe_backend() -> str:
    try:
        backend = cg_backend()
    except Exception as e:  # the report says why no cg/* peer ran
        return f"unavailable: {describe(e)}"
    if isinstance(backend, str):
        return "backend='cudagraph_modes' (entry point)"
    return "backend=cgcompile.cudagraph_modes (package not installed: no entry point)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder for the results files")
    p.add_argument("--quick", action="store_true", help="tiny model, few sizes (CPU smoke test)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--compilers", nargs="+", default=list(COMPILERS), choices=COMPILERS)
    p.add_argument("--skip", nargs="+", default=[], metavar="PREFIX", help="peers to leave out")
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
    with torch.no_grad():
        bench = Bench(settings, clock)
        if settings.device.type != "cuda":
            bench.log("no CUDA device: CUDA-only peers are skipped, cgcompile runs without graphs")
        peers = run_all(bench)
    results = {
        "metadata": metadata(settings, bench.model),
        "cold_start_default": peers.pop("cold_start_default"),
        "peers": peers,
    }
    results.update(_report.analyse(results))
    results["total_runtime_s"] = clock.elapsed()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode-results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "BENCHMARKS.md").write_text(_report.markdown(results))
    print(_report.summary(results, args.out))
    return results


if __name__ == "__main__":
    main()
