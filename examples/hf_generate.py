"""Hugging Face `generate()` through the `cudagraph_modes` backend, both ways a user compiles it.

1. Static KV cache: HF compiles the decode step itself when given a `CompileConfig`; the step
   writes the cache and its length counter in place inside the graph, and each call must
   advance them exactly once. `batch_hint(uniform_decode=True)` tells the dispatcher that every
   compiled call is a decode step (one token per request), so FULL graphs serve it.
2. The default dynamic cache with `model.forward = torch.compile(model.forward, ...)`: the
   cache grows every step, so each step has new sizes; it runs correctly, mostly without
   graphs (a key is captured on its second call). Use the static cache for speed.

A small Llama from a config (random weights, fp32, no download); tokens are compared with
eager's greedy tokens. On a machine without a GPU the simulated graph runtime stands in.

    python examples/hf_generate.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cgcompile  # noqa: E402


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    options = {"cudagraph_mode": "FULL_AND_PIECEWISE"}
    if device == "cpu":
        options["graph_runtime"] = "simulated"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config).to(device).eval()
    prompts = torch.randint(0, 1000, (4, 16), device=device)
    kwargs = {"max_new_tokens": 24, "do_sample": False, "pad_token_id": 0}

    want = model.generate(prompts, cache_implementation="static", **kwargs)
    compile_config = CompileConfig(backend="cudagraph_modes", mode=None, options=options)
    compile_config._compile_all_devices = True  # HF compiles only on accelerators otherwise
    with cgcompile.batch_hint(uniform_decode=True):  # every compiled call is a decode step
        got = model.generate(
            prompts, cache_implementation="static", compile_config=compile_config, **kwargs
        )
    static_ok = torch.equal(got, want)
    print(f"static cache, CompileConfig: tokens {'equal' if static_ok else 'DIFFER from'} eager")

    want = model.generate(prompts, **kwargs)
    model.forward = torch.compile(model.forward, backend="cudagraph_modes", options=options)
    dynamic_ok = torch.equal(model.generate(prompts, **kwargs), want)
    verdict = "equal" if dynamic_ok else "DIFFER from"
    print(f"dynamic cache, compiled forward: tokens {verdict} eager")

    for graph in cgcompile.compiled_graphs():
        print(graph.format_report())
    return 0 if static_ok and dynamic_ok else 1


if __name__ == "__main__":
    sys.exit(main())
