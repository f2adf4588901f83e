"""Test-only attention ops with closed-form results and a call counter.

`silly::attention(q, k, v, out)` writes `out = q + k + v` in place, like a real attention op
writing into a buffer the previous piece allocated. `silly::attention_fresh(q, k, v)` returns a
new tensor instead, the case that breaks naive piecewise graphs. `silly::attention_columns(q)`
returns `3q` laid out column-major, as CUDA's SDPA returns a non-contiguous output. Each adds 1
to `CALLS["n"]`.
"""

from __future__ import annotations

import torch

CALLS = {"n": 0}


@torch.library.custom_op("silly::attention", mutates_args=("out",))
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    CALLS["n"] += 1
    out.copy_(q + k + v)


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    return None


@torch.library.custom_op("silly::attention_fresh", mutates_args=())
def attention_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    CALLS["n"] += 1
    return q + k + v


@attention_fresh.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("silly::attention_columns", mutates_args=())
def attention_columns(q: torch.Tensor) -> torch.Tensor:
    CALLS["n"] += 1
    return (q * 3).t().contiguous().t()


@attention_columns.register_fake
def _(q: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(q.shape, (1, q.shape[0]), dtype=q.dtype, device=q.device)


def register_as_attention(support: str = "ALWAYS") -> None:
    """Declare the silly ops as attention (default splitting ops) with the given support."""
    import cgcompile

    for op in ("attention", "attention_fresh", "attention_columns"):
        cgcompile.register_attention_op(f"silly::{op}", cudagraph_support=support)


register_as_attention()
