"""Decode steps of the three model families behind one call, `step(tokens, positions) -> logits`
(`tokens` and `positions` of shape `[B]`, logits `[B, vocab]`), for loops that feed each step's
argmax back as the next tokens:

- `llama`: the example Llama (`examples/llama.py`: one shared context, KV cache written with
  `index_copy_`);
- `rows`: each request writes its KV cache row in place at `arange(B)` and attends with a
  boolean mask (`_rows_model.py`);
- `hf-llama`, `hf-qwen3`: `HFStep`, a module around a Hugging Face causal LM built from a config
  that keeps one `StaticCache` per batch size and calls the model with keywords, returning the
  last position's logits: the decode step a user compiles (its compiled call takes tensors only,
  so `cgcompile.trusted` and `guarded` can bind it).

`build(family, layers, hidden, device, dtype)` gives a `StepModel`: the module, fresh inputs of
n rows (`inputs(n)`), the next step's positions, how cgcompile peers mark the batch, and
`rewind(module)`, which empties a Hugging Face step's caches in place (a `StaticCache` writes at
its own counter and must not run past its length) before a loop starts at position 0.

    sm = build("hf-llama", layers=16, hidden=1024, device="cuda", dtype=torch.bfloat16)
    tokens, positions = sm.inputs(8)
    logits = sm.model(tokens, positions)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import cgcompile
from benchmarks._rows_model import RowsConfig, RowsLlama, rows_inputs
from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch

FAMILIES = ("llama", "rows", "hf-llama", "hf-qwen3")
CACHE_LEN = 256


class HFStep(nn.Module):
    """A Hugging Face causal LM's decode step on a `StaticCache` per batch size in `sizes`."""

    def __init__(self, lm: nn.Module, sizes: tuple[int, ...], cache_len: int) -> None:
        super().__init__()
        import transformers

        self.lm = lm
        self.caches = {
            n: transformers.StaticCache(config=lm.config, max_cache_len=cache_len) for n in sizes
        }
        device = next(lm.parameters()).device
        with torch.no_grad():  # the caches' tensors are made by a first (eager) call
            for n in sizes:
                zeros = torch.zeros(n, dtype=torch.long, device=device)
                self(zeros + 1, zeros)
        self.rewind()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.lm(
            input_ids=tokens[:, None],
            position_ids=positions[:, None],
            cache_position=positions[:1],
            past_key_values=self.caches[tokens.shape[0]],
            use_cache=True,
        )
        return out.logits[:, -1]

    def rewind(self) -> None:
        for cache in self.caches.values():
            cache.reset()  # in place: captured graphs keep their addresses


@dataclasses.dataclass
class StepModel:
    family: str
    model: nn.Module
    inputs: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    """inputs(n): random tokens of n rows and their positions (0 for a Hugging Face step)."""
    cache_len: int
    mark: Callable[[torch.Tensor, torch.Tensor, int | None], None]
    """mark(tokens, positions, hint): the batch marks a cgcompile peer gives a tracing call."""

    def advance(self, positions: torch.Tensor) -> torch.Tensor:
        return (positions + 1) % self.cache_len


def rewind(model: Any) -> None:
    """Empty a Hugging Face step's caches (a no-op for the other families)."""
    if isinstance(model, HFStep):
        model.rewind()


def build(family: str, layers: int, hidden: int, device: str, dtype: torch.dtype) -> StepModel:
    heads, ffn, vocab = max(hidden // 64, 1), hidden * 11 // 4, 32000
    if family == "llama":
        cfg = LlamaConfig(num_layers=layers, hidden=hidden, heads=heads, ffn=ffn, vocab=vocab)
        return StepModel(
            family,
            Llama(cfg).to(device, dtype).eval(),
            lambda n: make_inputs(cfg, n, device),
            cfg.cache_len,
            lambda t, p, hint: mark_batch(cfg, t, p, hint=hint),
        )
    if family == "rows":
        rcfg = RowsConfig(layers, hidden, heads, ffn, vocab, rows=16, cache_len=CACHE_LEN)
        return StepModel(
            family,
            RowsLlama(rcfg).to(device, dtype).eval(),
            lambda n: rows_inputs(rcfg, n, device),
            rcfg.cache_len,
            lambda t, p, hint: cgcompile.mark_dynamic_batch(t, p, hint=hint),
        )
    import transformers

    arch = {"hf-llama": "Llama", "hf-qwen3": "Qwen3"}[family]
    config = getattr(transformers, f"{arch}Config")(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 2, 1),
        vocab_size=vocab,
        max_position_embeddings=CACHE_LEN,
    )
    torch.manual_seed(0)
    lm = getattr(transformers, f"{arch}ForCausalLM")(config).to(device, dtype).eval()
    step = HFStep(lm, (1, 2, 4, 8), CACHE_LEN)
    generator = torch.Generator().manual_seed(0)

    def inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(1, vocab, (n,), generator=generator).to(device)
        return tokens, torch.zeros(n, dtype=torch.long, device=device)

    # not marked: each batch size has a cache of its own, so each traces on its own
    return StepModel(family, step, inputs, CACHE_LEN, lambda t, p, hint: None)
