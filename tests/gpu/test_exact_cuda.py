"""Exact by default on real CUDA graphs: a model broken into graphs that calls one graph twice
per step, outputs kept across calls, state written at rows chosen by a batch input without a
pad value, train-mode batch norm, and a float attribute read on the host (`.item()`) whose value
changes between calls: a graph captured at one value never replays for another."""

from __future__ import annotations

import pytest

import cgcompile
from tests.support.exact import (
    calls_keeping,
    check_batch_norm,
    check_broken_up,
    check_scaled,
    run_cache,
)
from tests.support.models import MODES

pytestmark = pytest.mark.cuda
CUDA = {"device": "cuda", "runtime": "cuda"}
GRAPH_MODES = MODES[1:]


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_a_broken_up_model_equals_eager_cuda(mode, compiler):
    check_broken_up(mode, compiler, **CUDA)


KEEPERS = {
    "output": lambda out: out,
    "view": lambda out: out[:, -1],
    # shares the memory without being a view; the first kept is the capture call's output, an
    # owning tensor whose block the graph's replays write
    "detached": lambda out: out.detach(),
}


@pytest.mark.parametrize("rows", [4, 3])
@pytest.mark.parametrize("keep", list(KEEPERS))
@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_outputs_kept_across_calls_keep_their_values_cuda(mode, keep, rows):
    calls_keeping(mode, KEEPERS[keep], rows=rows, **CUDA)
    assert cgcompile.counters.num_cudagraph_captured > 0


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("mode", GRAPH_MODES)
@pytest.mark.parametrize("how", ["index_copy_", "index_put_", "setitem"])
def test_indexed_state_writes_without_a_pad_value_equal_eager_cuda(how, mode, compiler):
    with cgcompile.counters.expect(num_eager_fallbacks=4):  # the sizes 3 and 5 run unpadded
        run_cache(how, mode, compiler, pad_value=None, **CUDA)
    assert cgcompile.counters.num_cudagraph_captured > 0


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_train_mode_batch_norm_running_stats_equal_eager_cuda(mode, compiler):
    check_batch_norm(mode, compiler, **CUDA)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_a_host_scalar_that_changes_equals_eager_cuda(mode, compiler):
    check_scaled(mode, compiler, scales=(2.0, 3.0, 2.0), **CUDA)
    assert cgcompile.counters.num_cudagraph_captured > 0
