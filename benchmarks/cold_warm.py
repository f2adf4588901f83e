"""Time to ready, cold and warm: each step from a fresh process to serving every capture size.

Fresh processes in a row, each compiling the example Llama (`LlamaConfig.bench()`, bf16,
KV cache written in place, default options, `mark_dynamic_batch(..., hint=512)`):

- `cold`: empty Inductor and Triton caches; at the end it saves `save_compile_cache(FILE)`;
- `warm-local`: the same caches again (a plain restart on the same machine);
- `warm-file`: empty caches, `load_compile_cache(FILE)` first (a restart on a fresh machine);
- `largest`: the same first calls, then only the largest size's keys (mixed and decode),
  captured on their own calls: the graph memory `capture_all`'s is compared with; then
  `capture_all()` of the other keys under cProfile (where its time per graph goes);
- `aot-cold`, `aot-warm-local`, `aot-warm-file`: `cgcompile.precompile` for 8 tokens and 1
  token instead of the first calls' compiles: on empty caches (it compiles and saves FILE2),
  again on the same caches, and on empty caches (both load FILE2: no Dynamo trace).

Before them a throwaway cold process fills Python's bytecode cache (`PYTHONPYCACHEPREFIX`), as a
torch installed by pip ships .pyc files; the H200 image's torch has none, and compiling the
sources of what a first compile imports cost seconds of every fresh process (`--no-prime`: skip).

Each prints, in seconds: load of the compile cache, first call of 8 tokens (Dynamo, split,
Inductor pieces and the whole-graph compile), first call of 1 token (Dynamo traces batch 1
apart; the dynamic graph's compile serves it, `batch_one`), `capture_all()` with its graph
count, then graph memory, each graph's report line (compile parts, compile-cache hits and
misses), step times at 1, 8, 32 and 128 tokens (decode batches, CUDA events, median of 20), and
a soak of `--soak` calls of random sizes and kinds after `capture_all`: graphs captured and
graph memory grown during it (both should be 0), and the allocator's reserved growth (the
benchmark's own inputs included); Dynamo's traces and its graph breaks by reason.

    python benchmarks/cold_warm.py --out DIR [--soak 2000]
    python benchmarks/cold_warm.py --out DIR --phases cold --no-cudnn-sdp   # one phase, no cuDNN
    python benchmarks/cold_warm.py --out DIR --quick      # tiny model on CPU, simulated graphs
                                                          # (--quick-layers 16: a deeper one)
    python benchmarks/cold_warm.py --out DIR --family rows   # another model family (_families)
    python benchmarks/cold_warm.py --out DIR --family hf-llama --marked   # HF, the batch marked
    python benchmarks/cold_warm.py --out DIR --phases cold --profile-first DIR  # pstats files
    python benchmarks/cold_warm.py --out DIR --turns TORCHINDUCTOR_COMPILE_THREADS=1 --soak 0  # A/B
    #   --turns-phase aot-warm-local: the same A/B of precompiled warm loads (after one save)
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import io
import json
import os
import pstats
import random
import re
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
from benchmarks._families import NAMES, Family, build  # noqa: E402
from benchmarks._timing import sync, timed_call  # noqa: E402

PHASES = ("cold", "warm-local", "warm-file", "largest")
AOT_PHASES = ("aot-cold", "aot-warm-local", "aot-warm-file")
LARGEST = 512
"""The default largest capture size."""
STEP_SIZES = (1, 8, 32, 128)


def phase(args: argparse.Namespace) -> dict[str, Any]:
    """One fresh process: load (warm-file), first calls, capture_all, step times, soak, save."""
    cuda = not args.quick
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    result: dict[str, Any] = {"phase": args.phase}
    if args.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.load:
        result["load_s"] = timed_call(lambda: cgcompile.load_compile_cache(args.load), device)[1]
    torch.manual_seed(0)
    family = build(
        args.family, device.type, dtype, args.quick, args.quick_layers, args.unbacked, args.marked
    )
    model = family.model
    options: dict[str, Any] = {"graph_runtime": "simulated"} if args.quick else {}
    options |= json.loads(args.options)
    compiled: Any = torch.compile(model, backend="cudagraph_modes", options=options)

    def call(n: int, decode: bool) -> Any:
        return family.run(compiled, family.inputs(n), decode)

    with torch.no_grad():
        if args.precompile:
            loader = cProfile.Profile() if args.profile_first else None
            with loader or contextlib.nullcontext():
                compiled, result["precompile_s"] = timed_call(
                    lambda: _precompile(family, args.precompile, options), device
                )
            if loader is not None:
                loader.dump_stats(Path(args.profile_first) / f"precompile-{args.phase}.prof")
            result["precompile_loaded"] = compiled.loaded
            result["load_steps"] = compiled.load_steps
        profiler = cProfile.Profile() if args.profile_first else None
        with profiler or contextlib.nullcontext():
            result["first_call_8_s"] = timed_call(lambda: call(8, False), device)[1]
        if profiler is not None:  # cProfile slows Python-bound compile work ~1.7x: flag it
            profiler.dump_stats(Path(args.profile_first) / f"first-call-{args.phase}.prof")
            result["first_call_8_profiled"] = True
        result["first_call_1_s"] = timed_call(lambda: call(1, True), device)[1]
        # a static cache per batch size (HF): capture_all captures what has had a call
        others = [n for n in family.sizes or () if n not in (1, 8)]
        result["first_calls_other_sizes_s"] = sum(
            timed_call(lambda n=n: call(n, True), device)[1] for n in others
        )
        if args.phase == "largest":
            return {**result, **_largest_keys(call, device), **_profiled_capture(device)}
        reserved = torch.cuda.memory_reserved() if cuda else 0
        capturer = cProfile.Profile() if args.profile_first else None
        with capturer or contextlib.nullcontext():
            captured, result["capture_all_s"] = timed_call(
                lambda: cgcompile.capture_all(progress=False), device
            )
        if capturer is not None:
            capturer.dump_stats(Path(args.profile_first) / f"capture-all-{args.phase}.prof")
        result["graphs_captured"] = captured
        graphs = cgcompile.compiled_graphs()
        result["graph_memory_mib"] = _graph_memory_mib()
        if cuda:
            result["reserved_growth_mib"] = (torch.cuda.memory_reserved() - reserved) / 2**20
        result["reports"] = [g.format_report().splitlines()[2].strip() for g in graphs]
        result["compile_phases"] = _compile_phases()
        sizes = family.sizes or STEP_SIZES
        result["step_ms"] = {n: _step_ms(call, n, device) for n in STEP_SIZES if n in sizes}
        result.update(_soak(call, args.soak, device, family.sizes))
        result["dynamo_traces"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        breaks = torch._dynamo.utils.counters["graph_break"]  # reason -> count
        result["graph_breaks"] = {" ".join(why.split())[:240]: n for why, n in breaks.items()}
    if args.save and options.get("compiler", "inductor") == "inductor":  # eager: nothing to save
        cgcompile.save_compile_cache(args.save)
    return result


def _precompile(family: Family, path: str, options: dict[str, Any]) -> Any:
    """`cgcompile.precompile` for a batch of 8 (dynamic, hint 512) and a batch of 1, or each
    batch size of a family with a static cache per size (HF), called as the family calls
    (positional or keyword arguments)."""
    examples = [family.inputs(n) for n in (family.sizes or (8, 1))]
    if any(args and kwargs for args, kwargs in examples):
        raise SystemExit(
            f"precompile takes positional or keyword examples, not both ({family.name})"
        )
    calls = [kwargs if kwargs else args for args, kwargs in examples]
    return cgcompile.precompile(family.model, calls, path, options)


def _largest_keys(call: Any, device: torch.device) -> dict[str, Any]:
    """Graph memory of the largest size's keys alone (mixed and decode, captured lazily on their
    own calls): what `capture_all`'s memory is compared with."""
    cuda = device.type == "cuda"
    reserved = torch.cuda.memory_reserved() if cuda else 0
    for decode in (False, True):
        for _ in range(3):  # warm-up, capture, replay
            call(LARGEST, decode)
    sync(device)
    result = {"graph_memory_mib": _graph_memory_mib()}
    if cuda:
        result["reserved_growth_mib"] = (torch.cuda.memory_reserved() - reserved) / 2**20
    return result


def _profiled_capture(device: torch.device) -> dict[str, Any]:
    """`capture_all()` of every other key under cProfile: where its time per graph goes."""
    profiler = cProfile.Profile()
    profiler.enable()
    captured, seconds = timed_call(lambda: cgcompile.capture_all(progress=False), device)
    profiler.disable()
    text, callers = io.StringIO(), io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    pstats.Stats(profiler, stream=callers).sort_stats("tottime").print_callers(3)
    lines = [line for line in text.getvalue().splitlines() if line.strip()][-32:]
    lines += [line for line in callers.getvalue().splitlines() if line.strip()][-30:]
    return {"profiled_capture": {"graphs": captured, "seconds": seconds, "top": lines}}


def _step_ms(call: Any, n: int, device: torch.device) -> float:
    """Median ms of a decode step of n tokens after warm-up (CUDA events on a GPU)."""
    for _ in range(3):
        call(n, True)
    times = []
    for _ in range(20):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call(n, True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            times.append(timed_call(lambda: call(n, True), device)[1] * 1e3)
    return statistics.median(times)


def _soak(
    call: Any, calls: int, device: torch.device, sizes: tuple[int, ...] | None
) -> dict[str, Any]:
    """`calls` calls of random sizes (1-512, or `sizes`) and kinds: graphs captured and memory
    grown."""
    rng = random.Random(0)
    before = cgcompile.counters.num_cudagraph_captured
    cuda = device.type == "cuda"
    reserved = torch.cuda.memory_reserved() if cuda else 0
    graph_memory = _graph_memory_mib()
    for _ in range(calls):
        call(rng.choice(sizes) if sizes else rng.randint(1, 512), rng.random() < 0.5)
    sync(device)
    grown = (torch.cuda.memory_reserved() - reserved) / 2**20 if cuda else 0.0
    captured = cgcompile.counters.num_cudagraph_captured - before
    return {
        "soak_calls": calls,
        "soak_graphs_captured": captured,
        "soak_graph_memory_grown_mib": _graph_memory_mib() - graph_memory,
        "soak_memory_grown_mib": grown,
    }


def _compile_phases(least_s: float = 0.2) -> list[str]:
    """torch's own seconds per compile phase (Dynamo, AOT, Inductor's lowering, codegen,
    kernel builds) of this process, those of `least_s` or more. (The 'csv' form: the 'str'
    form is a tabulate table where tabulate is installed, a comma list where not.)"""
    names, values = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    rows = zip(names, (float(v) for v in values), strict=True)
    return [f"{name} {s:.2f}" for name, s in rows if s >= least_s]


def _graph_memory_mib() -> float:
    return sum(g.report.graph_memory_bytes for g in cgcompile.compiled_graphs()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--quick", action="store_true", help="tiny model on CPU")
    parser.add_argument("--quick-layers", type=int, default=2, help="the --quick model's layers")
    parser.add_argument("--soak", type=int, default=2000)
    parser.add_argument(
        "--phases", nargs="+", choices=PHASES + AOT_PHASES, default=list(PHASES + AOT_PHASES)
    )
    parser.add_argument(
        "--no-cudnn-sdp", action="store_true", help="torch.backends.cuda.enable_cudnn_sdp(False)"
    )
    parser.add_argument("--options", default="{}", help="extra cgcompile options, as JSON")
    parser.add_argument("--family", choices=NAMES, default="llama", help="the model family")
    parser.add_argument(
        "--unbacked", action="store_true", help="mark the batch unbacked (one Dynamo trace)"
    )
    parser.add_argument(
        "--marked",
        action="store_true",
        help="Hugging Face families: mark the batch, the static cache's tensors with it",
    )
    parser.add_argument(
        "--profile-first",
        metavar="DIR",
        help="cProfile each phase's precompile (or load), first call and capture_all into DIR",
    )
    parser.add_argument(
        "--no-prime", action="store_true", help="no throwaway process to fill Python's .pyc cache"
    )
    parser.add_argument(
        "--turns",
        metavar="NAME=VALUE",
        help="instead of --phases: the cold phase in turns with and without this environment "
        "variable, fresh caches each time, --rounds times (an A/B of a setting)",
    )
    parser.add_argument(
        "--turns-phase", choices=("cold", "aot-warm-local"), default="cold", help="of --turns"
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds of --turns")
    parser.add_argument("--phase", choices=PHASES + AOT_PHASES, help=argparse.SUPPRESS)
    parser.add_argument("--load", help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    parser.add_argument("--precompile", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(phase(args)))
        return
    work = Path(tempfile.mkdtemp(prefix="cgcompile-cold-warm-"))
    saved = work / "bench.cgcache"
    caches = {"cold": work / "a", "warm-local": work / "a", "warm-file": work / "b"}
    caches["largest"] = work / "a"
    caches.update(dict(zip(AOT_PHASES, (work / "c", work / "c", work / "d"), strict=True)))
    if not args.no_prime:
        # Python's own bytecode cache, filled by a throwaway cold process: a torch installed by
        # pip ships .pyc files, and without them each fresh process compiles the sources of the
        # modules a compile imports (1.6 s of `compile()` in a first call on the H200's image)
        # (a prefix already set is used and filled: later runs with --no-prime read it)
        pycache = Path(os.environ.setdefault("PYTHONPYCACHEPREFIX", str(work / "pycache")))
        unset = os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # set in the H200's image
        primed = _run(args, "cold", work / "prime", [])
        pycs = sum(1 for _ in pycache.rglob("*.pyc"))
        print(
            f"primed Python's bytecode cache in {primed['process_s']:.1f}s: {pycs} .pyc files"
            f"{' (PYTHONDONTWRITEBYTECODE unset for the phases)' if unset else ''}",
            flush=True,
        )
    rows = _turns(args, work) if args.turns else []
    for name in [] if args.turns else args.phases:
        extra = {"cold": ["--save", str(saved)], "warm-file": ["--load", str(saved)]}
        if name.startswith("aot-"):
            extra[name] = ["--precompile", str(work / "bench.cgaot")]
        rows.append(_run(args, name, caches[name], extra.get(name, [])))
        print(_line(rows[-1]), flush=True)
    by_phase = {row["phase"]: row for row in rows}
    cold, largest = by_phase.get("cold", {}), by_phase.get("largest", {})
    if cold.get("graph_memory_mib") and largest.get("graph_memory_mib"):
        ratio = cold["graph_memory_mib"] / largest["graph_memory_mib"]
        print(f"capture_all's graph memory / the largest keys' alone = {ratio:.2f}", flush=True)
    meta = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if not args.quick else "cpu",
        "torch": torch.__version__,
        "commit": os.environ.get("CGCOMPILE_COMMIT", "unknown"),
        "what": "seconds from a fresh process to every capture size captured, cold and warm",
        "cudnn_sdp": not args.no_cudnn_sdp,
        "options": json.loads(args.options),
        "python_bytecode_primed": not args.no_prime,
        "python_bytecode_prefix": os.environ.get("PYTHONPYCACHEPREFIX"),
        "marked": args.marked,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "cold-warm-no-cudnn-sdp.json" if args.no_cudnn_sdp else "cold-warm.json"
    name = "cold-warm-turns.json" if args.turns else name
    (args.out / name).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def _turns(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """`args.turns_phase` with and without `args.turns` (NAME=VALUE) in its environment, in
    turns, `args.rounds` times: the cold phase on fresh caches each time, or the precompiled
    warm phase on the caches and file of one precompiled cold process run first."""
    name, _, value = args.turns.partition("=")
    rows, extra = [], []
    if args.turns_phase == "aot-warm-local":
        extra = ["--precompile", str(work / "bench.cgaot")]
        rows.append(_run(args, "aot-cold", work / "c", extra))
        print(_line(rows[-1]), flush=True)
    for turn in range(args.rounds * 2):
        env = {name: value} if turn % 2 == 0 else {}
        cache = work / "c" if extra else work / f"turn-{turn}"
        row = _run(args, args.turns_phase, cache, extra, env)
        row["env"] = args.turns if env else f"{name} unset"
        print(f"[{row['env']}] " + _line(row), flush=True)
        rows.append(row)
    return rows


def _run(
    args: argparse.Namespace,
    name: str,
    cache: Path,
    extra: list[str],
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One phase in a fresh process whose Inductor and Triton caches live under `cache`."""
    env = {**os.environ, **(extra_env or {}), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    env["TRITON_CACHE_DIR"] = str(cache / "triton")
    cmd = [sys.executable, __file__, "--phase", name, "--soak", str(args.soak), *extra]
    cmd += ["--quick", "--quick-layers", str(args.quick_layers)] if args.quick else []
    cmd += ["--no-cudnn-sdp"] if args.no_cudnn_sdp else []
    cmd += ["--unbacked"] if args.unbacked else []
    cmd += ["--marked"] if args.marked else []
    cmd += ["--options", args.options, "--family", args.family]
    if args.profile_first:
        Path(args.profile_first).mkdir(parents=True, exist_ok=True)
        cmd += ["--profile-first", str(Path(args.profile_first).resolve())]
    began = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        return {"phase": name, "error": _error_text(proc.stderr), "process_s": wall}
    return {**json.loads(lines[-1]), "process_s": wall}


def _error_text(stderr: str) -> str:
    """A failed phase's stderr, short: the lines that name an exception (the head of a long
    Dynamo error is where it says what failed), then its last 1500 characters."""
    named = [
        line[:400]
        for line in stderr.splitlines()
        if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Failed|Unsupported)\b", line)
    ]
    return "\n".join([*named[:10], "...", stderr[-1500:]]) if named else stderr[-1500:]


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['phase']:10} ERROR {row['error'][-400:]}"
    if row["phase"] == "largest":
        prof = row["profiled_capture"]
        return (
            f"largest    keys of {LARGEST} tokens alone: {row['graph_memory_mib']:.0f} MiB; then "
            f"capture_all of the rest under cProfile: {prof['graphs']} graphs in "
            f"{prof['seconds']:.1f}s\n    " + "\n    ".join(prof["top"])
        )
    ready = row["first_call_8_s"] + row["first_call_1_s"] + row["capture_all_s"]
    ready += row.get("first_calls_other_sizes_s", 0.0) + row.get("load_s", 0.0)
    ready += row.get("precompile_s", 0.0)
    if "precompile_s" in row:
        how = "loaded" if row["precompile_loaded"] else "compiled and saved"
        if row.get("load_steps"):
            how += ": " + ", ".join(f"{k} {v:.2f}" for k, v in row["load_steps"].items())
        first = f"precompile {row['precompile_s']:.1f}s ({how})"
        row = {**row, "reports": [first, *row["reports"]]}
    steps = " ".join(f"{n}:{ms:.3f}" for n, ms in row["step_ms"].items())
    profiled = " (first call profiled)" * row.get("first_call_8_profiled", False)
    others = row.get("first_calls_other_sizes_s")
    others = f"first of other sizes {others:.1f}, " if others else ""
    return (
        f"{row['phase']:10} ready {ready:6.1f}s{profiled} (load {row.get('load_s', 0):.1f}, "
        f"first 8 {row['first_call_8_s']:.1f}, first 1 {row['first_call_1_s']:.1f}, "
        f"{others}capture_all "
        f"{row['capture_all_s']:.1f} for {row['graphs_captured']} graphs), graph memory "
        f"{row['graph_memory_mib']:.0f} MiB, step ms {steps}, soak {row['soak_calls']} calls: "
        f"{row['soak_graphs_captured']} graphs, graph memory "
        f"+{row['soak_graph_memory_grown_mib']:.0f} MiB, reserved "
        f"+{row['soak_memory_grown_mib']:.0f} MiB; "
        f"Dynamo traces {row['dynamo_traces']}; process {row['process_s']:.1f}s\n    "
        + "".join(
            f"graph break x{n}: {why}\n    " for why, n in row.get("graph_breaks", {}).items()
        )
        + "\n    ".join(row["reports"])
        + "\n    torch's compile phases (s): "
        + ", ".join(row["compile_phases"])
    )


if __name__ == "__main__":
    main()
