"""counters.expect: exact deltas pass, wrong ones fail naming the counter, unknown names fail."""

from __future__ import annotations

import pytest

from cgcompile.counters import Counters, counters


def test_expect_passes_on_exact_deltas() -> None:
    with counters.expect(num_cudagraph_captured=2, num_graphs_seen=1, num_eager_fallbacks=0):
        counters.num_cudagraph_captured += 2
        counters.num_graphs_seen += 1


def test_expect_ignores_unnamed_counters() -> None:
    with counters.expect(num_graphs_seen=1):
        counters.num_graphs_seen += 1
        counters.num_backend_compilations += 5


@pytest.mark.parametrize("actual", [0, 1, 3], ids=["none", "fewer", "more"])
def test_expect_fails_naming_the_counter(actual: int) -> None:
    with pytest.raises(AssertionError) as info:
        with counters.expect(num_cudagraph_captured=2, num_graphs_seen=0):
            counters.num_cudagraph_captured += actual
    message = str(info.value)
    assert f"num_cudagraph_captured: got +{actual}, expected +2" in message
    assert "num_graphs_seen" not in message


def test_expect_zero_fails_on_any_change() -> None:
    with pytest.raises(AssertionError, match="num_capture_failures"):
        with counters.expect(num_capture_failures=0):
            counters.num_capture_failures += 1


def test_expect_rejects_unknown_names() -> None:
    with pytest.raises(AttributeError, match=r"num_graphs_captured.*valid.*num_cudagraph_captured"):
        with counters.expect(num_graphs_captured=1):
            pass


def test_reset_zeroes_every_counter() -> None:
    local = Counters(num_graphs_seen=3, num_cudagraph_captured=7)
    local.reset()
    assert set(local.snapshot().values()) == {0}
