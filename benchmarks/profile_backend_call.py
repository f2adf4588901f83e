"""Why a replayed FULL call costs more host time than a hand-captured graph: the backend's call
against a hand graph of the same model, at two depths, one process per depth.

The example Llama (hidden 1024, bf16, KV cache written in place), FULL, eager pieces, batch 1,
the GPU idle before each call. In four alternating blocks (the host's speed drifts), median
host us of: cgcompile's compiled graph called with the arguments Dynamo passes (no Dynamo);
its captured graph's bare replay; the hand graph's copy + replay and its bare replay; and the
hand graph's function recorded by cgcompile's CUDA runtime (its side stream, shared pool,
thread-local capture mode), replayed bare: if that one is slow, the capture settings are the
cause, else the graph's content. Each with its spread and the thread's CPU time per call (a
process whose every call reads slow on both clocks runs slow code; on the wall clock alone, it
waits). Then the kernels one replay of each graph launches (torch.profiler: count, and the names
the two graphs differ in), its GPU time (CUDA events) and a cProfile of cgcompile's call.
`--batch-one own`: batch 1 compiled on its own instead of replaying the dynamic graph padded to
2 rows (on 2026-12-03 that graph launched like the hand graph; the padded one took SDPA's cuDNN
kernel and ~1.2 us more launch per layer).

    python benchmarks/profile_backend_call.py [--layers 16 64] [--batch-one own]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.host_per_call import samples  # noqa: E402
from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch  # noqa: E402


def one(layers: int, batch_one: str) -> None:
    from cgcompile.calls.compiled_graph import CompiledGraph

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a smoke test
    cfg = LlamaConfig(num_layers=layers, hidden=1024, heads=16, ffn=2816, vocab=32000)
    if device == "cpu":
        cfg = LlamaConfig(num_layers=layers, hidden=64, heads=4, ffn=128, vocab=256, cache_len=64)
    model = Llama(cfg).to(device, torch.bfloat16).eval()
    options = {
        "cudagraph_mode": "FULL",
        "compiler": "eager",
        "cudagraph_capture_sizes": [1, 8],
        "batch_one": batch_one,
    }
    if device == "cpu":
        options["graph_runtime"] = "simulated"
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    seen: list[tuple[Any, tuple[Any, ...]]] = []
    original = CompiledGraph.__call__

    def record(self: CompiledGraph, *args: Any) -> Any:
        seen.append((self, args))
        return original(self, *args)

    with torch.no_grad():
        for n in (8, 1):
            tokens, positions = make_inputs(cfg, n, device)
            mark_batch(cfg, tokens, positions)
            for _ in range(5):
                compiled(tokens, positions)
        CompiledGraph.__call__ = record  # type: ignore[method-assign]
        compiled(tokens, positions)
        CompiledGraph.__call__ = original  # type: ignore[method-assign]
        graph, args = seen[-1]
        call = lambda: graph(*args)  # noqa: E731
        print(f"== {layers} layers, batch_one={batch_one}: {len(args)} args")
        if device == "cuda":
            _against_hand(model, graph, call, args, tokens, positions, layers)
        checks = graph.instances.full_checks
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(500):
            _sync(device)
            call()
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
    print(f"  full instance checks in 500 calls: {graph.instances.full_checks - checks}")
    print(text.getvalue()[-3000:])


def _against_hand(
    model: Llama,
    graph: Any,
    call: Callable[[], Any],
    args: tuple[Any, ...],
    tokens: Any,
    positions: Any,
    layers: int,
) -> None:
    from benchmarks._user_peers import make_peer
    from cgcompile.graphs.cuda import CUDAGraphRuntime

    hand = make_peer("hand", model, sizes=[1], compiler="eager")
    hand.step(tokens, positions)
    _, static, _ = next(iter(hand.compiled.graphs.values()))
    recorded, _ = CUDAGraphRuntime().capture(
        lambda: hand.compiled.fn(*static), (), weak_output=False
    )
    recorded.replay()
    n = tokens.shape[0]
    (ready,) = [r for r in graph._ready.values() if r.graph is not None and r.n == n]
    others = [r for r in graph._ready.values() if r.graph is not None and r is not ready]
    targets, sources = ready.targets, [args[i] for i in ready.sources]
    peers = {
        "cgcompile call": call,
        "cgcompile graph replay": ready.graph.replay,
        "cgcompile input copy alone": lambda: torch._foreach_copy_(targets, sources),
        "hand copy + replay": lambda: hand.step(tokens, positions),
        "hand graph replay": hand.replay,
        "hand function, cgcompile's capture, replay": recorded.replay,
    }
    for other in others:
        peers[f"cgcompile graph of {other.n} rows (padded {other.padded}) replay"] = (
            other.graph.replay
        )
    times: dict[str, list[float]] = {name: [] for name in peers}
    cpu: dict[str, list[float]] = {name: [] for name in peers}
    for _ in range(4):
        for name, fn in peers.items():
            wall, thread = samples(fn, 100)  # seconds
            times[name] += [t * 1e6 for t in wall]
            cpu[name] += [t * 1e6 for t in thread]
    graphs = {
        "cgcompile graph replay": ready.graph.replay,
        "hand graph replay": hand.replay,
        "hand function, cgcompile's capture, replay": recorded.replay,
    }
    kernels = {name: _kernels(fn) for name, fn in graphs.items()}
    for name, values in times.items():
        q = statistics.quantiles(values, n=10)
        extra = ""
        if name in graphs:
            extra = f", {sum(kernels[name].values())} kernels, GPU {_gpu_us(graphs[name]):.0f} us"
        print(
            f"  {layers} layers, {name}: {statistics.median(values):.1f} us "
            f"(p10 {q[0]:.1f}, p90 {q[-1]:.1f}, mean {statistics.fmean(values):.1f}; "
            f"thread CPU {statistics.median(cpu[name]):.1f}){extra}"
        )
    ours, theirs = kernels["cgcompile graph replay"], kernels["hand graph replay"]
    diff = (ours - theirs) + (theirs - ours)
    print(f"  kernels launched by one graph and not the other: {sum(diff.values())}")
    for name in sorted(diff, key=lambda k: -diff[k])[:8]:
        print(f"    {ours[name]:4d} cgcompile / {theirs[name]:4d} hand: {name[:110]}")


def _gpu_us(replay: Callable[[], Any]) -> float:
    """Median GPU time of one replay (CUDA events)."""
    values = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        values.append(start.elapsed_time(end) * 1e3)
    return statistics.median(values)


def _kernels(replay: Callable[[], Any]) -> Counter[str]:
    """CUDA kernels (and memcpy/memset) one replay launches, by name (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return Counter(e.name for e in prof.events() if e.device_type == cuda)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--batch-one", default="padded", choices=["padded", "own"])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(args.one, args.batch_one)
        return
    for layers in args.layers:  # one process per depth
        cmd = [sys.executable, __file__, "--one", str(layers), "--batch-one", args.batch_one]
        subprocess.run(cmd, check=False)


if __name__ == "__main__":
    main()
