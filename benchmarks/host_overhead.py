"""Host (Python) cost of one cgcompile forward, graphs replaced by a no-op runtime; runs on CPU.

Compiles a 16-layer Llama with tiny dims (compiler eager) whose graph runtime records nothing and
replays nothing, so a forward costs only the host work around the graphs: Dynamo's guard check,
dispatch, input copies, the piece wrappers, the stitching graph and the eager attention. A hand
loop of 17 no-op replays, 16 attention calls and 16 copies is the floor to compare with. Prints
microseconds per forward and a cProfile of the forward by own time (Dynamo's guard check runs
in C when the model's frame starts, so cProfile books it to `Module._call_impl`).

    python benchmarks/host_overhead.py [PIECEWISE|FULL|FULL_AND_PIECEWISE] [tottime|cumulative]
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cgcompile  # noqa: E402
import cgcompile.backend.pipeline as pipeline  # noqa: E402
from examples.llama import Llama, LlamaConfig, make_inputs  # noqa: E402


class NullGraph:
    def __init__(self, output: Any) -> None:
        self.output = output

    def replay(self) -> Any:
        return self.output


class NullRuntime:
    """Runs fn once at capture; replays do nothing and return the capture's output."""

    name = "null"

    def capture(self, fn: Callable[..., Any], args: tuple[Any, ...], *, weak_output: bool):
        output = fn(*args)
        return NullGraph(output), output

    def memory_bytes(self) -> int:
        return 0


def per_call_us(fn: Callable[[], Any], calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    loops = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        loops.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(loops)


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "PIECEWISE"
    pipeline.make_graph_runtime = lambda kind, device=None: NullRuntime()
    cfg = LlamaConfig(num_layers=16, hidden=64, heads=4, ffn=128, vocab=256, cache_len=16)
    model = Llama(cfg).eval()
    # "simulated" passes the CPU check; the patched factory hands out the no-op runtime instead
    options = {"cudagraph_mode": mode, "compiler": "eager", "graph_runtime": "simulated"}
    options["cudagraph_capture_sizes"] = [8]
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    tokens, positions = make_inputs(cfg, 8, "cpu")
    cgcompile.mark_dynamic_batch(tokens, positions)

    def step() -> Any:
        with cgcompile.batch_hint(uniform_decode=False):
            return compiled(tokens, positions)

    layer = model.layers[0]
    query = layer.pre_attention(model.embed(tokens), positions)[1]
    buffer = layer.attention(query).clone()
    graphs = [NullGraph(None) for _ in range(cfg.num_layers + 1)]

    def hand() -> None:
        graphs[0].replay()
        for graph in graphs[1:]:
            buffer.copy_(layer.attention(query))
            graph.replay()

    with torch.no_grad():
        step()
        ours, floor = per_call_us(step), per_call_us(hand)
        attention = per_call_us(lambda: layer.attention(query), 20000)
        print(
            f"{mode}: cgcompile {ours:.1f} us/forward; hand loop {floor:.1f} us; "
            f"one attention call {attention:.2f} us"
        )
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(2000):
            step()
        profiler.disable()
    order = sys.argv[2] if len(sys.argv) > 2 else "tottime"  # or "cumulative"
    pstats.Stats(profiler).sort_stats(order).print_stats(25)


if __name__ == "__main__":
    main()
