"""CUDAGraphWrapper on real CUDA graphs: replay values, addresses, streams, pool, weak outputs."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cgcompile.calls.cuda_graph_wrapper import CUDAGraphWrapper
from cgcompile.calls.forward_context import set_forward_context
from cgcompile.config import CUDAGraphMode
from cgcompile.counters import counters
from cgcompile.errors import CaptureError
from cgcompile.graphs import CUDAGraphRuntime, make_graph_runtime

pytestmark = pytest.mark.cuda

PIECEWISE, FULL = CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
WRAPPER_LOGGER = "cgcompile.calls.cuda_graph_wrapper"


class Affine:
    """fn(x) = 2x + 1, counting the Python calls (a CUDA replay makes none)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * 2 + 1


@pytest.fixture
def runtime() -> CUDAGraphRuntime:
    made = make_graph_runtime("cuda")
    assert isinstance(made, CUDAGraphRuntime)
    return made


def wrap(
    fn: Callable[..., Any], runtime: CUDAGraphRuntime, mode: CUDAGraphMode = PIECEWISE, **kw: Any
) -> CUDAGraphWrapper:
    """A wrapper that, once its callable ran (its first call), captures a key's first call."""
    kw.setdefault("num_warmups", 0)
    return CUDAGraphWrapper(fn, mode, runtime, name="toy", **kw)


def in_mode(mode: CUDAGraphMode, num_tokens: int = 4) -> Any:
    return set_forward_context(mode, num_tokens=num_tokens)


def cuda_arange(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32, device="cuda")


def test_capture_and_replay_equal_eager(runtime: CUDAGraphRuntime) -> None:
    weight = torch.randn(8, 8, device="cuda")
    buffer = torch.randn(16, 8, device="cuda")

    def mlp(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ weight + 1)

    wrapper = wrap(mlp, runtime)
    with counters.expect(num_cudagraph_captured=1), in_mode(PIECEWISE):
        for _ in range(3):
            buffer.normal_()
            torch.testing.assert_close(wrapper(buffer[:4]), mlp(buffer[:4]))


def test_replay_does_not_run_python(runtime: CUDAGraphRuntime) -> None:
    fn = Affine()
    wrapper = wrap(fn, runtime, num_warmups=1)
    x = cuda_arange(4)
    with in_mode(PIECEWISE):
        wrapper(x)  # the warm-up call runs fn
        wrapper(x)  # capture records the kernels by running fn's Python once, then replays
        assert fn.calls == 2
        out = wrapper(x)
    assert fn.calls == 2
    torch.testing.assert_close(out, x * 2 + 1)


def test_new_address_raises_on_first_replay(runtime: CUDAGraphRuntime) -> None:
    wrapper = wrap(Affine(), runtime)
    x = cuda_arange(4)
    with in_mode(PIECEWISE):
        wrapper(x)  # the callable's first run
        wrapper(x)  # capture
        with pytest.raises(CaptureError, match=r"toy: tensor arg 0 .* fixed addresses"):
            wrapper(cuda_arange(8)[4:])


def test_copy_arg_indices_copy_fresh_tensors_in(runtime: CUDAGraphRuntime) -> None:
    wrapper = wrap(Affine(), runtime, copy_arg_indices=(0,))
    with in_mode(PIECEWISE):
        for _ in range(3):
            x = torch.randn(4, device="cuda")
            torch.testing.assert_close(wrapper(x), x * 2 + 1)


def test_outputs_alias_across_replays(runtime: CUDAGraphRuntime) -> None:
    """Documented: every call returns the same graph memory; the next replay overwrites it."""
    wrapper = wrap(Affine(), runtime)
    x = cuda_arange(4)
    with in_mode(PIECEWISE):
        wrapper(x)  # the callable's first run, without a graph
        first = wrapper(x)  # the capture's output
        x.fill_(5.0)
        second = wrapper(x)  # a replay
    assert first.data_ptr() == second.data_ptr()
    torch.testing.assert_close(first, torch.full((4,), 11.0, device="cuda"))
    torch.testing.assert_close(second, torch.full((4,), 11.0, device="cuda"))


def test_captures_on_a_side_stream(runtime: CUDAGraphRuntime) -> None:
    streams: list[torch.cuda.Stream] = []

    def spy(x: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            streams.append(torch.cuda.current_stream())
        return x + 1

    wrapper = wrap(spy, runtime)
    with in_mode(PIECEWISE):
        for _ in range(2):  # the callable's first run, then the capture
            wrapper(cuda_arange(4))
    assert streams == [runtime.stream]
    assert streams[0] != torch.cuda.default_stream()


def test_wrappers_of_one_runtime_share_its_pool(runtime: CUDAGraphRuntime) -> None:
    first, second = wrap(Affine(), runtime), wrap(Affine(), runtime)
    x = cuda_arange(4)
    with in_mode(PIECEWISE):
        for _ in range(2):  # each callable's first run, then the captures
            first(x)
            second(x)
    pools = [w.entries[w.captured_keys()[0]].graph.graph.pool() for w in (first, second)]
    assert pools == [runtime.pools[0], runtime.pools[0]]  # both keys are module instance 0
    other = make_graph_runtime("cuda")
    wrap(Affine(), other)(x)
    assert other.pools.get(0) != runtime.pools[0]


def test_each_module_instance_has_a_pool_of_its_own(runtime: CUDAGraphRuntime) -> None:
    wrapper = wrap(Affine(), runtime)
    x = cuda_arange(4)
    for instance in (0, 1):
        with set_forward_context(PIECEWISE, num_tokens=4, instance=instance):
            for _ in range(2):  # the callable's first run, then the capture
                wrapper(x)
    pools = {key[2]: entry.graph.graph.pool() for key, entry in wrapper.entries.items()}
    assert pools == {0: runtime.pools[0], 1: runtime.pools[1]}
    assert runtime.pools[0] != runtime.pools[1]


def test_pieces_chain_through_pool_outputs(runtime: CUDAGraphRuntime) -> None:
    head = wrap(lambda x: x * 2, runtime)
    tail = CUDAGraphWrapper(lambda h: h + 1, PIECEWISE, runtime, name="tail", weak_output=True)
    buffer = torch.zeros(8, device="cuda")
    with counters.expect(num_cudagraph_captured=2), in_mode(PIECEWISE):  # 1 size x 2 pieces
        for step in range(3):
            buffer.fill_(float(step))
            torch.testing.assert_close(tail(head(buffer[:4])), buffer[:4] * 2 + 1)


def test_full_wrapper_captures_around_inner_piecewise(runtime: CUDAGraphRuntime) -> None:
    inner = wrap(Affine(), runtime)
    outer = wrap(lambda t: inner(t) - 1, runtime, FULL, weak_output=True)
    x = cuda_arange(4)
    with in_mode(FULL):
        outer(x)
        torch.testing.assert_close(outer(x), x * 2)
    assert (outer.num_captures, inner.num_captures) == (1, 0)


def test_weak_output_is_readable_after_replay(runtime: CUDAGraphRuntime) -> None:
    wrapper = wrap(Affine(), runtime, FULL, weak_output=True)
    x = cuda_arange(4)
    with in_mode(FULL):
        wrapper(x)  # the callable's first run, without a graph
        first = wrapper(x)
        torch.testing.assert_close(first, x * 2 + 1)
        x.fill_(3.0)
        second = wrapper(x)
    assert second.data_ptr() == first.data_ptr()
    torch.testing.assert_close(second, torch.full((4,), 7.0, device="cuda"))


@pytest.mark.parametrize("weak_output", [True, False], ids=["weak", "strong"])
def test_replay_outputs_do_not_pin_pool_blocks(weak_output: bool) -> None:
    """Entries keep only non-owning aliases: once the capturing call's caller drops its output,
    the block is free for the next capture, so two graphs need about one output block."""
    x = torch.zeros(16 << 20, device="cuda")  # 64 MiB of float32
    runtime = CUDAGraphRuntime()
    wrapper = wrap(lambda t: t * 2, runtime, FULL, weak_output=weak_output)
    with in_mode(FULL, num_tokens=2):
        wrapper(x)  # the callable's first run, without a graph
    assert runtime.memory_bytes() == 0
    for num_tokens in (8, 4):  # two graphs, one output block each
        with in_mode(FULL, num_tokens=num_tokens):
            wrapper(x)
    assert runtime.memory_bytes() < 1.5 * x.nbytes


def test_capture_failure_falls_back_to_eager(
    runtime: CUDAGraphRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    def syncs(x: torch.Tensor) -> torch.Tensor:
        return x * float(x.sum().item())  # .item() synchronizes: not capturable

    wrapper = wrap(syncs, runtime)
    x = cuda_arange(4)
    with caplog.at_level(logging.WARNING), in_mode(PIECEWISE):
        wrapper(x)  # the callable's first run, without a graph
        with counters.expect(num_capture_failures=1, num_cudagraph_captured=0):
            out = wrapper(x)
        torch.testing.assert_close(out, syncs(x))
        torch.testing.assert_close(wrapper(x), syncs(x))
    assert len(wrapper.failed_keys) == 1
    warnings = [r for r in caplog.records if r.name == WRAPPER_LOGGER]
    assert [r.levelno for r in warnings] == [logging.WARNING]


def test_memory_bytes_counts_pool_growth(runtime: CUDAGraphRuntime) -> None:
    x = torch.zeros(4 << 20, device="cuda")  # 16 MiB of float32
    wrapper = wrap(Affine(), runtime)
    with in_mode(PIECEWISE):
        for _ in range(2):  # the callable's first run, then the capture
            wrapper(x)
    assert runtime.memory_bytes() >= x.nbytes


def test_a_runtime_captures_again_after_all_its_graphs_were_freed(
    runtime: CUDAGraphRuntime,
) -> None:
    """The allocator retires a pool id once every graph in it is freed (a deleted module
    instance's graphs, a Hugging Face cache per generate()): the next capture takes a new pool
    instead of tripping the allocator's `use_count > 0` assert."""
    x = cuda_arange(4)
    first = wrap(Affine(), runtime)
    with in_mode(PIECEWISE):
        first(x)  # the callable's first run
        kept = first(x)  # captured; its output block stays in use
    first.entries.clear()
    gc.collect()
    second = wrap(Affine(), runtime)
    with in_mode(PIECEWISE):
        second(x)
        second(x)
        torch.testing.assert_close(second(x), x * 2 + 1)
    torch.testing.assert_close(kept, x * 2 + 1)
