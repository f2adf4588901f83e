"""Where the default call's host time goes as a model gets deeper: Dynamo's guard check (with its
guards counted by kind), the rest of Dynamo's work (frame entry and the bytecode that gathers
every parameter as a graph input) and cgcompile's own share, at each depth; beside the same call
with torch's recursive dict tags (`use_recursive_dict_tags_for_guards`), without the tensor guards
on parameters and buffers (`no-param-guards`: a `guard_filter_fn`; what a backend could drop
itself, unsafe for a parameter moved to another dtype or device), with no guards
(`skip_all_guards_unsafe`, unsafe: the floor of Dynamo's path), the 10-line backend's call
(`tenline`: `benchmarks/_user_peers.py`; on the CPU a no-op per call), and, in the default
variant's process, the same compiled model called through `cgcompile.guarded` and
`cgcompile.trusted` (Dynamo's guards checked without its bytecode; no Dynamo at all).

Each (family, layers, variant) runs in its own process (in one process Dynamo walks every
compiled peer's cache entry of the same `forward`), `--rounds` times in alternating order (the
GPU machine's host is noisy in bursts: compare a cell's rounds). Per process: the median over
`--calls` calls, each timed alone with the device synchronised before it, of the compiled
model's call, of its guard check (`guard_manager.check` on the call's frame locals) right after
a call of the model, as a call meets it, and repeated alone (warm caches: it reads less), and
of its `CompiledGraph` called with the arguments Dynamo passes (cgcompile's share, replay
included). A Hugging Face model is called through `_step_models.HFStep` (tensors in, logits
out: the decode step a user compiles; called with keywords, `guarded` and `trusted` refuse it).
Families (`--families`): the example Llama, the KV-rows step, a Hugging Face Llama; tiny dims
(host time depends on the number of modules and tensors, not on their sizes), eager pieces,
FULL, batch 8. On the CPU replays are no-ops; `--cuda` replays real graphs.

    python benchmarks/guard_costs.py --out OUT [--layers 16 64] [--families llama rows hf] [--cuda]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
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
import cgcompile.backend.pipeline as pipeline  # noqa: E402
from benchmarks._step_models import HFStep  # noqa: E402
from benchmarks._user_peers import tenline_backend  # noqa: E402
from benchmarks.host_overhead import NullRuntime, _record_call  # noqa: E402
from cgcompile.restart.portable import frame_scope  # noqa: E402

VARIANTS = ("default", "tags", "no-param-guards", "no-guards", "tenline")
_MODEL = ("self.", "self[", "args[0].", "args[0][", "type(self)", "type(args[0])")
"""How Dynamo names the model in a guard: `self`, or `args[0]` behind a `(*args, **kwargs)`
decorator (Hugging Face's forwards)."""
FAMILIES = ("llama", "rows", "hf")
CACHE_LEN = 2048


def _model(
    family: str, layers: int, device: str, mark: bool = True
) -> tuple[torch.nn.Module, Callable[[], Any]]:
    """The family's model and a decode step of batch 8 on it: (model, call(fn)); `mark`: the
    rows step's inputs marked dynamic (the 10-line backend compiles static graphs)."""
    if family == "llama":
        from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch

        cfg = LlamaConfig(num_layers=layers, hidden=64, heads=4, ffn=128, vocab=256, cache_len=64)
        tokens, positions = make_inputs(cfg, 8, device)
        mark_batch(cfg, tokens, positions)
        return Llama(cfg).to(device).eval(), lambda fn: fn(tokens, positions)
    if family == "rows":
        from benchmarks._rows_model import RowsConfig, RowsLlama, rows_inputs

        cfg = RowsConfig(num_layers=layers)
        tokens, pos = rows_inputs(cfg, 8, device, 0)
        if mark:
            cgcompile.mark_dynamic_batch(tokens, pos)
        return RowsLlama(cfg).to(device).eval(), lambda fn: fn(tokens, pos)
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=CACHE_LEN,
    )
    torch.manual_seed(0)
    # called as a user's compiled decode step: tensors in, logits out, a `StaticCache` with room
    # for every call a process makes (each writes at the cache's own counter)
    model = HFStep(transformers.LlamaForCausalLM(config).to(device).eval(), (8,), CACHE_LEN)
    tokens = torch.randint(1, 256, (8,), device=device)
    positions = torch.full((8,), 3, device=device)
    return model, lambda fn: fn(tokens, positions)


def _kind(entry: Any) -> str:
    """The issue's kinds: parameter/buffer tensors, module attributes, globals, inputs."""
    value = entry.value if entry.has_value else None
    if entry.guard_type == "TENSOR_MATCH":
        static = isinstance(value, torch.nn.Parameter) or "_buffers" in entry.name
        return "param/buffer tensors" if static else "input tensors"
    if entry.is_global:
        return "globals"
    if not entry.name:
        return "global state"
    of_model = entry.name.startswith(_MODEL) or "._modules[" in entry.name
    return "module attributes" if of_model else "inputs, other"


def child(family: str, layers: int, variant: str, calls: int, cuda: bool) -> dict[str, Any]:
    device = "cuda" if cuda else "cpu"
    if not cuda:
        pipeline.make_graph_runtime = lambda kind, device=None: NullRuntime()
    kinds: collections.Counter[str] = collections.Counter()

    def count(entries: Any) -> list[bool]:
        found = [_kind(e) for e in entries]
        kinds.update(found)
        if variant == "no-param-guards":  # what cgcompile's own instance check covers, in part
            return [kind != "param/buffer tensors" for kind in found]
        return [True] * len(entries)

    options: dict[str, Any] = {"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [8]}
    options |= {"compiler": "eager"}  # the kernels inside a replayed graph cost no host time
    options |= {"graph_runtime": "simulated"} if not cuda else {}
    options["guard_filter_fn"] = torch.compiler.skip_all_guards_unsafe
    if variant != "no-guards":
        options["guard_filter_fn"] = count
    if variant == "tags":
        torch._dynamo.config.use_recursive_dict_tags_for_guards = True
        torch._dynamo.config.max_saved_pointers_for_recursive_dict_tags_check = 10**6
    torch.manual_seed(0)
    model, step = _model(family, layers, device, mark=variant != "tenline")
    if variant == "tenline":
        backend = tenline_backend if cuda else _noop_backend
        compiled = torch.compile(model, backend=backend, dynamic=False)
    else:
        compiled = torch.compile(model, backend="cudagraph_modes", options=options)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def median_us(fn: Callable[[], Any], before: Callable[[], Any] | None = None) -> float:
        for _ in range(20):
            fn()
        times = []
        for _ in range(calls):
            if before is not None:
                before()
            sync()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        sync()
        return statistics.median(times) * 1e6

    with torch.no_grad():
        step(compiled)
        if variant != "tenline":
            graph = cgcompile.compiled_graphs()[-1]
            outer = _record_call(graph, lambda: step(compiled))[0]
        forward = type(model).forward
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(forward.__code__)
        manager = entries[0].guard_manager
        seen: dict[str, Any] = {}
        step(lambda *args, **kwargs: seen.update(args=args, kwargs=kwargs))
        f_locals = frame_scope(forward, (model, *seen["args"]), seen["kwargs"])["L"]
        if not manager.check(f_locals):
            raise SystemExit("the guard check failed on the call's own frame locals")
        row = {
            "family": family,
            "layers": layers,
            "variant": variant,
            "tensors": sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers()),
            "call_us": median_us(lambda: step(compiled)),
            # timed right after a call of the model, as a call runs it (caches as the call
            # leaves them; repeated alone, warm, the check reads less)
            "guards_us": median_us(lambda: manager.check(f_locals), lambda: step(compiled)),
            "guards_alone_us": median_us(lambda: manager.check(f_locals)),
            "own_us": 0.0,
            "guards": dict(kinds),
        }
        if cuda:  # the process's host speed: a bare replay of a one-kernel graph
            row["bare_replay_us"] = median_us(_bare_replay())
        if variant == "tenline":
            return row
        row["own_us"] = median_us(lambda: graph(*outer))
        if variant == "default":  # the opt-ins, on the same compiled model
            for name, wrap in (("guarded", cgcompile.guarded), ("trusted", cgcompile.trusted)):
                fast = wrap(compiled)
                row[f"{name}_us"] = median_us(lambda fast=fast: step(fast))
                row[f"{name}_through_dynamo"] = fast.calls_through_dynamo
                row[f"{name}_refused"] = fast.refused
        return row


def _bare_replay() -> Callable[[], Any]:
    x = torch.randn(8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        x.mul_(1.0)
    return graph.replay


def _noop_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    """The CPU's stand-in for the 10-line backend: its outputs once, a no-op per call (as the
    simulated runtime's replays)."""
    out: list[Any] = []

    def run(*args: Any) -> Any:
        if not out:
            out.append(gm(*args))
        return out[0]

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--layers", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument(
        "--rounds", type=int, default=1, help="processes per cell, in alternating order"
    )
    parser.add_argument("--cuda", action="store_true", help="real CUDA graphs, GPU synchronised")
    parser.add_argument("--child", nargs=3, metavar=("FAMILY", "LAYERS", "VARIANT"))
    args = parser.parse_args()
    if args.child:
        family, layers, variant = args.child
        print(json.dumps(child(family, int(layers), variant, args.calls, args.cuda)))
        return
    meta = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if args.cuda else "cpu",
        "torch": torch.__version__,
        "commit": os.environ.get("CGCOMPILE_COMMIT", "unknown"),
        "what": "us per call (median, device synchronised before each): the call, its guard "
        "check right after a call (guards_us) and repeated alone (guards_alone_us), cgcompile's "
        "share; guards counted by kind; on CUDA the process's bare replay of a one-kernel graph",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    cells = [(f, n, v) for f in args.families for n in args.layers for v in args.variants]
    for turn in range(args.rounds):  # each cell once per round, every other round reversed
        for family, layers, variant in cells if turn % 2 == 0 else cells[::-1]:
            cmd = [sys.executable, __file__, "--child", family, str(layers), variant]
            cmd += ["--calls", str(args.calls)] + (["--cuda"] if args.cuda else [])
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = proc.stdout.strip().splitlines()
            if proc.returncode or not lines:
                print(f"{family} {layers} {variant}: ERROR {proc.stderr[-800:]}", flush=True)
                continue
            rows.append({**json.loads(lines[-1]), "round": turn})
            print(_line(rows[-1]), flush=True)
            out = {"meta": meta, "rows": rows}  # after each row: a cut-off run keeps them
            (args.out / "guard-costs.json").write_text(json.dumps(out, indent=1))


def _line(row: dict[str, Any]) -> str:
    rest = row["call_us"] - row["guards_us"] - row["own_us"]
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(row["guards"].items(), key=lambda kv: -kv[1]))
    opt_ins = "".join(
        f"; {name} {row[name + '_us']:.1f} us"
        + (f" (refused: {row[name + '_refused'][:60]})" if row[name + "_refused"] else "")
        for name in ("guarded", "trusted")
        if name + "_us" in row
    )
    replay = f"; bare replay {row['bare_replay_us']:.1f} us" if "bare_replay_us" in row else ""
    return (
        f"{row['family']:5} {row['layers']:3} layers {row['variant']:9} call {row['call_us']:7.1f}"
        f" us = guards {row['guards_us']:6.1f} (alone {row.get('guards_alone_us', 0):6.1f}) + rest "
        f"of Dynamo {rest:6.1f} + cgcompile {row['own_us']:5.1f}; {row['tensors']} tensors; "
        f"guards: {kinds or '-'}{opt_ins}{replay}"
    )


if __name__ == "__main__":
    main()
