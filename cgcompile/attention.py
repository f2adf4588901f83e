"""Which ops are attention, and how much of a CUDA graph each can live in.

Attention ops are the default splitting ops, and the lowest `AttentionCGSupport` among those
present in a graph decides which modes survive resolution. SDPA is declared ALWAYS. A library
with its own attention kernel declares it once, at import time:

    cgcompile.register_attention_op("mylib::paged_attention",
                                    cudagraph_support=AttentionCGSupport.UNIFORM_BATCH)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from cgcompile.config import AttentionCGSupport
from cgcompile.options import check_op_spec
from cgcompile.passes.op_match import OpMatcher, describe, op_names, spec_key

logger = logging.getLogger(__name__)

# Process-wide declarations, like torch's own op registry: written at import time by the
# libraries that define attention ops, read when a graph is compiled.
_REGISTRY: dict[str | Callable[..., Any], AttentionCGSupport] = {
    torch._C._nn.scaled_dot_product_attention: AttentionCGSupport.ALWAYS,
}


def register_attention_op(
    op: Any, cudagraph_support: AttentionCGSupport | str = AttentionCGSupport.NEVER
) -> None:
    """Declare `op` ("ns::op", an op object or a callable) as attention with its graph support.

    A declared op becomes a default splitting op (the graph is split around it, and it runs
    eagerly between piecewise graphs), is trusted to keep batch rows apart when padding is
    checked, and its `cudagraph_support` decides which modes survive. The default, NEVER,
    says it cannot run inside any CUDA graph: only piecewise graphs remain, with the op
    running eagerly between them (FULL_AND_PIECEWISE and FULL_DECODE_ONLY lower to PIECEWISE
    with a WARNING; `cudagraph_mode="FULL"` raises `ConfigError` when the graph compiles).
    Declare UNIFORM_SINGLE_TOKEN_DECODE, UNIFORM_BATCH or ALWAYS if the kernel can be
    captured. Re-declaring an op with another level logs a WARNING.
    """
    check_op_spec("register_attention_op: op", op)
    support = AttentionCGSupport.parse(cudagraph_support, "cudagraph_support")
    key = spec_key(op)
    previous = _REGISTRY.get(key)
    if previous is not None and previous != support:
        logger.warning("attention op %s re-declared: %s -> %s", key, previous, support)
    _REGISTRY[key] = support


def attention_ops() -> tuple[str | Callable[..., Any], ...]:
    """Every declared attention op: the default splitting ops."""
    return tuple(_REGISTRY)


def attention_support_of(target: Any) -> AttentionCGSupport | None:
    """The declared support of a call target, or None if it is not attention."""
    for key, support in _REGISTRY.items():
        if key is target or key in op_names(target):
            return support
    return None


def find_attention(targets: Iterable[Any]) -> dict[str, AttentionCGSupport]:
    """Attention ops among call targets, by readable name, with their support."""
    found = {}
    for target in targets:
        support = attention_support_of(target)
        if support is not None:
            found[describe(target)] = support
    return found


def is_split_at(matcher: OpMatcher, targets: Iterable[Any]) -> bool:
    """True when every attention op among `targets` is a splitting op of `matcher`."""
    attention = [t for t in targets if attention_support_of(t) is not None]
    return bool(attention) and all(matcher.matches_target(t) for t in attention)


def unsplit_attention(matcher: OpMatcher, targets: Iterable[Any]) -> dict[str, AttentionCGSupport]:
    """Attention ops among `targets` that `matcher` does not split, with their support: they
    would sit inside a captured piece."""
    return find_attention(t for t in targets if not matcher.matches_target(t))
