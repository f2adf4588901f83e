"""CUDAGraphWrapper on the simulated runtime: pass-through, capture, replay, addresses, failures."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cgcompile.calls.cuda_graph_wrapper import CUDAGraphWrapper
from cgcompile.calls.forward_context import BatchDescriptor, set_forward_context
from cgcompile.config import CUDAGraphMode
from cgcompile.counters import counters
from cgcompile.errors import CaptureError, ConfigError
from cgcompile.graphs import (
    SimulatedGraphRuntime,
    make_graph_runtime,
    poison_value,
    weak_ref_tensors,
)

NONE, PIECEWISE, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
WRAPPER_LOGGER = "cgcompile.calls.cuda_graph_wrapper"


class Affine:
    """fn(x, *ints) = 2x + 1, counting its calls (simulated replays call it too)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor, *sizes: int) -> torch.Tensor:
        self.calls += 1
        return x * 2 + 1


def wrap(
    fn: Callable[..., Any], mode: CUDAGraphMode = PIECEWISE, **kwargs: Any
) -> CUDAGraphWrapper:
    """A wrapper on the simulated runtime; it captures on the first call unless told to warm up."""
    kwargs.setdefault("num_warmups", 0)
    wrapper = CUDAGraphWrapper(fn, mode, make_graph_runtime("simulated"), name="toy", **kwargs)
    wrapper.ran = True  # as if fn had run once: these tests are about capture, not lazy init
    return wrapper


def in_mode(mode: CUDAGraphMode, num_tokens: int = 4) -> Any:
    return set_forward_context(mode, num_tokens=num_tokens)


def test_passes_through_without_context() -> None:
    fn = Affine()
    wrapper = wrap(fn)
    x = torch.arange(4.0)
    with counters.expect(num_cudagraph_captured=0):
        out = wrapper(x)
    assert torch.equal(out, x * 2 + 1)
    assert fn.calls == 1
    assert wrapper.entries == {}


@pytest.mark.parametrize("mode", [NONE, FULL], ids=["mode-none", "other-mode"])
def test_passes_through_when_mode_is_not_its_own(mode: CUDAGraphMode) -> None:
    fn = Affine()
    wrapper = wrap(fn, PIECEWISE)
    x = torch.arange(4.0)
    with counters.expect(num_cudagraph_captured=0), in_mode(mode):
        out = wrapper(x)
    assert torch.equal(out, x * 2 + 1)
    assert fn.calls == 1
    assert wrapper.entries == {}


def test_warmup_calls_run_eagerly_then_one_call_captures() -> None:
    fn = Affine()
    wrapper = wrap(fn, num_warmups=2)
    x = torch.arange(4.0)
    with counters.expect(num_cudagraph_captured=0), in_mode(PIECEWISE):
        outs = [wrapper(x).clone() for _ in range(2)]
    assert fn.calls == 2 and wrapper.entries == {}
    assert all(torch.equal(out, x * 2 + 1) for out in outs)
    with counters.expect(num_cudagraph_captured=1), in_mode(PIECEWISE):
        wrapper(x)
    assert fn.calls == 2 + 1 + 1  # warm-ups + the simulated capture run + the replay
    with counters.expect(num_cudagraph_captured=0), in_mode(PIECEWISE):
        out = wrapper(x)
    assert fn.calls == 5  # a simulated replay re-runs fn (a CUDA replay would not)
    assert torch.equal(out, x * 2 + 1)
    assert wrapper.captured_keys() == [(BatchDescriptor(4), (), 0)]
    assert wrapper.num_captures == 1
    assert wrapper.capture_seconds >= 0.0


@pytest.mark.parametrize("num_warmups", [0, 1, 2])
def test_every_call_writes_state_once(num_warmups: int) -> None:
    def step(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        state.add_(x)
        return state * 1

    wrapper = wrap(step, num_warmups=num_warmups)
    x, state = torch.ones(4), torch.zeros(4)
    with in_mode(PIECEWISE):
        for calls in range(1, 6):
            out = wrapper(x, state)
            assert torch.equal(state, torch.full((4,), float(calls)))  # as `calls` eager calls
            assert torch.equal(out, state)


def test_a_callable_that_never_ran_warms_up_before_its_first_capture() -> None:
    """A compiled kernel's first run (loading, autotuning) cannot happen inside a CUDA capture,
    so even with num_warmups=0 the wrapper's first call runs eagerly; later keys capture at once.
    """
    fn = Affine()
    wrapper = CUDAGraphWrapper(fn, PIECEWISE, make_graph_runtime("simulated"), num_warmups=0)
    x = torch.arange(8.0)
    with set_forward_context(PIECEWISE, num_tokens=4, capture_only=True):
        with pytest.raises(CaptureError, match="has not run yet"):
            wrapper(x[:4])
    with counters.expect(num_cudagraph_captured=0), in_mode(PIECEWISE, 4):
        wrapper(x[:4])
    assert fn.calls == 1
    with counters.expect(num_cudagraph_captured=2):
        with in_mode(PIECEWISE, 4):
            wrapper(x[:4])
        with in_mode(PIECEWISE, 8):
            wrapper(x)


def test_capture_only_records_without_running() -> None:
    def step(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        state.add_(x)
        return state + 1

    wrapper = wrap(step, num_warmups=3)
    x, state = torch.ones(4), torch.zeros(4)
    with counters.expect(num_cudagraph_captured=1):
        with set_forward_context(PIECEWISE, num_tokens=4, capture_only=True):
            wrapper(x, state)
            wrapper(x, state)  # a known key: its outputs, not replayed
    assert torch.equal(state, torch.zeros(4))  # nothing ran
    with counters.expect(num_cudagraph_captured=0), in_mode(PIECEWISE):
        out = wrapper(x, state)  # replays at once: no warm-up left for a captured key
    assert torch.equal(state, torch.ones(4)) and torch.equal(out, torch.full((4,), 2.0))


def test_first_call_returns_computed_values() -> None:
    wrapper = wrap(Affine())
    x = torch.arange(4.0)
    with in_mode(PIECEWISE):
        out = wrapper(x)
    assert not out.isnan().any()
    assert torch.equal(out, x * 2 + 1)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool], ids=str
)
def test_capture_output_is_poisoned(dtype: torch.dtype) -> None:
    x = torch.zeros(3, dtype=dtype)  # no poison value is 0
    graph, out = SimulatedGraphRuntime().capture(lambda t: t.clone(), (x,), weak_output=False)
    expected = torch.full((3,), poison_value(dtype), dtype=dtype)
    assert torch.equal(out, expected) or (dtype.is_floating_point and out.isnan().all())
    assert torch.equal(graph.replay(), x)


def test_capture_does_not_apply_in_place_writes_to_args() -> None:
    def bump(t: torch.Tensor) -> torch.Tensor:
        return t.add_(1)

    x = torch.zeros(2)
    graph, out = SimulatedGraphRuntime().capture(bump, (x,), weak_output=False)
    assert torch.equal(x, torch.zeros(2))  # a real capture runs no kernels
    assert out is x  # an output that is an arg keeps the arg's data, not poison
    graph.replay()
    assert torch.equal(x, torch.ones(2))


def test_outputs_that_share_memory_replay_as_on_a_gpu() -> None:
    def views(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        row = (t * 2).unsqueeze(0)
        windows = (t + 1).as_strided((3, 2), (1, 1))  # overlapping windows of one buffer
        return row.expand(3, 4), row[0, 1:], windows

    x = torch.arange(4.0)
    graph, out = SimulatedGraphRuntime().capture(views, (x,), weak_output=False)
    assert all(o.isnan().all() for o in out)
    for step in range(2):
        x.add_(step)
        result = graph.replay()
        assert result is out
        assert all(torch.equal(r, w) for r, w in zip(result, views(x), strict=True))


def test_replay_keeps_structure_of_tuple_outputs() -> None:
    def split(t: torch.Tensor) -> tuple[Any, ...]:
        return t + 1, None, 3, [t * 2]

    x = torch.arange(2.0)
    graph, out = SimulatedGraphRuntime().capture(split, (x,), weak_output=False)
    result = graph.replay()
    assert result is out
    assert torch.equal(result[0], x + 1) and result[1:3] == (None, 3)
    assert torch.equal(result[3][0], x * 2)


def test_replay_reads_static_buffer_updated_in_place() -> None:
    wrapper = wrap(Affine())
    buffer = torch.arange(8.0)
    with in_mode(PIECEWISE):
        wrapper(buffer[:4])
        buffer[:4] += 10
        out = wrapper(buffer[:4])  # a new view object, same address
    assert torch.equal(out, buffer[:4] * 2 + 1)


def test_new_tensor_raises_on_first_replay() -> None:
    wrapper = wrap(Affine())
    with in_mode(PIECEWISE):
        wrapper(torch.arange(4.0))
        with pytest.raises(CaptureError, match=r"toy: tensor arg 0 .* fixed addresses"):
            wrapper(torch.arange(4.0) + 1)


def test_moved_input_raises_on_any_replay_in_manual_mode() -> None:
    wrapper = wrap(Affine())
    x = torch.arange(4.0)
    with in_mode(PIECEWISE):
        wrapper(x)  # capture
        wrapper(x)  # first replay: addresses and shapes verified
        wrapper(x[:])  # a new view at the same address is fine
        with pytest.raises(CaptureError, match=r"toy: tensor arg 0 .* stale memory"):
            wrapper(torch.full((4,), 100.0))


def test_automatic_dispatch_replays_skip_the_address_check() -> None:
    """A context with a shape_key comes from automatic dispatch, which feeds static buffers;
    a new tensor there would give stale results, as on a GPU."""
    wrapper = wrap(Affine())
    x = torch.arange(4.0)
    with set_forward_context(PIECEWISE, num_tokens=4, shape_key=()):
        wrapper(x)
        wrapper(x)
        out = wrapper(torch.full((4,), 100.0))
    assert torch.equal(out, x * 2 + 1)  # computed from the captured input


def test_copy_arg_indices_copy_fresh_tensors_in() -> None:
    wrapper = wrap(Affine(), copy_arg_indices=(0,))
    with in_mode(PIECEWISE):
        for seed in range(3):
            x = torch.randn(4, generator=torch.Generator().manual_seed(seed))
            assert torch.equal(wrapper(x), x * 2 + 1)


def test_copy_arg_indices_must_name_tensors() -> None:
    wrapper = wrap(Affine(), copy_arg_indices=(1,))
    with in_mode(PIECEWISE), pytest.raises(ConfigError, match="arg 1"):
        wrapper(torch.arange(4.0), 4)


def test_outputs_alias_across_replays() -> None:
    wrapper = wrap(Affine())
    x = torch.arange(4.0)
    with in_mode(PIECEWISE):
        first = wrapper(x)
        x.fill_(5.0)
        second = wrapper(x)
    assert first is second  # replay 2 overwrote what replay 1 returned
    assert torch.equal(first, torch.full((4,), 11.0))


def test_int_args_make_distinct_keys() -> None:
    wrapper = wrap(Affine())
    x = torch.arange(4.0)
    with counters.expect(num_cudagraph_captured=2), in_mode(PIECEWISE):  # 1 descriptor x 2 ints
        wrapper(x, 2)
        wrapper(x, 3)
        wrapper(x, 2)
    assert wrapper.captured_keys() == [(BatchDescriptor(4), (2,), 0), (BatchDescriptor(4), (3,), 0)]


@pytest.mark.parametrize(
    ("mode", "outer_graphs", "inner_graphs"),
    [(FULL, 1, 0), (PIECEWISE, 0, 1), (NONE, 0, 0)],
    ids=["full-outer-acts", "piecewise-inner-acts", "none-neither"],
)
def test_nested_wrappers_only_matching_mode_acts(
    mode: CUDAGraphMode, outer_graphs: int, inner_graphs: int
) -> None:
    runtime = make_graph_runtime("simulated")
    inner = CUDAGraphWrapper(Affine(), PIECEWISE, runtime, name="inner")
    outer = CUDAGraphWrapper(lambda t: inner(t) - 1, FULL, runtime, name="outer")
    x = torch.arange(4.0)
    with counters.expect(num_cudagraph_captured=outer_graphs + inner_graphs), in_mode(mode):
        first = outer(x).clone()
        second = outer(x)
    assert torch.equal(first, x * 2) and torch.equal(second, x * 2)
    assert (outer.num_captures, inner.num_captures) == (outer_graphs, inner_graphs)


class FailingRuntime:
    """A runtime whose captures always fail, like an op that cannot be recorded."""

    name = "failing"

    def capture(self, fn: Callable[..., Any], args: tuple[Any, ...], **flags: bool) -> Any:
        raise CaptureError("this op cannot be captured")

    def memory_bytes(self) -> int:
        return 0


def test_capture_failure_runs_key_eagerly() -> None:
    fn = Affine()
    wrapper = CUDAGraphWrapper(fn, PIECEWISE, FailingRuntime(), name="toy", num_warmups=0)
    wrapper.ran = True  # as if fn had run once: the first call tries to capture
    x = torch.arange(4.0)
    with in_mode(PIECEWISE):
        with counters.expect(num_capture_failures=1, num_cudagraph_captured=0):
            out = wrapper(x)
        with counters.expect(num_capture_failures=0):
            later = wrapper(x)  # known failed key: eager, no new capture attempt
    assert torch.equal(out, x * 2 + 1) and torch.equal(later, x * 2 + 1)
    assert fn.calls == 1 + 1  # the failed key's eager fallback + the later eager call
    assert wrapper.failed_keys == {(BatchDescriptor(4), (), 0): "this op cannot be captured"}
    assert wrapper.entries == {}


def test_capture_failure_warns_once_per_wrapper(caplog: pytest.LogCaptureFixture) -> None:
    wrapper = CUDAGraphWrapper(Affine(), PIECEWISE, FailingRuntime(), name="toy", num_warmups=0)
    x = torch.arange(8.0)
    with caplog.at_level(logging.WARNING, logger=WRAPPER_LOGGER):
        with counters.expect(num_capture_failures=2):  # two keys, each fails once
            for n in (4, 8, 4):
                with in_mode(PIECEWISE, num_tokens=n):
                    wrapper(x[:n])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "this op cannot be captured" in warnings[0].getMessage()


def test_rejects_mode_none() -> None:
    with pytest.raises(ConfigError, match="PIECEWISE or FULL"):
        CUDAGraphWrapper(Affine(), NONE, make_graph_runtime("simulated"))


def test_unknown_runtime_kind_is_rejected() -> None:
    with pytest.raises(ConfigError, match="'cuda' or 'simulated'"):
        make_graph_runtime("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_cuda_runtime_without_gpu_is_rejected() -> None:
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        make_graph_runtime("cuda")


def test_weak_ref_tensors_leaves_cpu_tensors_alone() -> None:
    x = torch.arange(3.0)
    out = weak_ref_tensors((x, None, [x]))
    assert out[0] is x and out[1] is None and out[2][0] is x


def test_a_simulated_capture_that_raises_is_a_capture_error_and_writes_nothing() -> None:
    """As a capture on a GPU: `capture_all` and lazy capture take a `CaptureError` (the key
    left to lazy capture, or run eagerly), and a failed capture ran no kernel."""
    state = torch.zeros(3)

    def fn(x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        raise IndexError("shape mismatch")

    with pytest.raises(CaptureError, match="failed with IndexError: shape mismatch") as info:
        SimulatedGraphRuntime().capture(fn, (state,), weak_output=False)
    assert isinstance(info.value.__cause__, IndexError)
    assert torch.equal(state, torch.zeros(3))
