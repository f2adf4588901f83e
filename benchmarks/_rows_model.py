"""A decode step that writes its KV cache in place at index rows and calls SDPA with a mask.

Unlike the example Llama (one shared context, tokens as rows), each of B requests owns one row
of every layer's cache, `k_cache[R + 1, heads, L, head_dim]`, and a decode step writes each
request's new key and value at its row and position (`k_cache[rows, :, pos] = k`, `rows =
arange(B)`), then attends over its row with a boolean mask of the positions written so far.
Row R is spare: `rows` of padded requests may point there. Inputs: `tokens[B]`, `pos[B]`.

    model = RowsLlama(RowsConfig.bench()).cuda().bfloat16().eval()
    logits = model(tokens, pos)        # [B, vocab]; every layer's cache rows 0..B-1 written
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class RowsConfig:
    num_layers: int = 2
    hidden: int = 64
    heads: int = 4
    ffn: int = 128
    vocab: int = 256
    rows: int = 16
    cache_len: int = 64

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def bench(cls) -> RowsConfig:
        """16 layers, hidden 1024 as the example Llama; 512 request rows of 256 positions."""
        return cls(16, 1024, 16, 2816, 32000, rows=512, cache_len=256)


class RowsLayer(nn.Module):
    def __init__(self, cfg: RowsConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm1, self.norm2 = nn.RMSNorm(cfg.hidden), nn.RMSNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.wo = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.hidden, 2 * cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)
        shape = (cfg.rows + 1, cfg.heads, cfg.cache_len, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape))
        self.register_buffer("v_cache", torch.zeros(shape))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cfg, b = self.cfg, x.shape[0]
        torch._check(b <= cfg.rows)  # the batch fits the cache: `k_cache[:b]` of an unbacked b
        q, k, v = self.qkv(self.norm1(x)).view(b, 3, cfg.heads, cfg.head_dim).unbind(1)
        rows = torch.arange(b, device=x.device)
        self.k_cache[rows, :, pos] = k
        self.v_cache[rows, :, pos] = v
        mask = (torch.arange(cfg.cache_len, device=x.device) <= pos[:, None])[:, None, None, :]
        att = F.scaled_dot_product_attention(
            q[:, :, None], self.k_cache[:b], self.v_cache[:b], attn_mask=mask
        )
        x = x + self.wo(att.reshape(b, cfg.hidden))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class RowsLlama(nn.Module):
    def __init__(self, cfg: RowsConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(RowsLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02 + (p.dim() == 1))
            for layer in self.layers:
                layer.k_cache.normal_(generator=g)
                layer.v_cache.normal_(generator=g)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, pos)
        return self.lm_head(self.norm(x))


def rows_inputs(
    cfg: RowsConfig, n: int, device: torch.device | str, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and positions of n requests (random, non-zero), drawn on CPU then moved."""
    g = torch.Generator().manual_seed(seed + n)
    tokens = torch.randint(1, cfg.vocab, (n,), generator=g)
    pos = torch.randint(0, cfg.cache_len, (n,), generator=g)
    return tokens.to(device), pos.to(device)
