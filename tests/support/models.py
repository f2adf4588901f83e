"""Small models for backend tests, with closed forms where possible."""

from __future__ import annotations

import torch
from torch import nn

import tests.support.silly  # noqa: F401  (registers silly::attention*)


def silly_model(x: torch.Tensor) -> torch.Tensor:
    """x+1, x+2, attn, x-2, x-1, attn, x+1 with attn(q, k, v) = q + k + v: net 9x + 19... see
    `silly_closed_form`."""
    x = x + 1
    x = x + 2
    out = torch.empty_like(x)
    torch.ops.silly.attention(x, x, x, out)
    x = out - 2
    x = x - 1
    out2 = torch.empty_like(x)
    torch.ops.silly.attention(x, x, x, out2)
    return out2 + 1


def silly_closed_form(x: torch.Tensor) -> torch.Tensor:
    # a = 3(x + 3); b = 3(a - 3) = 9x + 18; result b + 1
    return 9 * x + 19


def fresh_model(x: torch.Tensor) -> torch.Tensor:
    """An attention op that returns a fresh tensor between two pieces."""
    h = x * 2 + 1
    a = torch.ops.silly.attention_fresh(h, h, h)
    return a.relu() - 1


class SeqModel(nn.Module):
    """Inputs [batch, seq, dim]; SDPA over the sequence; output [batch, dim]."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).unsqueeze(1)
        a = torch.nn.functional.scaled_dot_product_attention(h, h, h).squeeze(1)
        return self.out(a).sum(dim=1)


MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


def dyn(*tensors: torch.Tensor):
    """Mark the batch dim of each tensor dynamic and unbacked (one trace for every size, batch 1
    included, which the tests count on: torch >= 2.11, `@needs(SHARED_UNBACKED_BATCH)`); return
    them (one tensor bare)."""
    import cgcompile

    cgcompile.mark_dynamic_batch(*tensors, unbacked=True)
    return tensors if len(tensors) > 1 else tensors[0]


class CacheStep(nn.Module):
    """A decode step that keeps state as real models do: it counts its calls in a buffer,
    writes each row's key into a KV cache at the row's slot (slot `SLOTS` is a trash slot that
    no row reads, for padded rows) and attends (SDPA) over the live slots. Rows are independent.
    """

    SLOTS = 16

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("cache", torch.zeros(self.SLOTS + 1, dim))

    def forward(self, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        k = self.proj(x)
        self.cache.index_copy_(0, slot, k)
        live = self.cache[None, : self.SLOTS]
        return torch.nn.functional.scaled_dot_product_attention(k[None], live, live)[0]


class Block(nn.Module):
    """A linear layer, then SDPA with each row its own sequence: rows stay independent."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).unsqueeze(1)
        return torch.nn.functional.scaled_dot_product_attention(h, h, h).squeeze(1)
