"""Forward context and batch hints: nesting, per-thread isolation, validation; BatchDescriptor."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import pytest

from cgcompile.calls.forward_context import (
    BatchDescriptor,
    ForwardContext,
    batch_hint,
    current_batch_hint,
    get_forward_context,
    is_forward_context_available,
    set_forward_context,
)
from cgcompile.config import CUDAGraphMode
from cgcompile.errors import ConfigError

NONE = CUDAGraphMode.NONE
PIECEWISE = CUDAGraphMode.PIECEWISE
FULL = CUDAGraphMode.FULL


def run_in_thread(fn: Callable[[], Any]) -> Any:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


# ---- set / get ---------------------------------------------------------------------------


def test_unavailable_outside_any_context() -> None:
    assert not is_forward_context_available()


def test_get_outside_any_context_raises_with_the_fix() -> None:
    with pytest.raises(RuntimeError, match=r"no forward context.*set_forward_context"):
        get_forward_context()


def test_set_publishes_mode_and_descriptor() -> None:
    desc = BatchDescriptor(8, num_reqs=8, uniform=True)
    with set_forward_context(cudagraph_runtime_mode=FULL, batch_descriptor=desc) as ctx:
        assert is_forward_context_available()
        assert get_forward_context() is ctx
        assert (ctx.cudagraph_runtime_mode, ctx.batch_descriptor) == (FULL, desc)
    assert not is_forward_context_available()


def test_num_tokens_alone_builds_a_descriptor() -> None:
    with set_forward_context(num_tokens=5) as ctx:
        assert ctx.batch_descriptor == BatchDescriptor(5)


def test_nesting_restores_the_outer_context() -> None:
    with set_forward_context(PIECEWISE, BatchDescriptor(8)) as outer:
        with set_forward_context(FULL, BatchDescriptor(4, 4, True)) as inner:
            assert get_forward_context() is inner
        assert get_forward_context() is outer
    assert not is_forward_context_available()


def test_exception_inside_restores_the_outer_context() -> None:
    with set_forward_context(PIECEWISE, BatchDescriptor(8)) as outer:
        with pytest.raises(KeyError):
            with set_forward_context(FULL, BatchDescriptor(4)):
                raise KeyError("boom")
        assert get_forward_context() is outer


def test_new_thread_does_not_see_the_callers_context() -> None:
    with set_forward_context(FULL, BatchDescriptor(8)):
        assert run_in_thread(is_forward_context_available) is False


def test_context_set_in_a_thread_does_not_leak_out() -> None:
    def set_and_report() -> bool:
        with set_forward_context(FULL, BatchDescriptor(8)):
            return is_forward_context_available()

    with set_forward_context(PIECEWISE, BatchDescriptor(4)) as mine:
        assert run_in_thread(set_and_report) is True
        assert get_forward_context() is mine


# ---- ForwardContext validation -----------------------------------------------------------


def test_one_batch_hint_object_reentered_and_left_by_an_exception_restores() -> None:
    hint = batch_hint(uniform_decode=True)  # a decode loop may build it once and reuse it
    with pytest.raises(RuntimeError, match="inside"):
        with hint as outer:
            with batch_hint(uniform_decode=False):
                with hint as again:
                    assert again is outer and current_batch_hint() is outer
                assert current_batch_hint().uniform_decode is False
            raise RuntimeError("inside")
    assert current_batch_hint() is None


@pytest.mark.parametrize("value", [1, 0, "yes", [True]], ids=repr)
def test_batch_hint_rejects_a_uniform_decode_that_is_not_a_bool(value: Any) -> None:
    with pytest.raises(ConfigError, match="uniform_decode must be True or False"):
        batch_hint(uniform_decode=value)


@pytest.mark.parametrize(
    "mode",
    [CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE],
    ids=lambda m: m.name,
)
def test_composite_runtime_mode_is_rejected(mode: CUDAGraphMode) -> None:
    with pytest.raises(ConfigError, match="NONE, PIECEWISE, FULL"):
        ForwardContext(mode, BatchDescriptor(8))


@pytest.mark.parametrize("mode", [PIECEWISE, FULL], ids=lambda m: m.name)
def test_graph_mode_without_descriptor_is_rejected(mode: CUDAGraphMode) -> None:
    with pytest.raises(ConfigError, match="needs a batch_descriptor"):
        ForwardContext(mode, None)


def test_none_mode_needs_no_descriptor() -> None:
    assert ForwardContext(NONE).batch_descriptor is None


def test_set_forward_context_validates_too() -> None:
    with pytest.raises(ConfigError):
        with set_forward_context(FULL):
            pass
    assert not is_forward_context_available()


# ---- BatchDescriptor ---------------------------------------------------------------------


def test_descriptor_equal_values_hash_equal() -> None:
    a, b = BatchDescriptor(8, 8, True), BatchDescriptor(8, num_reqs=8, uniform=True)
    assert a == b
    assert len({a, b, BatchDescriptor(8, 8, False)}) == 2


def test_descriptor_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        BatchDescriptor(8).num_tokens = 16  # type: ignore[misc]


def test_relaxed_drops_request_count_and_uniform_keeps_tokens_and_lora() -> None:
    desc = BatchDescriptor(8, num_reqs=4, uniform=True, has_lora=True)
    assert desc.relaxed() == BatchDescriptor(8, None, False, has_lora=True)
    assert desc == BatchDescriptor(8, 4, True, True)  # relaxed() returns a new key


# ---- batch_hint --------------------------------------------------------------------------


def test_no_hint_outside() -> None:
    assert current_batch_hint() is None


def test_batch_hint_nests_and_restores() -> None:
    with batch_hint(uniform_decode=True, num_reqs=4) as outer:
        assert current_batch_hint() is outer
        with batch_hint(invalid_modes={FULL}, has_lora=True) as inner:
            assert current_batch_hint() is inner
            assert inner.invalid_modes == frozenset({FULL})
        assert current_batch_hint() is outer
    assert current_batch_hint() is None


@pytest.mark.parametrize(
    "mode",
    [CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE],
    ids=lambda m: m.name,
)
def test_batch_hint_rejects_composite_invalid_modes(mode: CUDAGraphMode) -> None:
    with pytest.raises(ConfigError, match="runtime modes"):
        with batch_hint(invalid_modes={mode}):
            pass
    assert current_batch_hint() is None


@pytest.mark.parametrize("num_reqs", [0, -3], ids=str)
def test_batch_hint_rejects_non_positive_num_reqs(num_reqs: int) -> None:
    with pytest.raises(ConfigError, match=f"num_reqs must be >= 1, got {num_reqs}"):
        with batch_hint(num_reqs=num_reqs):
            pass
