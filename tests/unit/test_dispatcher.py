"""CudagraphDispatcher: the DESIGN §4 table, key sets, capture order, padding properties."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cgcompile.calls.dispatcher import CudagraphDispatcher
from cgcompile.calls.forward_context import BatchDescriptor as BD
from cgcompile.config import CompilationConfig, CUDAGraphMode
from cgcompile.errors import CGCompileError, ConfigError

NONE = CUDAGraphMode.NONE
PIECEWISE = CUDAGraphMode.PIECEWISE
FULL = CUDAGraphMode.FULL
FDO = CUDAGraphMode.FULL_DECODE_ONLY
FAP = CUDAGraphMode.FULL_AND_PIECEWISE
GRAPH_MODES = [PIECEWISE, FULL, FDO, FAP]


def make_dispatcher(
    mode: CUDAGraphMode,
    sizes: Sequence[int] = (1, 8),
    max_num_reqs: int | None = 8,
    q: int = 1,
) -> CudagraphDispatcher:
    config = CompilationConfig(
        cudagraph_mode=mode,
        cudagraph_capture_sizes=tuple(sorted(sizes)),
        max_cudagraph_capture_size=max(sizes),
        max_num_reqs=max_num_reqs,
    )
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(mode, q)
    return dispatcher


# ---- the table: capture sizes [1, 8], max_num_reqs=8, q=1 ---------------------------------

MIXED_8 = [
    (FULL, (FULL, BD(8, num_reqs=8))),
    (PIECEWISE, (PIECEWISE, BD(8, None, False))),
    (FAP, (PIECEWISE, BD(8, None, False))),
    (FDO, (NONE, BD(8))),
    (NONE, (NONE, BD(8))),
]
UNIFORM_8 = [
    (FULL, (FULL, BD(8, 8, uniform=False))),
    (FDO, (FULL, BD(8, 8, uniform=True))),
    (FAP, (FULL, BD(8, 8, uniform=True))),
    (PIECEWISE, (PIECEWISE, BD(8, None, False))),
    (NONE, (NONE, BD(8))),
]


@pytest.mark.parametrize(("mode", "expected"), MIXED_8, ids=[m.name for m, _ in MIXED_8])
def test_mixed_batch_of_8(mode: CUDAGraphMode, expected: tuple) -> None:
    assert make_dispatcher(mode).dispatch(8, uniform_decode=False) == expected


@pytest.mark.parametrize(("mode", "expected"), UNIFORM_8, ids=[m.name for m, _ in UNIFORM_8])
def test_uniform_batch_of_8(mode: CUDAGraphMode, expected: tuple) -> None:
    assert make_dispatcher(mode).dispatch(8, uniform_decode=True) == expected


@pytest.mark.parametrize("uniform", [False, True], ids=["mixed", "uniform"])
@pytest.mark.parametrize("mode", list(CUDAGraphMode), ids=lambda m: m.name)
def test_above_largest_size_runs_eager_unpadded(mode: CUDAGraphMode, uniform: bool) -> None:
    assert make_dispatcher(mode).dispatch(15, uniform_decode=uniform) == (NONE, BD(15))


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (FULL, (NONE, BD(8))),
        (FDO, (NONE, BD(8))),
        (FAP, (PIECEWISE, BD(8, None, False))),
        (PIECEWISE, (PIECEWISE, BD(8, None, False))),
    ],
    ids=lambda x: x.name if isinstance(x, CUDAGraphMode) else "",
)
def test_invalid_full_relaxes_to_piecewise_else_none(mode: CUDAGraphMode, expected: tuple) -> None:
    got = make_dispatcher(mode).dispatch(8, uniform_decode=True, invalid_modes={FULL})
    assert got == expected


@pytest.mark.parametrize("mode", GRAPH_MODES, ids=lambda m: m.name)
def test_valid_modes_none_only_runs_eager(mode: CUDAGraphMode) -> None:
    got = make_dispatcher(mode).dispatch(8, uniform_decode=True, valid_modes={NONE})
    assert got == (NONE, BD(8))


def test_no_allowed_mode_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no runtime mode left"):
        make_dispatcher(FULL).dispatch(8, valid_modes={FULL}, invalid_modes={FULL})


def test_no_graph_and_none_forbidden_is_an_error() -> None:
    with pytest.raises(CGCompileError, match="add NONE to valid_modes"):
        make_dispatcher(FULL).dispatch(15, valid_modes={FULL})


def test_dispatch_before_initialization_runs_eager() -> None:
    config = CompilationConfig(cudagraph_capture_sizes=(1, 8), max_cudagraph_capture_size=8)
    assert CudagraphDispatcher(config).dispatch(5) == (NONE, BD(5))


# ---- key sets and capture order ------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "num_full", "num_piecewise"),
    [(NONE, 0, 0), (PIECEWISE, 0, 2), (FULL, 2, 0), (FDO, 2, 0), (FAP, 2, 2)],
    ids=lambda x: x.name if isinstance(x, CUDAGraphMode) else None,
)
def test_key_counts(mode: CUDAGraphMode, num_full: int, num_piecewise: int) -> None:
    keys = make_dispatcher(mode).cudagraph_keys
    assert (len(keys[FULL]), len(keys[PIECEWISE])) == (num_full, num_piecewise)


def test_piecewise_keys_are_relaxed() -> None:
    keys = make_dispatcher(FAP).cudagraph_keys[PIECEWISE]
    assert keys == {BD(1), BD(8)}


def test_capture_descs_empty_before_initialization() -> None:
    config = CompilationConfig(cudagraph_capture_sizes=(1, 8), max_cudagraph_capture_size=8)
    assert CudagraphDispatcher(config).get_capture_descs() == []


def test_capture_descs_empty_for_none() -> None:
    assert make_dispatcher(NONE).get_capture_descs() == []


@pytest.mark.parametrize("mode", GRAPH_MODES, ids=lambda m: m.name)
def test_capture_descs_largest_first_one_uniform_value_per_group(mode: CUDAGraphMode) -> None:
    groups = make_dispatcher(mode, sizes=[1, 4, 8, 16], max_num_reqs=None).get_capture_descs()
    assert groups
    assert [m for m, _ in groups] == [m for m in (PIECEWISE, FULL) if m in dict(groups)]
    for _, descs in groups:
        assert [d.num_tokens for d in descs] == [16, 8, 4, 1]
        assert len({d.uniform for d in descs}) == 1


def test_capture_descs_of_full_and_piecewise() -> None:
    groups = dict(make_dispatcher(FAP, sizes=[1, 4, 8, 16], max_num_reqs=None).get_capture_descs())
    assert groups[PIECEWISE] == [BD(16), BD(8), BD(4), BD(1)]
    assert groups[FULL] == [BD(16, 16, True), BD(8, 8, True), BD(4, 4, True), BD(1, 1, True)]


def test_uniform_decode_keys_for_q2_have_num_reqs_size_over_q() -> None:
    keys = make_dispatcher(FAP, sizes=[1, 2, 4, 8], max_num_reqs=None, q=2).cudagraph_keys
    assert keys[FULL] == {BD(2, 1, True), BD(4, 2, True), BD(8, 4, True)}


def test_uniform_decode_keys_bounded_by_max_num_reqs() -> None:
    keys = make_dispatcher(FDO, sizes=[2, 4, 8, 16], max_num_reqs=4, q=2).cudagraph_keys
    assert keys[FULL] == {BD(2, 1, True), BD(4, 2, True), BD(8, 4, True)}


def test_q2_uniform_dispatch_pads_to_whole_requests() -> None:
    dispatcher = make_dispatcher(FAP, sizes=[2, 4, 8], max_num_reqs=None, q=2)
    assert dispatcher.dispatch(3, uniform_decode=True) == (FULL, BD(4, 2, True))


# ---- properties over random capture sizes --------------------------------------------------

capture_sizes = st.lists(st.integers(1, 512), min_size=1, max_size=50, unique=True)


def _smallest_fitting(sizes: list[int], n: int) -> int:
    return min(s for s in sizes if s >= n)


@given(sizes=capture_sizes, mode=st.sampled_from(GRAPH_MODES), uniform=st.booleans())
def test_pads_to_smallest_capture_size_that_fits(
    sizes: list[int], mode: CUDAGraphMode, uniform: bool
) -> None:
    dispatcher = make_dispatcher(mode, sizes=sizes, max_num_reqs=None)
    eager_expected = mode == FDO and not uniform  # FULL_DECODE_ONLY has no mixed graphs
    for n in range(1, max(sizes) + 1):
        runtime_mode, desc = dispatcher.dispatch(n, uniform_decode=uniform)
        if eager_expected:
            assert (runtime_mode, desc) == (NONE, BD(n))
        else:
            assert runtime_mode != NONE
            assert desc.num_tokens == _smallest_fitting(sizes, n)


@given(
    sizes=capture_sizes,
    mode=st.sampled_from(list(CUDAGraphMode)),
    uniform=st.booleans(),
    excess=st.integers(1, 1000),
)
def test_above_max_is_eager_unpadded(
    sizes: list[int], mode: CUDAGraphMode, uniform: bool, excess: int
) -> None:
    n = max(sizes) + excess
    assert make_dispatcher(mode, sizes=sizes).dispatch(n, uniform_decode=uniform) == (NONE, BD(n))


@given(sizes=capture_sizes, max_num_reqs=st.integers(1, 512), data=st.data())
def test_full_key_wins_over_piecewise(sizes: list[int], max_num_reqs: int, data) -> None:
    dispatcher = make_dispatcher(FAP, sizes=sizes, max_num_reqs=max_num_reqs)
    n = data.draw(st.integers(1, max(sizes)), label="num_tokens")
    padded = _smallest_fitting(sizes, n)
    full_key = BD(padded, padded, uniform=True)
    expected = (FULL, full_key) if padded <= max_num_reqs else (PIECEWISE, BD(padded))
    assert dispatcher.dispatch(n, uniform_decode=True) == expected


@given(
    sizes=capture_sizes,
    mode=st.sampled_from(list(CUDAGraphMode)),
    uniform=st.booleans(),
    max_num_reqs=st.integers(1, 512),
    allowed=st.sets(st.sampled_from([NONE, PIECEWISE, FULL]), min_size=1),
    data=st.data(),
)
def test_priority_full_then_piecewise_then_none(
    sizes: list[int],
    mode: CUDAGraphMode,
    uniform: bool,
    max_num_reqs: int,
    allowed: set[CUDAGraphMode],
    data,
) -> None:
    dispatcher = make_dispatcher(mode, sizes=sizes, max_num_reqs=max_num_reqs)
    n = data.draw(st.integers(1, max(sizes)), label="num_tokens")
    p = _smallest_fitting(sizes, n)
    candidates = []
    if mode == FULL:
        candidates.append((FULL, BD(p, min(p, max_num_reqs))))
    elif mode.separate_routine() and uniform and p <= max_num_reqs:
        candidates.append((FULL, BD(p, p, uniform=True)))
    if mode.has_piecewise_cudagraphs():
        candidates.append((PIECEWISE, BD(p)))
    candidates.append((NONE, BD(n)))
    usable = [c for c in candidates if c[0] in allowed]
    if not usable:
        with pytest.raises(CGCompileError):
            dispatcher.dispatch(n, uniform_decode=uniform, valid_modes=allowed)
        return
    assert dispatcher.dispatch(n, uniform_decode=uniform, valid_modes=allowed) == usable[0]
