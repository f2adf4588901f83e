"""Which ops are attention, and how much of a CUDA graph each can live in.

Attention ops are the default splitting ops, and the lowest `AttentionCGSupport` among those
present in a graph decides which modes survive resolution. SDPA is declared ALWAYS. A library
with its own attention kernel declares it once, at import time:

    cgcompile.register_attention_op("mylib::paged_attention",
                                    cudagraph_support=AttentionCGSupport.UNIFORM_BATCH)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import fx

from cgcompile.config import AttentionCGSupport
from cgcompile.options import check_op_spec
from cgcompile.passes.op_match import OpMatcher, scan_calls, spec_key

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


def attention_support_of(target: Any, names: tuple[str, ...]) -> AttentionCGSupport | None:
    """The declared support of a call target (`names`: its `op_names`), or None if it is not
    attention."""
    for key, support in _REGISTRY.items():
        if key is target or key in names:
            return support
    return None


@dataclasses.dataclass(frozen=True)
class GraphOps:
    """What one pass over a graph's call targets found (`scan_ops`)."""

    attention: dict[str, AttentionCGSupport]
    """Attention ops among the calls, by readable name, with their support."""
    unsplit: dict[str, AttentionCGSupport]
    """Attention ops no splitting op splits, with their support: they would sit inside a
    captured piece."""
    unknown: list[str]
    """Splitting ops named by no call and unknown to torch: likely misspelt."""

    @property
    def splits_attention(self) -> bool:
        """The graph calls attention, and every attention op is a splitting op."""
        return bool(self.attention) and not self.unsplit


def scan_ops(gm: fx.GraphModule, matcher: OpMatcher, specs: Iterable[Any]) -> GraphOps:
    """The attention ops of `gm`'s calls and the misspelt names among `specs`, from one pass
    over its nodes (`matcher`: the splitting ops)."""
    calls, unknown = scan_calls(gm, matcher, specs)
    attention: dict[str, AttentionCGSupport] = {}
    unsplit: dict[str, AttentionCGSupport] = {}
    for call in calls:
        support = attention_support_of(call.target, call.names)
        if support is not None:
            attention[call.readable] = support
            if not call.matched:
                unsplit[call.readable] = support
    return GraphOps(attention, unsplit, unknown)
