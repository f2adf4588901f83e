"""resolve_cudagraph_mode: one row per DESIGN §3 rule, then invariants over every input."""

from __future__ import annotations

from itertools import pairwise
from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgcompile.backend.resolution import Resolution, Rule, resolve_cudagraph_mode
from cgcompile.config import AttentionCGSupport, CUDAGraphMode
from cgcompile.errors import ConfigError

NONE = CUDAGraphMode.NONE
PIECEWISE = CUDAGraphMode.PIECEWISE
FULL = CUDAGraphMode.FULL
FDO = CUDAGraphMode.FULL_DECODE_ONLY
FAP = CUDAGraphMode.FULL_AND_PIECEWISE

NEVER = AttentionCGSupport.NEVER
SINGLE = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
UNIFORM = AttentionCGSupport.UNIFORM_BATCH
ALWAYS = AttentionCGSupport.ALWAYS

R_FULL = Rule.FULL_NEEDS_ALWAYS
R_DECODE = Rule.DECODE_NEEDS_SUPPORT
R_SPEC = Rule.SPEC_DECODE_NEEDS_UNIFORM_BATCH
R_SPLIT = Rule.NOTHING_SPLIT


class Row(NamedTuple):
    rule: str
    mode: CUDAGraphMode
    support: AttentionCGSupport
    split: bool
    piecewise: bool
    q: int
    expected: CUDAGraphMode
    rules: tuple[Rule, ...]


ROWS = [
    Row("none-stays-none", NONE, NEVER, False, False, 2, NONE, ()),
    Row("full-with-always-stays-full", FULL, ALWAYS, True, True, 1, FULL, ()),
    Row("full-needs-always/split", FULL, UNIFORM, True, True, 1, FAP, (R_FULL,)),
    Row("full-needs-always/unsplit", FULL, SINGLE, False, True, 1, FDO, (R_FULL,)),
    Row("decode-never/fdo-split", FDO, NEVER, True, True, 1, PIECEWISE, (R_DECODE,)),
    Row("decode-never/fdo-unsplit", FDO, NEVER, False, True, 1, NONE, (R_DECODE,)),
    Row("decode-never/fap-split", FAP, NEVER, True, True, 1, PIECEWISE, (R_DECODE,)),
    Row("decode-never/fap-unsplit", FAP, NEVER, False, True, 1, NONE, (R_DECODE,)),
    Row("spec-decode/fdo-split", FDO, SINGLE, True, True, 2, PIECEWISE, (R_SPEC,)),
    Row("spec-decode/fap-unsplit", FAP, SINGLE, False, True, 3, NONE, (R_SPEC,)),
    Row("spec-decode/full-via-fap", FULL, SINGLE, True, True, 2, PIECEWISE, (R_FULL, R_SPEC)),
    Row("spec-decode/uniform-batch-keeps-fdo", FDO, UNIFORM, False, True, 4, FDO, ()),
    Row("nothing-split/piecewise", PIECEWISE, ALWAYS, False, False, 1, NONE, (R_SPLIT,)),
    Row("nothing-split/fap-always", FAP, ALWAYS, False, False, 1, FULL, (R_SPLIT,)),
    Row("nothing-split/fap-uniform", FAP, UNIFORM, False, False, 1, FDO, (R_SPLIT,)),
    Row("nothing-split/fap-single", FAP, SINGLE, False, False, 1, FDO, (R_SPLIT,)),
    Row("nothing-split/fdo-unaffected", FDO, SINGLE, False, False, 1, FDO, ()),
    Row("nothing-split/full-via-fap", FULL, UNIFORM, True, False, 1, FDO, (R_FULL, R_SPLIT)),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.rule for row in ROWS])
def test_rule(row: Row) -> None:
    res = resolve_cudagraph_mode(
        row.mode,
        row.support,
        splits_attention=row.split,
        piecewise_available=row.piecewise,
        uniform_decode_query_len=row.q,
    )
    assert (res.requested, res.mode) == (row.mode, row.expected)
    assert tuple(r.rule for r in res.reasons) == row.rules


@pytest.mark.parametrize("split", [True, False], ids=["split", "unsplit"])
def test_full_with_never_raises_suggesting_piecewise(split: bool) -> None:
    with pytest.raises(ConfigError, match="PIECEWISE"):
        resolve_cudagraph_mode(FULL, NEVER, splits_attention=split)


@pytest.mark.parametrize(
    ("mode", "support"),
    [(FDO, UNIFORM), (FAP, ALWAYS), (FULL, ALWAYS)],
    ids=["fdo-uniform", "fap-always", "full-always"],
)
def test_sizes_rounded_to_multiples_of_q(mode: CUDAGraphMode, support: AttentionCGSupport) -> None:
    res = resolve_cudagraph_mode(
        mode, support, splits_attention=True, uniform_decode_query_len=3, capture_sizes=(1, 2, 4, 8)
    )
    assert res.mode == mode
    assert res.capture_sizes == (3, 6)
    assert [r.rule for r in res.reasons] == [Rule.SIZES_ROUNDED_TO_Q]


@pytest.mark.parametrize(
    ("mode", "q"), [(FDO, 1), (FULL, 1), (PIECEWISE, 3), (NONE, 3)], ids=lambda x: str(x)
)
def test_sizes_kept_without_full_decode_graphs_of_q_above_one(mode: CUDAGraphMode, q: int) -> None:
    res = resolve_cudagraph_mode(
        mode, ALWAYS, splits_attention=True, uniform_decode_query_len=q, capture_sizes=(1, 2, 4, 8)
    )
    assert res.capture_sizes == (1, 2, 4, 8)
    assert res.reasons == ()


def test_sizes_already_multiples_of_q_give_no_reason() -> None:
    res = resolve_cudagraph_mode(
        FDO, UNIFORM, splits_attention=False, uniform_decode_query_len=2, capture_sizes=(2, 4, 8)
    )
    assert res.capture_sizes == (2, 4, 8)
    assert res.reasons == ()


@pytest.mark.parametrize("mode", [PIECEWISE, FULL, FDO, FAP], ids=lambda m: m.name)
def test_graphs_unavailable_gives_none(mode: CUDAGraphMode) -> None:
    res = resolve_cudagraph_mode(mode, ALWAYS, splits_attention=True, graphs_available=False)
    assert res.mode == NONE
    assert [r.rule for r in res.reasons] == [Rule.NO_GRAPH_RUNTIME]


@pytest.mark.parametrize("mode", [PIECEWISE, FULL, FDO, FAP], ids=lambda m: m.name)
def test_outputs_needing_autograd_give_none(mode: CUDAGraphMode) -> None:
    res = resolve_cudagraph_mode(mode, ALWAYS, splits_attention=True, needs_autograd=True)
    assert res.mode == NONE
    assert [r.rule for r in res.reasons] == [Rule.NEEDS_AUTOGRAD]
    assert "torch.no_grad()" in res.reasons[0].cause


def test_downgrade_cause_names_the_support_level() -> None:
    res = resolve_cudagraph_mode(FULL, UNIFORM, splits_attention=True)
    assert "UNIFORM_BATCH" in res.reasons[0].cause
    assert "FULL -> FULL_AND_PIECEWISE" in str(res.reasons[0])


# ---- invariants over all modes x supports x splits x piecewise_available x q --------------

# 5 modes x 4 supports x 2 x 2 x 4 q = 320 inputs: enough examples to try them all
exhaustive = settings(max_examples=500)
inputs = st.tuples(
    st.sampled_from(list(CUDAGraphMode)),
    st.sampled_from(list(AttentionCGSupport)),
    st.booleans(),
    st.booleans(),
    st.integers(1, 4),
)


def _resolve(args: tuple) -> Resolution | None:
    """The resolution, or None for the one documented error: FULL with NEVER support."""
    mode, support, split, piecewise, q = args
    try:
        return resolve_cudagraph_mode(
            mode,
            support,
            splits_attention=split,
            piecewise_available=piecewise,
            uniform_decode_query_len=q,
            capture_sizes=(1, 2, 4, 8),
        )
    except ConfigError:
        assert (mode, support) == (FULL, NEVER)
        return None


@exhaustive
@given(inputs)
def test_never_raises_except_full_with_never(args: tuple) -> None:
    mode, support = args[:2]
    assert (_resolve(args) is None) == ((mode, support) == (FULL, NEVER))


@exhaustive
@given(inputs)
def test_result_needs_no_more_support_than_given(args: tuple) -> None:
    res = _resolve(args)
    if res is not None:
        support, q = args[1], args[4]
        assert res.mode.min_attention_support(q) <= support


@exhaustive
@given(inputs)
def test_result_needs_no_piecewise_when_nothing_split(args: tuple) -> None:
    res = _resolve(args)
    piecewise_available = args[3]
    if res is not None and not piecewise_available:
        assert not res.mode.requires_piecewise_compilation()


@exhaustive
@given(inputs)
def test_reasons_chain_from_requested_to_result(args: tuple) -> None:
    res = _resolve(args)
    if res is None:
        return
    if res.requested != res.mode:
        assert res.reasons
    if res.reasons:
        assert res.reasons[0].from_mode == res.requested
        assert res.reasons[-1].to_mode == res.mode
        for before, after in pairwise(res.reasons):
            assert before.to_mode == after.from_mode
