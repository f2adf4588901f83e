"""Hugging Face `generate()` with CUDA graphs: HF compiles each decode step with the
`cudagraph_modes` backend, and each step replays one full graph.

    python examples/hf_generate.py

Builds a small Llama from a config (random weights, fp32, no download), calls generate() twice
with one static KV cache kept across the calls (reset in place), checks the greedy tokens
against eager's, and prints per call the CUDA graphs captured and the decode steps that
replayed one (the second call only replays), then the backend's report. Needs transformers (the
`[test]` extra installs it). Without a GPU the simulated graph runtime stands in for CUDA graphs
and the pieces run eagerly (`compiler="eager"`: Inductor's C++ build would take minutes here).
"""

from __future__ import annotations

import sys

import torch
import transformers
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM, StaticCache

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


def cache_argument() -> str:
    """The name of generate()'s argument for a cache the caller keeps: `cache` from transformers
    5.24 (which deprecates the old name), `past_key_values` before."""
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "cache" if (major, minor) >= (5, 24) else "past_key_values"


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"Hugging Face generate() on {device}, {NEW_TOKENS} new tokens for 4 prompts, twice")
    model = tiny_llama(device)
    config = compile_config(device)
    cache = StaticCache(config=model.config, max_cache_len=64)  # kept: graphs write it in place
    kwargs = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
    kept = {cache_argument(): cache}
    ok = True
    for call in range(2):
        prompts = torch.randint(0, 1000, (4, 16), device=device)
        want = model.generate(prompts, cache_implementation="static", **kwargs)  # eager
        before = cgcompile.counters.snapshot()
        cache.reset()
        got = model.generate(prompts, compile_config=config, **kept, **kwargs)
        captured = cgcompile.counters.num_cudagraph_captured - before["num_cudagraph_captured"]
        eager = cgcompile.counters.num_eager_fallbacks - before["num_eager_fallbacks"]
        # the prefill runs without compile; each later token is one compiled decode step
        # (input_ids [4, 1]: a decode batch), whose first call ever warms up, second captures
        steps = NEW_TOKENS - 1
        warmups = 1 if call == 0 else 0
        same = torch.equal(got, want)
        print(
            f"generate() {call + 1}: tokens {'equal' if same else 'DIFFER from'} eager's; "
            f"{steps} decode steps: {warmups} warm-up, {captured} CUDA graph captured, "
            f"{steps - warmups - eager} replayed, {eager} without graphs"
        )
        ok &= same and captured == (1 if call == 0 else 0) and eager == 0
    print(cgcompile.compiled_graphs()[0].format_report())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
