"""One process of the precompile tests: `cgcompile.precompile` the model of MODEL_DIR/pc_model.py
(the example Llama, KV cache written in place, times a SCALE that a test edits to change the
model's code) for a batch of 8 and a batch of 1, then decode steps of several sizes against an
eager copy (logits and caches); print one JSON line of what happened.

    python -m tests.support.precompile_run PATH MODEL_DIR [--compiler eager] [--sizes 4 8]
        [--marked] [--cuda] [--examples 8 1] [--unbacked]
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

import torch
from torch._dynamo.utils import counters as dynamo_counters

import cgcompile
from examples.llama import LlamaConfig, _read_slots, make_inputs, mark_batch

MODEL_SOURCE = """
from examples.llama import Llama

SCALE = {scale}


class Model(Llama):
    def forward(self, tokens, positions):
        return super().forward(tokens, positions) * SCALE
"""


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _count_analyses() -> list[str]:
    """The names of the backend's analyses (one run of a graph on fake tensors, the pad check
    riding along) and node-by-node batch-1 matches, as they run."""
    from cgcompile.backend import analyses, batch_one_sharing

    ran: list[str] = []
    for module, name in (
        (analyses, "find_effects"),
        (analyses, "pad_check"),
        (batch_one_sharing, "match_batch_one"),
    ):
        original = getattr(module, name)

        def counted(*args: object, _name: str = name, _original: object = original) -> object:
            ran.append(_name)
            return _original(*args)  # type: ignore[operator]

        setattr(module, name, counted)
    return ran


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("model_dir")
    parser.add_argument("--compiler", default="inductor")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--marked", action="store_true", help="mark the calls' inputs too")
    parser.add_argument("--cuda", action="store_true", help="on the GPU, real CUDA graphs")
    parser.add_argument("--examples", type=int, nargs="+", default=[8, 1])
    parser.add_argument("--unbacked", action="store_true", help="examples marked unbacked")
    args = parser.parse_args()
    analyses_run = _count_analyses()
    warnings = _Warnings()
    logging.getLogger("cgcompile").addHandler(warnings)
    sys.path.insert(0, args.model_dir)
    model_class = importlib.import_module("pc_model").Model
    cfg = LlamaConfig(num_layers=2, cache_len=64)
    torch.manual_seed(0)
    device = "cuda" if args.cuda else "cpu"
    model, eager = model_class(cfg).to(device).eval(), model_class(cfg).to(device).eval()
    eager.load_state_dict(model.state_dict())
    options = {
        "graph_runtime": "cuda" if args.cuda else "simulated",
        "compiler": args.compiler,
        "cudagraph_capture_sizes": args.sizes,
    }
    examples = []
    for n in args.examples:
        tokens, positions = make_inputs(cfg, n, device)
        mark_batch(cfg, tokens, positions, unbacked=args.unbacked)
        examples.append((tokens, positions))
    dynamo_counters.clear()
    with torch.no_grad():
        step = cgcompile.precompile(model, examples, args.path, options)
        traces = dynamo_counters["stats"]["unique_graphs"]
        compiles = cgcompile.counters.num_backend_compilations
        inductor = dict(dynamo_counters["inductor"])
        autograd = dict(dynamo_counters["aot_autograd"])
        error = 0.0

        def call(i: int, n: int) -> None:
            nonlocal error
            tokens, positions = make_inputs(cfg, n, device, torch.Generator().manual_seed(i))
            if args.marked:
                mark_batch(cfg, tokens, positions)
            error = max(error, (step(tokens, positions) - eager(tokens, positions)).abs().max())

        call(0, 3)  # capture_all() reuses a call's parameters and input layout
        captured_by_capture_all = cgcompile.capture_all(progress=False)
        before_calls = cgcompile.counters.num_cudagraph_captured
        for i, n in enumerate([8, 5, 1, 3, 16, 2, 1, 7]):
            call(i + 1, n)
        # manual mode at batch 1: the batch-1 graph's own nodes run (unpickled now if loaded)
        context = cgcompile.set_forward_context(
            cgcompile.CUDAGraphMode.NONE, cgcompile.BatchDescriptor(num_tokens=1)
        )
        with context:
            call(9, 1)
    caches = (_read_slots(model) - _read_slots(eager)).abs().max().item()  # not the trash slot
    print(
        json.dumps(
            {
                "loaded": step.loaded,
                "functions": len(step.functions),
                "why_compiled": step.why_compiled,
                "dynamo_traces": traces,
                "dynamo_traces_after_calls": dynamo_counters["stats"]["unique_graphs"],
                "backend_compiles": compiles,
                "inductor_misses": inductor.get("fxgraph_cache_miss", 0),
                "autograd_cache": [autograd.get(f"autograd_cache_{k}", 0) for k in ("hit", "miss")],
                "max_error": float(error),
                "cache_error": caches,
                "captured_by_capture_all": captured_by_capture_all,
                "captured_by_calls": cgcompile.counters.num_cudagraph_captured - before_calls,
                "warnings": warnings.messages,
                "report": cgcompile.compiled_graphs()[0].format_report(),
                "analyses_run": analyses_run,
                "graphs_shared": cgcompile.counters.num_graphs_shared,
                "seconds": step.seconds,
                "load_steps": step.load_steps,
            }
        )
    )


if __name__ == "__main__":
    main()
