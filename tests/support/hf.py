"""Hugging Face `generate()` as a real client: greedy tokens through the backend against eager.

Two ways a user compiles a HF model: `generate(..., cache_implementation="static",
compile_config=CompileConfig(backend="cudagraph_modes", ...))`, where HF compiles the decode
step and writes a static KV cache and its length counter inside the graph; and
`model.forward = torch.compile(model.forward, backend=...)` with the default dynamic cache.
"""

from __future__ import annotations

import torch

PATHS = ["static-cache", "compiled-forward"]


VOCAB = 96


def tiny_llama(device: str, dtype: torch.dtype = torch.float32, arch: str = "Llama"):
    """A 2-layer `{arch}ForCausalLM` (Llama, Qwen3, ...) built from a config, seeded."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{arch}Config")(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return getattr(transformers, f"{arch}ForCausalLM")(config).to(device, dtype).eval()


def generate_tokens(
    path: str, options: dict, *, device: str, new_tokens: int = 6
) -> tuple[torch.Tensor, torch.Tensor]:
    """(compiled tokens, eager tokens) for a batch of 2 prompts of 5 tokens, greedy."""
    from transformers import CompileConfig

    model = tiny_llama(device)
    prompts = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(0)).to(device)
    kwargs = {"max_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 0}
    if path == "static-cache":
        kwargs["cache_implementation"] = "static"
        want = model.generate(prompts, **kwargs)
        config = CompileConfig(backend="cudagraph_modes", mode=None, options=options)
        config._compile_all_devices = True  # HF compiles only on accelerators otherwise
        got = model.generate(prompts, compile_config=config, **kwargs)
    else:
        want = model.generate(prompts, **kwargs)
        model.forward = torch.compile(model.forward, backend="cudagraph_modes", options=options)
        got = model.generate(prompts, **kwargs)
    return got, want
