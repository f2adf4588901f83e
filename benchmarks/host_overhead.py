"""Host (Python) cost of one cgcompile forward, graphs replaced by a no-op runtime; runs on CPU.

Compiles a Llama (16 layers, or `--layers`) with tiny dims (compiler eager) whose graph runtime
records nothing and replays nothing, so a forward costs only the host work around the graphs:
Dynamo's guard check, dispatch, input copies, the piece wrappers, the stitching graph and the
eager attention. A hand loop of 17 no-op replays, 16 attention calls and 16 copies is the floor
to compare with. Prints microseconds per forward and a cProfile of the forward by own time
(Dynamo's guard check runs in C when the model's frame starts, so cProfile books it to
`Module._call_impl`).

    python benchmarks/host_overhead.py [--mode PIECEWISE] [--layers 64] [--skip-module-guards]
    python benchmarks/host_overhead.py --entries    # 8 tokens with and without a batch-1 entry
    python benchmarks/host_overhead.py --mode FULL --evict 16   # also warm against cold caches
    python benchmarks/host_overhead.py --mode FULL --after-guards   # right after a guard walk

`--entries`: us per forward of 8 tokens before and after the model was also called at 1 token
(Dynamo then keeps a second cache entry, checked first), and of 1 token.
"""

from __future__ import annotations

import argparse
import cProfile
import os
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
from benchmarks._timing import take_arguments  # noqa: E402
from cgcompile.calls.forward_context import current_forward_context, set_forward_context  # noqa: E402
from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch  # noqa: E402


class NullGraph:
    def __init__(self, output: Any) -> None:
        self.output = output

    def replay(self) -> Any:
        return self.output

    @property
    def launch(self) -> Callable[[], Any]:
        return self.replay


class NullRuntime:
    """Runs fn once at capture; replays do nothing and return the capture's output."""

    name = "null"

    def capture(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        *,
        weak_output: bool,
        dry_run: bool,
        instance: int = 0,
    ):
        output = fn(*args)
        return NullGraph(output), output

    def memory_bytes(self) -> int:
        return 0

    def borrow(self, tensors: Any) -> None:
        """Holds nothing."""


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


def _record_call(graph: Any, step: Callable[[], Any]) -> tuple[Any, Any, Any]:
    """One step's arguments to `graph` (from Dynamo), to its runnable (static buffers, padded),
    and the forward context the runnable ran under."""
    seen: dict[str, Any] = {}
    cls, runnable = type(graph), graph.runnable
    outer_call = cls.__call__

    def record_outer(self: Any, *args: Any) -> Any:
        seen["outer"] = args
        return outer_call(self, *args)

    def record_inner(*args: Any) -> Any:
        seen["inner"], seen["ctx"] = args, current_forward_context()
        return runnable(*args)

    cls.__call__, graph.runnable = record_outer, record_inner
    try:
        step()
    finally:
        cls.__call__, graph.runnable = outer_call, runnable
    return seen["outer"], seen["inner"], seen["ctx"]


def _without_address_checks(graph: Any, manual: Callable[[], Any]) -> float:
    """`manual`'s us per forward with the replays' address lists emptied, then restored."""
    entries = [e for w in graph.wrappers for e in w.entries.values()]
    saved = [e.addresses for e in entries]
    for entry in entries:
        entry.addresses = ()
    try:
        return per_call_us(manual)
    finally:
        for entry, addresses in zip(entries, saved, strict=True):
            entry.addresses = addresses


def _address_checks(graph: Any, mode: Any) -> int:
    """Addresses one manual-mode forward checks: each acting wrapper's one key (one size)."""
    acting = [w for w in graph.wrappers if w.runtime_mode is mode]
    return sum(max((len(e.addresses) for e in w.entries.values()), default=0) for w in acting)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="PIECEWISE", help="a cudagraph_mode")
    parser.add_argument(
        "--skip-module-guards",
        action="store_true",
        help="guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe",
    )
    parser.add_argument("--sort", default="tottime", help="cProfile order, e.g. cumulative")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--entries", action="store_true", help="a batch-1 entry's cost")
    parser.add_argument(
        "--evict", type=int, default=0, metavar="MB", help="also time calls after writing MB"
    )
    parser.add_argument(
        "--after-guards",
        action="store_true",
        help="also time the backend's call right after another compiled model's guard walk",
    )
    args = parser.parse_args()
    mode = args.mode
    pipeline.make_graph_runtime = lambda kind, device=None: NullRuntime()
    cfg = LlamaConfig(num_layers=args.layers, hidden=64, heads=4, ffn=128, vocab=256, cache_len=64)
    if args.entries:
        _entries(cfg, mode)
        return
    model = Llama(cfg).eval()
    # "simulated" passes the CPU check; the patched factory hands out the no-op runtime instead
    options = {"cudagraph_mode": mode, "compiler": "eager", "graph_runtime": "simulated"}
    options["cudagraph_capture_sizes"] = [8]
    if args.skip_module_guards:
        options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    tokens, positions = make_inputs(cfg, 8, "cpu")
    mark_batch(cfg, tokens, positions)

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
        graph = cgcompile.compiled_graphs()[-1]
        outer, inner, ctx = _record_call(graph, step)

        def no_dynamo() -> Any:  # dispatch, copy-in, graphs: the backend's own work
            with cgcompile.batch_hint(uniform_decode=False):
                return graph(*outer)

        def graphs_only() -> Any:  # the stitching graph and its wrappers, context already set
            with set_forward_context(
                ctx.cudagraph_runtime_mode, ctx.batch_descriptor, None, ctx.shape_key
            ):
                return graph.runnable(*inner)

        def manual() -> Any:  # the caller's own context: every replay checks input addresses
            with set_forward_context(ctx.cudagraph_runtime_mode, ctx.batch_descriptor):
                return graph(*inner)

        tiers = {
            "torch.compile'd model": per_call_us(step),
            "CompiledGraph (no Dynamo)": per_call_us(no_dynamo),
            "a call taking its arguments": per_call_us(lambda: take_arguments(*outer)),
            "stitching + wrappers": per_call_us(graphs_only),
            "manual mode": per_call_us(manual),
            "manual mode, no checks": _without_address_checks(graph, manual),
            "instance identity check": per_call_us(lambda: graph.instances.slot_of(outer)),
            "hand loop": per_call_us(hand),
            "one attention call": per_call_us(lambda: layer.attention(query), 20000),
        }
        guards = ", module guards skipped" if args.skip_module_guards else ""
        print(f"{mode}{guards}, {args.layers} layers, 8 tokens, us per forward:")
        for name, us in tiers.items():
            print(f"  {name:28} {us:8.1f}")
        checks = _address_checks(graph, ctx.cudagraph_runtime_mode)
        cost = tiers["manual mode"] - tiers["manual mode, no checks"]
        print(f"  manual mode checks {checks} addresses per forward: {cost:.1f} us")
        if args.evict:
            fast = cgcompile.trusted(compiled)

            def trusted() -> Any:
                with cgcompile.batch_hint(uniform_decode=False):
                    return fast(tokens, positions)

            cold = {"torch.compile'd model": step, "cgcompile.trusted": trusted}
            cold.update({"CompiledGraph (no Dynamo)": no_dynamo, "hand loop": hand})
            _evicted(mode, args.evict, cold)
        if args.after_guards:
            _after_guards(mode, cfg, {"CompiledGraph (no Dynamo)": no_dynamo})
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(2000):
            step()
        profiler.disable()
    pstats.Stats(profiler).sort_stats(args.sort).print_stats(25)


def _evicted(mode: str, mb: int, tiers: dict[str, Callable[[], Any]]) -> None:
    """Each tier timed call by call, warm (right after a call of itself) and right after
    writing `mb` MB of other memory, as a serving loop's other work between steps would."""
    buffer = torch.zeros(mb << 18)  # float32: mb MB
    print(f"{mode}, us per forward, warm and after writing {mb} MB:")
    for name, fn in tiers.items():
        warm, cold = [], []
        for _ in range(20):
            fn()
        for _ in range(500):
            buffer.add_(1)
            start = time.perf_counter()
            fn()
            cold.append(time.perf_counter() - start)
            start = time.perf_counter()
            fn()
            warm.append(time.perf_counter() - start)
        warm_us, cold_us = statistics.median(warm) * 1e6, statistics.median(cold) * 1e6
        print(f"  {name:28} {warm_us:8.1f} {cold_us:8.1f}")


def _after_guards(mode: str, cfg: LlamaConfig, tiers: dict[str, Callable[[], Any]]) -> None:
    """Each tier right after a call of another compiled copy of the model whose backend returns
    a fixed output: Dynamo's guard walk (~180 tensors, ~2900 guards at 16 layers) leaves the
    caches as a model's own walk leaves them for its backend. What the tier adds to that call,
    median of 7 alternating blocks."""
    from benchmarks._user_peers import own_code

    def fixed_output(gm: torch.fx.GraphModule, example: Any) -> Callable[..., Any]:
        out = gm(*example)
        return lambda *args: out

    other = torch.compile(own_code(Llama(cfg).eval()), backend=fixed_output)
    tokens, positions = make_inputs(cfg, 8, "cpu")

    def alone() -> Any:
        return other(tokens, positions)

    print(f"{mode}, us added to another compiled model's call, and warm:")
    for name, fn in tiers.items():

        def both(fn: Callable[[], Any] = fn) -> Any:
            alone()
            return fn()

        added = [per_call_us(both, 500) - per_call_us(alone, 500) for _ in range(7)]
        print(f"  {name:28} {statistics.median(added):8.1f} {per_call_us(fn):8.1f}")


def _entries(cfg: LlamaConfig, mode: str) -> None:
    """us per forward at 8 tokens, then again once batch 1 has a Dynamo cache entry too."""
    options = {"cudagraph_mode": mode, "compiler": "eager", "graph_runtime": "simulated"}
    options["batch_one"] = os.environ.get("BATCH_ONE", "padded")
    compiled = torch.compile(Llama(cfg).eval(), backend="cudagraph_modes", options=options)
    calls = {}
    for n in (8, 1):
        tokens, positions = make_inputs(cfg, n, "cpu")
        mark_batch(cfg, tokens, positions)
        calls[n] = lambda t=tokens, p=positions: compiled(t, p)
    with torch.no_grad():
        alone = per_call_us(calls[8])
        beside = {n: per_call_us(call) for n, call in calls.items()}
    print(f"{mode}, {cfg.num_layers} layers, us per forward (Dynamo entries checked newest first):")
    print(f"  8 tokens, one entry               {alone:8.1f}")
    print(f"  8 tokens, a batch-1 entry first   {beside[8]:8.1f}")
    print(f"  1 token                           {beside[1]:8.1f}")


if __name__ == "__main__":
    main()
