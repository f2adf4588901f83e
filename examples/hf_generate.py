"""Hugging Face `generate()` with CUDA graphs: HF compiles each decode step with the
`cudagraph_modes` backend, and each step replays one full graph.

    python examples/hf_generate.py

Builds a small Llama from a config (random weights, fp32, no download), generates greedy tokens
for 4 prompts with a static KV cache, checks them against eager's, and prints the CUDA graphs
captured, the decode steps that replayed one and the backend's report. Needs transformers (the
`[test]` extra installs it). Without a GPU the simulated graph runtime stands in for CUDA graphs
and the pieces run eagerly (`compiler="eager"`: Inductor's C++ build would take minutes here).
"""

from __future__ import annotations

import sys

import torch
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

import cgcompile

NEW_TOKENS = 24


def tiny_llama(device: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).to(device).eval()


def compile_config(device: str) -> CompileConfig:
    """The backend and its options for HF's compile; `mode=None`: a backend takes options."""
    options = {"cudagraph_mode": "FULL_AND_PIECEWISE"}
    if device == "cpu":
        options |= {"graph_runtime": "simulated", "compiler": "eager"}
    config = CompileConfig(backend="cudagraph_modes", mode=None, options=options)
    if device == "cpu":
        # HF compiles only on accelerators; this private flag makes it compile on a CPU too.
        # A GPU run needs nothing of the kind.
        config._compile_all_devices = True
    return config


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"Hugging Face generate() on {device}, {NEW_TOKENS} new tokens for 4 prompts")
    model = tiny_llama(device)
    prompts = torch.randint(0, 1000, (4, 16), device=device)
    kwargs = {
        "max_new_tokens": NEW_TOKENS,
        "do_sample": False,
        "pad_token_id": 0,
        "cache_implementation": "static",  # fixed addresses: graphs write the cache in place
    }
    want = model.generate(prompts, **kwargs)

    before = cgcompile.counters.snapshot()
    with cgcompile.batch_hint(uniform_decode=True):  # every compiled call is a decode step
        # the returned dict keeps the static cache alive, and with it its graphs (report below)
        out = model.generate(
            prompts, compile_config=compile_config(device), return_dict_in_generate=True, **kwargs
        )
    captured = cgcompile.counters.num_cudagraph_captured - before["num_cudagraph_captured"]
    eager = cgcompile.counters.num_eager_fallbacks - before["num_eager_fallbacks"]
    same = torch.equal(out.sequences, want)
    # the prefill runs without compile; each later token is one compiled decode step, whose
    # first call warms up (num_warmups=1), second captures and replays, later ones replay
    steps = NEW_TOKENS - 1
    replayed = steps - 1 - eager
    print(f"tokens {'equal' if same else 'DIFFER from'} eager's greedy tokens")
    print(
        f"{steps} decode steps: 1 warm-up without a graph, {captured} CUDA graph captured, "
        f"replayed by {replayed} steps (the capturing step included)"
    )
    for graph in cgcompile.compiled_graphs():
        print(graph.format_report())
    return 0 if same and captured == 1 and eager == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
