"""Lower a requested CUDA-graph mode to what the graph's attention ops allow, with reasons.

Runs once per compiled graph, when its attention ops are known. Every change is returned as a
`Downgrade` (rule, from, to, cause) so the backend can log and report it; nothing is silent.

    res = resolve_cudagraph_mode(CUDAGraphMode.FULL, AttentionCGSupport.UNIFORM_BATCH,
                                 splits_attention=True)
    res.mode, res.reasons[0].rule   # FULL_AND_PIECEWISE, Rule.FULL_NEEDS_ALWAYS
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping

from cgcompile.config import AttentionCGSupport, CUDAGraphMode
from cgcompile.errors import ConfigError

FULL = CUDAGraphMode.FULL
FULL_DECODE_ONLY = CUDAGraphMode.FULL_DECODE_ONLY
NONE = CUDAGraphMode.NONE
PIECEWISE = CUDAGraphMode.PIECEWISE


class Rule(enum.Enum):
    """Why a mode or the capture sizes changed."""

    NO_GRAPH_RUNTIME = "no CUDA device and no simulated runtime: graphs are unavailable"
    NOT_ANALYSED = "the graph could not be analysed for what its graphs would change"
    ATTENTION_NOT_SPLIT = "attention below ALWAYS inside piecewise graphs: it must be split"
    NEEDS_AUTOGRAD = "outputs that require grad: graphs are for inference"
    FULL_NEEDS_ALWAYS = "FULL needs attention support ALWAYS"
    DECODE_NEEDS_SUPPORT = "full decode graphs need attention support above NEVER"
    SPEC_DECODE_NEEDS_UNIFORM_BATCH = "full decode graphs with q > 1 need UNIFORM_BATCH"
    NOTHING_SPLIT = "piecewise graphs need splitting ops, and none are configured"
    SIZES_ROUNDED_TO_Q = "full decode graphs with q > 1 need capture sizes that are multiples of q"


@dataclasses.dataclass(frozen=True)
class Downgrade:
    """One change resolution made: which rule lowered which mode to which, and why."""

    rule: Rule
    from_mode: CUDAGraphMode
    to_mode: CUDAGraphMode
    cause: str

    def __str__(self) -> str:
        return f"{self.from_mode} -> {self.to_mode} [{self.rule.name}]: {self.cause}"


@dataclasses.dataclass(frozen=True)
class Resolution:
    """The requested mode, the mode kept, every `Downgrade` between them, the capture sizes."""

    requested: CUDAGraphMode
    mode: CUDAGraphMode
    reasons: tuple[Downgrade, ...]
    capture_sizes: tuple[int, ...]


def resolve_cudagraph_mode(
    mode: CUDAGraphMode,
    attention_support: AttentionCGSupport,
    *,
    splits_attention: bool,
    piecewise_available: bool = True,
    graphs_available: bool = True,
    not_analysed: str | None = None,
    needs_autograd: bool = False,
    unsplit_attention: Mapping[str, AttentionCGSupport] | None = None,
    uniform_decode_query_len: int = 1,
    capture_sizes: tuple[int, ...] = (),
) -> Resolution:
    """Lower `mode` by these rules, in this order; each one that fires adds a `Downgrade`.

    1. `NO_GRAPH_RUNTIME`: no graph runtime (inputs not on a CUDA device, and
       `graph_runtime` is not 'simulated') -> NONE.
    2. `NOT_ANALYSED`: the fake run that finds which inputs the graph writes failed
       (`not_analysed` says why) -> NONE: the backend cannot promise eager's state.
    3. `NEEDS_AUTOGRAD`: the outputs require grad -> NONE.
    4. `FULL_NEEDS_ALWAYS`: FULL with attention support below ALWAYS -> FULL_AND_PIECEWISE
       when attention is split, else FULL_DECODE_ONLY (support NEVER raises `ConfigError`).
    5. `ATTENTION_NOT_SPLIT`: a mode with piecewise graphs, and an attention op below ALWAYS
       that no splitting op splits -> the mode without piecewise graphs (PIECEWISE -> NONE,
       FULL_AND_PIECEWISE -> FULL_DECODE_ONLY).
    6. `DECODE_NEEDS_SUPPORT`: full decode graphs with attention support NEVER -> PIECEWISE
       when attention is split, else NONE.
    7. `SPEC_DECODE_NEEDS_UNIFORM_BATCH`: full decode graphs, `uniform_decode_query_len` q > 1
       and support below UNIFORM_BATCH -> PIECEWISE when attention is split, else NONE.
    8. `NOTHING_SPLIT`: piecewise graphs but no splitting ops -> the mode without piecewise
       graphs (FULL_DECODE_ONLY becomes FULL when the support is ALWAYS).
    9. `SIZES_ROUNDED_TO_Q`: full decode graphs and q > 1 -> the mode stays; capture sizes are
       rounded up to multiples of q (`ConfigError` if q exceeds the largest).

    `splits_attention`: the graph is split at its attention ops (attention can run eagerly
    between pieces). `piecewise_available`: splitting ops are configured at all.
    `graphs_available`: a graph runtime exists for this graph's inputs. `needs_autograd`: the
    graph's outputs require grad (a replayed graph records no autograd history, so such graphs
    run without CUDA graphs). `unsplit_attention`: attention ops in the graph that no splitting
    op splits, with their support; piecewise graphs would capture them with every kind of
    batch, which needs ALWAYS.
    """
    state = _Lowering(mode)
    _lower_unavailable(state, graphs_available, not_analysed, needs_autograd)
    if state.mode == FULL and attention_support < AttentionCGSupport.ALWAYS:
        _check_not_never(attention_support)
        to = CUDAGraphMode.FULL_AND_PIECEWISE if splits_attention else FULL_DECODE_ONLY
        state.lower(Rule.FULL_NEEDS_ALWAYS, to, f"attention support is {attention_support}")
    _lower_unsplit(state, unsplit_attention or {})
    _lower_decode(state, attention_support, splits_attention, uniform_decode_query_len)
    if state.mode.requires_piecewise_compilation() and not piecewise_available:
        to = state.mode.without_piecewise()
        if to == FULL_DECODE_ONLY and attention_support == AttentionCGSupport.ALWAYS:
            to = FULL
        state.lower(Rule.NOTHING_SPLIT, to, "splitting_ops is empty")
    sizes = _decode_sizes(state, capture_sizes, uniform_decode_query_len)
    return Resolution(mode, state.mode, tuple(state.reasons), sizes)


def _lower_unavailable(
    state: _Lowering, graphs_available: bool, not_analysed: str | None, needs_autograd: bool
) -> None:
    """Rules 1-3: no runtime, no analysis or autograd outputs leave no graphs at all."""
    if state.mode != NONE and not graphs_available:
        state.lower(Rule.NO_GRAPH_RUNTIME, NONE, _NO_RUNTIME_CAUSE)
    if state.mode != NONE and not_analysed is not None:
        state.lower(Rule.NOT_ANALYSED, NONE, not_analysed)
    if state.mode != NONE and needs_autograd:
        state.lower(Rule.NEEDS_AUTOGRAD, NONE, _AUTOGRAD_CAUSE)


def _decode_sizes(state: _Lowering, capture_sizes: tuple[int, ...], q: int) -> tuple[int, ...]:
    """Rule 9: full decode graphs with q > 1 capture multiples of q."""
    if state.mode.decode_mode() != FULL or q <= 1:
        return capture_sizes
    sizes = round_sizes_to_multiple(capture_sizes, q)
    if sizes != capture_sizes:
        cause = f"{capture_sizes} -> {sizes}"
        state.reasons.append(Downgrade(Rule.SIZES_ROUNDED_TO_Q, state.mode, state.mode, cause))
    return sizes


class _Lowering:
    """The mode as the rules lower it, and every `Downgrade` so far."""

    def __init__(self, mode: CUDAGraphMode) -> None:
        self.mode = mode
        self.reasons: list[Downgrade] = []

    def lower(self, rule: Rule, to: CUDAGraphMode, cause: str) -> None:
        self.reasons.append(Downgrade(rule, self.mode, to, cause))
        self.mode = to


def _lower_unsplit(state: _Lowering, unsplit: Mapping[str, AttentionCGSupport]) -> None:
    """Piecewise graphs serve every kind of batch: attention inside them needs ALWAYS."""
    below = {name: s for name, s in unsplit.items() if s < AttentionCGSupport.ALWAYS}
    if not below or not state.mode.has_piecewise_cudagraphs():
        return
    ops = ", ".join(f"{name} ({support})" for name, support in sorted(below.items()))
    cause = (
        f"attention {ops} is not among splitting_ops, so piecewise graphs would capture it "
        f"with every kind of batch; add it to splitting_ops to keep piecewise graphs"
    )
    state.lower(Rule.ATTENTION_NOT_SPLIT, state.mode.without_piecewise(), cause)


def _lower_decode(
    state: _Lowering, support: AttentionCGSupport, splits_attention: bool, q: int
) -> None:
    """Full decode graphs hold attention: NEVER cannot be in one, q > 1 needs UNIFORM_BATCH."""
    lowered = PIECEWISE if splits_attention else NONE
    if state.mode.decode_mode() == FULL and support == AttentionCGSupport.NEVER:
        state.lower(Rule.DECODE_NEEDS_SUPPORT, lowered, "attention support is NEVER")
    if state.mode.decode_mode() == FULL and q > 1 and support < AttentionCGSupport.UNIFORM_BATCH:
        cause = f"q={q} and attention support is {support}"
        state.lower(Rule.SPEC_DECODE_NEEDS_UNIFORM_BATCH, lowered, cause)


_NO_RUNTIME_CAUSE = (
    "inputs are not on a CUDA device; move the model and inputs to CUDA, or on a CPU pass "
    "options={'graph_runtime': 'simulated'} for CUDA-graph semantics (tests)"
)
_AUTOGRAD_CAUSE = (
    "grad mode is on and an input or parameter requires grad, so its outputs require grad; "
    "this graph runs without CUDA graphs and gives eager's gradients. Run inference under "
    "torch.no_grad() or torch.inference_mode() to use graphs (torch.compile traces it apart)"
)


def _check_not_never(support: AttentionCGSupport) -> None:
    if support == AttentionCGSupport.NEVER:
        raise ConfigError(
            "cudagraph_mode=FULL, but an attention op in this graph has cudagraph support NEVER; "
            "use cudagraph_mode='PIECEWISE' so attention runs eagerly between graph pieces"
        )


def round_sizes_to_multiple(sizes: tuple[int, ...], q: int) -> tuple[int, ...]:
    """Round each size up to a multiple of q, drop those above the largest, de-duplicate."""
    if not sizes:
        return sizes
    largest = sizes[-1]
    rounded = sorted({r for r in (math.ceil(s / q) * q for s in sizes) if r <= largest})
    if rounded:
        return tuple(rounded)
    if q <= largest:
        return (q,)
    raise ConfigError(
        f"uniform_decode_query_len={q} exceeds max_cudagraph_capture_size={largest}; "
        f"raise the max to at least {q}"
    )
