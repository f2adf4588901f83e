"""Host time per call of a decode step, with the GPU idle before each call: what a caller pays to
issue one step when it waits for each result (a decode loop reading its token).

One process per peer (in one process Dynamo would walk every peer's cache entries of the same
`forward`): the example Llama (hidden 1024, 16 or 64 layers, bf16, KV cache written in place),
batch 1, capture sizes [1, 8] (`--sizes`; batch 1 pads to the smallest above 1), graphs of
eager-compiled pieces (host time does not depend on the kernels inside a graph, but their launch
does: a padded graph may take other kernels). Per peer, the median over `--calls` calls of
perf_counter around one call, `torch.cuda.synchronize()` before each, timed in turns with a hand
graph of the same model in the same process (copy + replay, no Dynamo): processes of one run
differ in host speed by up to 5x as a whole (bare replay 5.3-32.6 us on 2026-12-02), so peers of
different processes compare by their ratio to it (`vs_hand`). Each peer runs in `--rounds`
processes, the peers taking turns in alternating order; the round with the least ratio is
reported, every round kept. Beside each wall-clock median, the thread's CPU time per call
(`host_cpu_us`, `hand_cpu_us`): a slow process whose CPU clock agrees runs slow code; one whose
CPU clock is lower waits (preempted, or sleeping in a driver call). `--cpu K` pins the timing to
core K (on the H200 machine pinned processes read 3-5x slower: left off by default). Peers
(`_user_peers`): the hand graph's bare `replay()` (`--peers hand`: its copy + replay), the
10-line backend with and without guards, reduce-overhead, cgcompile FULL, FULL_AND_PIECEWISE and
PIECEWISE, FULL/PIECEWISE under `cgcompile.trusted`, and `cg/FULL/own` (batch 1 compiled on its
own, not padded to 2 rows). For cgcompile peers also: the backend alone (the compiled graph
called with the arguments Dynamo passes), the bare replay of its graph, its fused input copy
alone and an empty Python function called with the same arguments, so cgcompile's own time
(`own_us`) is what is left; for PIECEWISE the replays of its pieces and its eager attention
calls, so cgcompile's own time per piece is what is left.

With `--jobs J` J peer processes run at once: they compile side by side and time one at a time
(`_turns`, with CGBENCH_TURNS set). With `--together` every peer of a depth runs in one process
(each on its own model copy and `forward` code, so Dynamo walks only its own cache entries),
timed in turns with the others: peers then compare directly (`vs_tenline`), without the
process-to-process spread of host speed.

    python benchmarks/host_per_call.py --out DIR [--layers 16 64] [--peers cg/FULL tenline]
    python benchmarks/host_per_call.py --out DIR --together --peers tenline cg/FULL cg/FULL/own
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._timing import take_arguments  # noqa: E402
from benchmarks._turns import preparing, timing_turn  # noqa: E402
from benchmarks._user_peers import make_peer  # noqa: E402
from examples.llama import Llama, LlamaConfig, make_inputs  # noqa: E402

PEERS = [
    "replay",
    "tenline",
    "tenline/skip-guards",
    "reduce-overhead",
    "cg/FULL",
    "cg/FULL/trusted",
    "cg/FULL_AND_PIECEWISE",
    "cg/PIECEWISE",
    "cg/PIECEWISE/trusted",
]
DEEP_PEERS = ["tenline", "cg/FULL", "cg/FULL/trusted"]  # for the 64-layer model


def host_us(call: Callable[[], Any], calls: int) -> float:
    """Median host microseconds of `call`, the GPU idle before each."""
    return statistics.median(samples(call, calls)[0]) * 1e6


def samples(call: Callable[[], Any], calls: int) -> tuple[list[float], list[float]]:
    """Seconds per call on the wall clock and on this thread's CPU clock (which leaves out time
    off the CPU: preempted, or sleeping in a driver call)."""
    times, cpu = [], []
    for _ in range(calls):
        torch.cuda.synchronize()
        thread = time.thread_time()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - thread)
    torch.cuda.synchronize()
    return times, cpu


def _in_turns(calls: int, *steps: Callable[[], Any]) -> list[tuple[float, float]]:
    """Median host us of each step, wall and thread CPU, timed in four alternating blocks
    (drift hits all alike)."""
    times: list[tuple[list[float], list[float]]] = [([], []) for _ in steps]
    for _ in range(4):
        for step, (wall, cpu) in zip(steps, times, strict=True):
            more_wall, more_cpu = samples(step, max(1, calls // 4))
            wall += more_wall
            cpu += more_cpu
    return [(statistics.median(w) * 1e6, statistics.median(c) * 1e6) for w, c in times]


def _model(layers: int) -> Llama:
    cfg = LlamaConfig(num_layers=layers, hidden=1024, heads=16, ffn=2816, vocab=32000)
    return Llama(cfg).to("cuda", torch.bfloat16).eval()


def measure(name: str, layers: int, calls: int, cpu: int, sizes: list[int]) -> dict[str, Any]:
    """One peer in this process: prepared at any time, timed in its turn on core `cpu`."""
    preparing()
    model = _model(layers)
    peer = make_peer("hand" if name == "replay" else name, model, sizes=sizes, compiler="eager")
    yardstick = make_peer("hand", model, sizes=sizes, compiler="eager")  # no Dynamo in it
    tokens, positions = make_inputs(model.cfg, 1, "cuda")
    with torch.no_grad():
        for _ in range(10):
            peer.step(tokens, positions)
            yardstick.step(tokens, positions)
        torch.cuda.synchronize()
        with timing_turn():
            if cpu >= 0:
                os.sched_setaffinity(0, {cpu})
            return _timed(name, layers, calls, model, peer, yardstick, tokens, positions)


def measure_together(
    names: list[str], layers: int, calls: int, sizes: list[int]
) -> list[dict[str, Any]]:
    """Every peer in this process, timed in turns with each other and the hand graph."""
    preparing()
    model = _model(layers)
    peers = [
        make_peer("hand" if name == "replay" else name, model, sizes=sizes, compiler="eager")
        for name in names
    ]
    yardstick = make_peer("hand", model, sizes=sizes, compiler="eager")
    tokens, positions = make_inputs(model.cfg, 1, "cuda")
    with torch.no_grad():
        for _ in range(10):
            for peer in [*peers, yardstick]:
                peer.step(tokens, positions)
        torch.cuda.synchronize()
        steps = [
            peer.replay if name == "replay" else (lambda p=peer: p.step(tokens, positions))
            for name, peer in zip(names, peers, strict=True)
        ]
        with timing_turn():
            timed = _in_turns(calls, *steps, lambda: yardstick.step(tokens, positions))
            (hand, hand_cpu), rows = timed[-1], []
            for name, (us, cpu_us) in zip(names, timed[:-1], strict=True):
                row = {"peer": name, "layers": layers, "host_us": us, "hand_us": hand}
                row.update(vs_hand=us / hand, host_cpu_us=cpu_us, hand_cpu_us=hand_cpu)
                rows.append(row)
            for name, peer, row in zip(names, peers, rows, strict=True):
                if name.startswith("cg/"):  # a failed breakdown keeps the timings
                    try:
                        row.update(_breakdown(peer, model, tokens, positions, calls, alone=False))
                    except Exception as e:  # noqa: BLE001
                        row["breakdown_error"] = repr(e)[-300:]
    ten = next((r for r in rows if r["peer"] == "tenline"), None)
    for row in rows:
        if ten is not None:
            row["vs_tenline"] = row["host_us"] / ten["host_us"]
    return rows


def _timed(
    name: str, layers: int, calls: int, model: Llama, peer: Any, yardstick: Any, *inputs: Any
) -> dict:
    """The peer's host us per call, and beside it, in turns, the same process's hand graph
    (copy + replay): processes of one run differ in speed by up to 5x, so peers in different
    processes compare by their ratio to it (`vs_hand`)."""
    tokens, positions = inputs
    with torch.no_grad():
        result: dict[str, Any] = {"peer": name, "layers": layers}
        step = peer.replay if name == "replay" else lambda: peer.step(tokens, positions)
        (us, cpu_us), (hand, hand_cpu) = _in_turns(
            calls, step, lambda: yardstick.step(tokens, positions)
        )
        result.update(host_us=us, hand_us=hand, vs_hand=us / hand)
        result.update(host_cpu_us=cpu_us, hand_cpu_us=hand_cpu)
        if name.startswith("cg/"):
            result.update(_breakdown(peer, model, tokens, positions, calls))
    return result


def _breakdown(
    peer: Any, model: Llama, tokens: Any, positions: Any, calls: int, alone: bool = True
) -> dict:
    """The backend alone, its graph's bare replay, and for PIECEWISE its pieces."""
    import cgcompile
    from cgcompile.calls.compiled_graph import CompiledGraph

    seen: list[tuple[Any, ...]] = []
    graphs: list[CompiledGraph] = []
    original = CompiledGraph.__call__

    def record(self: CompiledGraph, *args: Any) -> Any:
        seen.append(args)
        graphs.append(self)
        return original(self, *args)

    CompiledGraph.__call__ = record  # type: ignore[method-assign]
    try:
        peer.step(tokens, positions)
    finally:
        CompiledGraph.__call__ = original  # type: ignore[method-assign]
    # the graph this peer's call entered; a call that bound it before (trusted) is not seen:
    # then the newest graph that replays, which is the peer's only when it is alone
    if not graphs and not alone:
        return {}
    graph = graphs[-1] if graphs else [g for g in cgcompile.compiled_graphs() if g._ready][-1]
    out: dict[str, Any] = {}
    hinted = peer.name.startswith("cg/FULL_AND_PIECEWISE")  # as the peer's step calls it
    if seen:
        args = seen[-1]

        def backend() -> Any:
            if not hinted:
                return graph(*args)
            with cgcompile.batch_hint(uniform_decode=True):
                return graph(*args)

        out["backend_us"] = host_us(backend, calls)
    ready = [call for call in graph._ready.values() if call.n == tokens.shape[0]]
    if ready and ready[0].graph is not None and seen:
        call, args = ready[0], seen[-1]
        out["bare_replay_us"] = host_us(call.graph.replay, calls)
        out["copy_us"] = host_us(lambda: _copy(call, args), calls)
        out["args_us"] = host_us(lambda: take_arguments(*args), calls)
        if "backend_us" in out:  # what is left is cgcompile's own
            parts = out["bare_replay_us"] + out["copy_us"] + out["args_us"]
            out["own_us"] = out["backend_us"] - parts
    pieces = [w for w in graph.wrappers if w.runtime_mode == cgcompile.CUDAGraphMode.PIECEWISE]
    if ready and ready[0].graph is None:
        entries = [next(iter(w.entries.values())) for w in pieces if w.entries]
        out["pieces"] = len(entries)
        out["piece_replays_us"] = sum(host_us(e.graph.replay, calls // 4) for e in entries)
        layer = model.layers[0]
        q = layer.pre_attention(model.embed(tokens), positions)[1]
        out["attention_calls"] = len(model.layers)
        out["attention_us"] = host_us(lambda: layer.attention(q), calls) * len(model.layers)
        if "backend_us" in out:
            rest = out["backend_us"] - out["piece_replays_us"] - out["attention_us"]
            out["own_us_per_piece"] = rest / len(entries)
    return out


def _copy(call: Any, args: tuple[Any, ...]) -> None:
    """The ready call's fused copy of the caller's tensors, alone."""
    torch._foreach_copy_(call.targets, [args[i] for i in call.sources])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--layers", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--peers", nargs="+", default=None)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="processes per peer, in turns")
    parser.add_argument("--cpu", type=int, default=-1, help="pin each peer's timing to a core")
    parser.add_argument(
        "--jobs", type=int, default=1, help="peer processes at once (timed in turns: _turns)"
    )
    parser.add_argument("--together", action="store_true", help="all peers in one process")
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[1, 8],
        help="capture sizes (batch 1 pads to the smallest above 1)",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--all", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.layers[0], args.calls, args.cpu, args.sizes)))
        return
    if args.all:
        print(json.dumps(measure_together(args.all, args.layers[0], args.calls, args.sizes)))
        return
    if args.together:
        _together(args)
        return
    tasks = []  # a fresh process per peer and round, the order alternating by round
    for layers in args.layers:
        names = args.peers or (PEERS if layers <= 16 else DEEP_PEERS)
        for r in range(args.rounds):
            tasks += [(layers, name, r) for name in (names if r % 2 == 0 else names[::-1])]

    def one(task: tuple[int, str, int]) -> dict[str, Any]:
        layers, name, r = task
        row = _one(name, layers, args.calls, args.cpu, args.sizes)
        print(f"  round {r}: {_line(row)}", flush=True)
        return row

    with ThreadPoolExecutor(args.jobs) as pool:  # jobs > 1: prepared at once, timed in turns
        done = list(pool.map(one, tasks))
    rows = []
    for layers in args.layers:
        for name in args.peers or (PEERS if layers <= 16 else DEEP_PEERS):
            runs = [row for t, row in zip(tasks, done, strict=True) if t[:2] == (layers, name)]
            rows.append(_least(runs))
            print(_line(rows[-1]), flush=True)
    _write(args.out, rows, args.cpu)


def _one(name: str, layers: int, calls: int, cpu: int, sizes: list[int]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", name, "--layers", str(layers), "--calls", str(calls)]
    cmd += ["--cpu", str(cpu), "--sizes", *map(str, sizes)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    lines = run.stdout.strip().splitlines()
    if run.returncode or not lines:
        return {"peer": name, "layers": layers, "error": run.stderr[-800:]}
    return json.loads(lines[-1])


def _together(args: argparse.Namespace) -> None:
    """One process per depth and round, every peer in it; the round whose hand graph ran
    fastest is reported, every round's ratios kept."""
    rows = []
    for layers in args.layers:
        names = args.peers or (PEERS if layers <= 16 else DEEP_PEERS)
        runs = []
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            cmd = [sys.executable, __file__, "--all", *order, "--layers", str(layers)]
            cmd += ["--sizes", *map(str, args.sizes)]
            run = subprocess.run(cmd + ["--calls", str(args.calls)], capture_output=True, text=True)
            lines = run.stdout.strip().splitlines()
            if run.returncode or not lines:
                rows.append({"peer": "together", "layers": layers, "error": run.stderr[-800:]})
                print(_line(rows[-1]), flush=True)
                continue
            runs.append(json.loads(lines[-1]))
            for row in runs[-1]:
                print(f"  round {r}: {_line(row)}", flush=True)
        if runs:
            best = min(runs, key=lambda rs: rs[0]["hand_us"])
            for row in best:
                same = [r for rs in runs for r in rs if r["peer"] == row["peer"]]
                row["host_us_rounds"] = [r["host_us"] for r in same]
                row["vs_tenline_rounds"] = [r.get("vs_tenline") for r in same]
                rows.append(row)
                print(_line(row), flush=True)
    _write(args.out, rows, args.cpu)


def _least(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the least host time against its own hand graph (a process can run slow
    as a whole), with every round's figures in `host_us_rounds` and `vs_hand_rounds`."""
    good = [r for r in runs if "host_us" in r]
    if not good:
        return runs[-1]
    least = min(good, key=lambda r: r["vs_hand"])
    rounds = {"host_us_rounds": [r["host_us"] for r in good]}
    return {**least, **rounds, "vs_hand_rounds": [r["vs_hand"] for r in good]}


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['layers']:3d} layers {row['peer']:24} ERROR {row['error'][-300:]}"
    extra = " ".join(f"{k}={v:.1f}" for k, v in row.items() if k.endswith("_us") and k != "host_us")
    extra += f" vs_hand={row['vs_hand']:.2f}"
    if "vs_tenline" in row:
        extra += f" vs_tenline={row['vs_tenline']:.3f}"
    extra += " rounds="
    extra += "/".join(f"{v:.0f}" for v in row.get("host_us_rounds", []))
    pieces = f" pieces={row['pieces']}" if "pieces" in row else ""
    return f"{row['layers']:3d} layers {row['peer']:24} {row['host_us']:8.1f} us  {extra}{pieces}"


def _write(out: Path, rows: list[dict[str, Any]], cpu: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": os.environ.get("CGCOMPILE_COMMIT", "unknown"),
        "what": "host us per call, GPU idle before each call, median; batch 1, bf16",
        "cpu_core": cpu,
    }
    (out / "host-per-call.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    by = {(r["layers"], r["peer"]): r for r in rows if "host_us" in r}
    for layers in sorted({r["layers"] for r in rows}):
        ten = by.get((layers, "tenline"))
        for name in ("cg/FULL", "cg/FULL/own", "cg/FULL/trusted", "cg/FULL_AND_PIECEWISE"):
            full = by.get((layers, name))
            if ten and full and "vs_tenline" in full:
                print(f"{layers} layers: {name} / tenline = {full['vs_tenline']:.3f} (one process)")
            elif ten and full:
                ratio = full["vs_hand"] / ten["vs_hand"]
                print(f"{layers} layers: {name} / tenline = {ratio:.3f} (each vs its hand graph)")


if __name__ == "__main__":
    main()
