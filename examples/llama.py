"""A small Llama-style decoder whose batch dimension is the number of tokens, with a KV cache
written in place every step, as a real one.

`Llama(cfg)(tokens, positions)` maps N tokens and their positions (LongTensor[N] each, distinct
positions in [0, cache_len)) to logits [N, vocab]. Each layer projects q, k and v, writes the
new tokens' rotated keys and values into its KV cache buffers (`k_cache`/`v_cache`, random from
a seed) at their positions (`index_copy_`), then every token attends over all `cache_len` cached
positions (non-causal: a context window shared by the batch). The caches have one more slot,
`cache_len`, that no token reads: the trash slot where padded rows write. Declare it when the
batch is marked dynamic, so padding to a capture size never writes a slot eager would not:

    model = Llama(LlamaConfig.tiny())
    tokens, positions = make_inputs(model.cfg, 8, "cpu")
    mark_batch(model.cfg, tokens, positions)   # dynamic batch; padded rows write the trash slot
    logits = compiled(tokens, positions)       # [8, 256]; the caches now hold the 8 new entries

Each layer exposes `pre_attention` (projections and cache write), `attention` and
`post_attention`, which `forward` uses, so a benchmark can split the model at its SDPA calls by
hand. Traceable with `dynamic=True` and with an unbacked batch dim (`mark_unbacked`); on CUDA
with torch <= 2.11 the latter also needs cuDNN attention off
(`torch.backends.cuda.enable_cudnn_sdp(False)`): its eligibility check asks N == 1.

`python examples/llama.py` compiles the tiny model, runs padded decode steps and checks logits
and caches against an eager copy.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import cgcompile


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    num_layers: int = 2
    hidden: int = 64
    heads: int = 4
    ffn: int = 128
    vocab: int = 256
    cache_len: int = 1024
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def trash_slot(self) -> int:
        """The cache slot no token reads: the position padded rows should carry."""
        return self.cache_len

    @classmethod
    def tiny(cls) -> LlamaConfig:
        """Fast on CPU: tests and the quickstart."""
        return cls()

    @classmethod
    def bench(cls) -> LlamaConfig:
        """The benchmark model: 16 layers, hidden 1024, 32k vocab (about 270M parameters), a
        2048-token context."""
        return cls(num_layers=16, hidden=1024, heads=16, ffn=2816, vocab=32000, cache_len=2048)


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
    """Rotary embedding; its cos/sin tables are buffers indexed by positions (<= cache_len)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        half = cfg.head_dim // 2
        inv_freq = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.arange(cfg.cache_len + 1, dtype=torch.float64)[:, None] * inv_freq[None, :]
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
        self.wk = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.wo = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False)
        cache_shape = (1, cfg.heads, cfg.cache_len + 1, cfg.head_dim)  # + the trash slot
        self.register_buffer("k_cache", torch.zeros(cache_shape))
        self.register_buffer("v_cache", torch.zeros(cache_shape))

    def pre_attention(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual, q): q is [1, heads, N, head_dim], rotated by each token's position; the
        tokens' rotated keys and values are written into the caches at their positions."""
        h = self.attn_norm(x)
        q, k = (self.rotary(self._heads(w(h)), positions) for w in (self.wq, self.wk))
        for cache, new in ((self.k_cache, k), (self.v_cache, self._heads(self.wv(h)))):
            cache.index_copy_(2, positions, new.transpose(0, 1).unsqueeze(0))
        return x, q.transpose(0, 1).unsqueeze(0)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(-1, self.cfg.heads, self.cfg.head_dim)

    def attention(self, q: torch.Tensor) -> torch.Tensor:
        """Non-causal: every token attends over all cache_len cached positions (not the trash
        slot)."""
        n = self.cfg.cache_len
        return F.scaled_dot_product_attention(q, self.k_cache[:, :, :n], self.v_cache[:, :, :n])

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
    """N random non-zero tokens and N distinct positions in [0, cache_len) (two tokens of one
    step never write the same cache slot), drawn on CPU then moved."""
    if n > cfg.cache_len:
        raise ValueError(f"{n} tokens need distinct positions, but cache_len is {cfg.cache_len}")
    g = generator if generator is not None else torch.Generator().manual_seed(n)
    tokens = torch.randint(1, cfg.vocab, (n,), generator=g)
    positions = torch.randperm(cfg.cache_len, generator=g)[:n]
    return tokens.to(device), positions.to(device)


def mark_batch(cfg: LlamaConfig, tokens: torch.Tensor, positions: torch.Tensor, **kwargs) -> None:
    """Mark the batch dim of both inputs dynamic (`kwargs`: `unbacked`, `hint`) and declare the
    trash slot as the position of padded rows, so their cache writes land where no token reads.
    """
    cgcompile.mark_dynamic_batch(tokens, **kwargs)
    cgcompile.mark_dynamic_batch(positions, pad_value=cfg.trash_slot, **kwargs)


def _read_slots(model: Llama) -> torch.Tensor:
    """Every KV-cache slot a token reads, flattened: all but the trash slot."""
    n = model.cfg.cache_len
    caches = [c for layer in model.layers for c in (layer.k_cache, layer.v_cache)]
    return torch.cat([c[:, :, :n].flatten() for c in caches])


def main() -> int:
    """Compile the tiny model, run decode batches that are padded to a capture size, and check
    logits and KV caches against an eager copy: padded rows write only the trash slot."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    options = {"cudagraph_mode": "FULL_AND_PIECEWISE", "max_cudagraph_capture_size": 16}
    if device == "cpu":  # simulated CUDA graphs; pieces run eagerly (no C++ build of Inductor)
        options |= {"graph_runtime": "simulated", "compiler": "eager"}
    cfg = LlamaConfig.tiny()
    model, reference = Llama(cfg).to(device).eval(), Llama(cfg).to(device).eval()
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    ok = True
    with torch.inference_mode():
        for step in range(4):  # 6 tokens pad to the capture size 8: 2 padded rows per call
            tokens, positions = make_inputs(cfg, 6, device, torch.Generator().manual_seed(step))
            mark_batch(cfg, tokens, positions)
            with cgcompile.batch_hint(uniform_decode=True):  # 6 requests, one token each
                got = compiled(tokens, positions)
            ok &= torch.allclose(got, reference(tokens, positions), rtol=1e-4, atol=1e-4)
    ok &= torch.allclose(_read_slots(model), _read_slots(reference), rtol=1e-4, atol=1e-4)
    verdict = "equal" if ok else "DIFFER from"
    print(f"4 decode steps of 6 tokens on {device}: logits and KV caches {verdict} eager's")
    print(cgcompile.compiled_graphs()[-1].format_report())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
