"""A small Llama-style decoder whose batch dimension is the number of tokens.

`Llama(cfg)(tokens, positions)` maps N tokens and their positions (LongTensor[N] each) to
logits [N, vocab]. Each layer attends over a STATIC, read-only KV cache (random buffers
`k_cache`/`v_cache` filled once from a seed): the new tokens' keys and values are never written
into it, so the k/v projections of a real model are left out (they would be dead code) and
every output row depends only on its own token and position. Padding a batch with extra rows can
therefore never change the real rows, which is what CUDA-graph padding needs; see
`check_rows_independent`.

    model = Llama(LlamaConfig.tiny())
    logits = model(*make_inputs(model.cfg, 8, "cpu"))    # [8, 256]

Each layer exposes `pre_attention`, `attention` and `post_attention`, which `forward` uses, so
a benchmark can split the model at its SDPA calls by hand. Traceable with `dynamic=True` and with
an unbacked batch dim (`mark_unbacked`); on CUDA with torch <= 2.11 the latter also needs cuDNN
attention off (`torch.backends.cuda.enable_cudnn_sdp(False)`): its eligibility check asks N == 1.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    num_layers: int = 2
    hidden: int = 64
    heads: int = 4
    ffn: int = 128
    vocab: int = 256
    cache_len: int = 16
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def tiny(cls) -> LlamaConfig:
        """Fast on CPU: tests and the quickstart."""
        return cls()

    @classmethod
    def bench(cls) -> LlamaConfig:
        """The benchmark model: 16 layers, hidden 1024, 32k vocab (about 236M parameters)."""
        return cls(num_layers=16, hidden=1024, heads=16, ffn=2816, vocab=32000, cache_len=512)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class Rotary(nn.Module):
    """Rotary embedding; its cos/sin tables are buffers indexed by positions (< cache_len)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        half = cfg.head_dim // 2
        inv_freq = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.arange(cfg.cache_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angles.cos().float())
        self.register_buffer("sin", angles.sin().float())

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate the two halves of x [N, heads, head_dim] by each token's angles."""
        x1, x2 = x.float().chunk(2, dim=-1)
        c = self.cos[positions][:, None, :].float()
        s = self.sin[positions][:, None, :].float()
        return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).to(x.dtype)


class Layer(nn.Module):
    def __init__(self, cfg: LlamaConfig, rotary: Rotary) -> None:
        super().__init__()
        self.cfg = cfg
        self.rotary = rotary
        self.attn_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.wq = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.wo = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False)
        cache_shape = (1, cfg.heads, cfg.cache_len, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape))
        self.register_buffer("v_cache", torch.zeros(cache_shape))

    def pre_attention(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual, q): q is [1, heads, N, head_dim], rotated by each token's position."""
        q = self.wq(self.attn_norm(x)).view(-1, self.cfg.heads, self.cfg.head_dim)
        q = self.rotary(q, positions)
        return x, q.transpose(0, 1).unsqueeze(0)

    def attention(self, q: torch.Tensor) -> torch.Tensor:
        """Non-causal: every token attends over all cache_len cached positions."""
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache)

    def post_attention(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = residual + self.wo(attn.squeeze(0).transpose(0, 1).reshape(-1, self.cfg.hidden))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        residual, q = self.pre_attention(x, positions)
        return self.post_attention(residual, self.attention(q))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        rotary = Rotary(cfg)  # one module shared by every layer: one copy of the tables
        self.layers = nn.ModuleList(Layer(cfg, rotary) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.init_weights_(seed)

    @torch.no_grad()
    def init_weights_(self, seed: int = 0, std: float = 0.02) -> None:
        """Deterministic weights and caches from `seed`, drawn on CPU so every device agrees."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
        for layer in self.layers:
            layer.k_cache.copy_(torch.randn(layer.k_cache.shape, generator=g))
            layer.v_cache.copy_(torch.randn(layer.v_cache.shape, generator=g))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # A hint, not a branch: with an unbacked batch size, SDPA's backend choice asks N == 0.
        torch._check(tokens.shape[0] > 0)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, positions)
        return self.head(x)


def make_inputs(
    cfg: LlamaConfig,
    n: int,
    device: torch.device | str,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """N random non-zero tokens and positions in [0, cache_len), drawn on CPU then moved."""
    g = generator if generator is not None else torch.Generator().manual_seed(n)
    tokens = torch.randint(1, cfg.vocab, (n,), generator=g)
    positions = torch.randint(0, cfg.cache_len, (n,), generator=g)
    return tokens.to(device), positions.to(device)


@torch.no_grad()
def check_rows_independent(
    model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, atol: float = 1e-5
) -> None:
    """Raise unless each output row equals the model run on that row alone (padding is safe)."""
    batch = model(tokens, positions)
    for i in range(tokens.shape[0]):
        alone = model(tokens[i : i + 1], positions[i : i + 1])
        err = (batch[i : i + 1] - alone).abs().max().item()
        if err > atol:
            raise AssertionError(f"row {i} depends on other rows: max diff {err:.3g} > {atol}")
