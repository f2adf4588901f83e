"""Where the backend's own host time per call goes at two depths: cProfile of a compiled
graph called with the arguments Dynamo passes (no Dynamo), batch 1, the GPU idle before each
call. The example Llama (hidden 1024, bf16, KV cache written in place), FULL, eager pieces, one
process per depth. Prints the median host us of the call and its costliest functions.

    python benchmarks/profile_backend_call.py [--layers 16 64] [--mode FULL]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch  # noqa: E402


def one(layers: int, mode: str) -> None:
    from cgcompile.runtime.compiled_graph import CompiledGraph

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a smoke test
    cfg = LlamaConfig(num_layers=layers, hidden=1024, heads=16, ffn=2816, vocab=32000)
    if device == "cpu":
        cfg = LlamaConfig(num_layers=layers, hidden=64, heads=4, ffn=128, vocab=256, cache_len=64)
    model = Llama(cfg).to(device, torch.bfloat16).eval()
    options = {"cudagraph_mode": mode, "compiler": "eager", "cudagraph_capture_sizes": [1, 8]}
    if device == "cpu":
        options["graph_runtime"] = "simulated"
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    seen: list[tuple[Any, ...]] = []
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
        us = _median_us(call, device, 300)
        if device == "cuda":  # cgcompile's graph against a hand-captured one, in turns
            from benchmarks._user_peers import make_peer

            hand = make_peer("hand", model, sizes=[1], compiler="eager")
            hand.step(tokens, positions)
            (ready,) = [r for r in graph._ready.values() if r.graph is not None and r.n == 1]
            rows: dict[str, list[float]] = {}
            for _ in range(4):
                for name, fn in (
                    ("cgcompile call", call),
                    ("cgcompile graph replay", ready.graph.replay),
                    ("hand copy + replay", lambda: hand.step(tokens, positions)),
                    ("hand graph replay", hand.replay),
                ):
                    rows.setdefault(name, []).append(_median_us(fn, device, 100))
            for name, values in rows.items():
                print(f"  {layers} layers, {name}: {statistics.median(values):.1f} us")
        slots = graph.instances
        checks = slots.full_checks
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(500):
            if device == "cuda":
                torch.cuda.synchronize()
            call()
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(14)
    print(
        f"== {layers} layers {mode}: {len(args)} args, backend call {us:.1f} us median, "
        f"full instance checks in 500 calls: {slots.full_checks - checks}"
    )
    print(text.getvalue()[-3500:])


def _median_us(call: Any, device: str, calls: int) -> float:
    times = []
    for _ in range(calls):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--mode", default="FULL")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(args.one, args.mode)
        return
    for layers in args.layers:  # one process per depth
        cmd = [sys.executable, __file__, "--one", str(layers), "--mode", args.mode]
        subprocess.run(cmd, check=False)


if __name__ == "__main__":
    main()
