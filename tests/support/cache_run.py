"""One process of the compile-cache tests: optionally load a compile cache, compile a small MLP
(FULL: one Inductor compile; simulated graphs, or CUDA graphs with --cuda), call it at 4 rows,
compare with eager, optionally save the cache; print one JSON line of what happened.

    python -m tests.support.cache_run {save,load} PATH [--changed] [--cuda]
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from torch import nn
from torch._dynamo.utils import counters

import cgcompile


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=["save", "load"])
    parser.add_argument("path")
    parser.add_argument("--changed", action="store_true", help="another hidden width: other code")
    parser.add_argument("--cuda", action="store_true", help="on the GPU, real CUDA graphs")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    loaded = cgcompile.load_compile_cache(args.path) if args.action == "load" else None
    torch.manual_seed(0)
    hidden = 24 if args.changed else 32
    device = "cuda" if args.cuda else "cpu"
    model = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 16)).to(device)
    options = {
        "cudagraph_mode": "FULL",
        "graph_runtime": "cuda" if args.cuda else "simulated",
        "cudagraph_capture_sizes": [4],
    }
    compiled = torch.compile(model.eval(), backend="cudagraph_modes", options=options)
    x = torch.randn(4, 16, device=device)
    cgcompile.mark_dynamic_batch(x)
    with torch.no_grad():
        error = (compiled(x) - model(x)).abs().max().item()
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
