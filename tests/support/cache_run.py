"""One process of the compile-cache tests: optionally load a compile cache, compile and call the
example Llama (1 layer, tiny, Inductor pieces, simulated graphs) at 4 tokens, compare with
eager, optionally save the cache; print one JSON line of what happened.

    python -m tests.support.cache_run {save,load} PATH [--changed]
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from torch._dynamo.utils import counters

import cgcompile
from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=["save", "load"])
    parser.add_argument("path")
    parser.add_argument("--changed", action="store_true", help="another FFN width: other code")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    loaded = cgcompile.load_compile_cache(args.path) if args.action == "load" else None
    torch.manual_seed(0)
    ffn = 96 if args.changed else 128
    cfg = LlamaConfig(num_layers=1, hidden=64, heads=4, ffn=ffn, vocab=256, cache_len=64)
    model, reference = Llama(cfg).eval(), Llama(cfg).eval()
    reference.load_state_dict(model.state_dict())
    options = {"graph_runtime": "simulated", "cudagraph_capture_sizes": [4]}
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    tokens, positions = make_inputs(cfg, 4, "cpu")
    mark_batch(cfg, tokens, positions)
    with torch.no_grad():
        error = (compiled(tokens, positions) - reference(tokens, positions)).abs().max().item()
    if args.action == "save":
        cgcompile.save_compile_cache(args.path)
    inductor = counters["inductor"]
    print(
        json.dumps(
            {
                "loaded": loaded,
                "hits": inductor["fxgraph_cache_hit"],
                "misses": inductor["fxgraph_cache_miss"],
                "max_error": error,
                "report_cache": list(cgcompile.compiled_graphs()[0].report.inductor_cache),
            }
        )
    )


if __name__ == "__main__":
    main()
