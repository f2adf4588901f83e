"""Eager-equivalent semantics on real CUDA graphs: outputs padding could change, row-wise and
LLM graphs that keep padding, training steps (eager gradients), concurrent threads, inputs
moved in manual mode, a deleted model freed, compile_sizes with another dynamic int."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

import cgcompile
from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch
from tests.support.models import MODES, Block
from tests.support.semantics import (
    GRAPH_MODES,
    ROW_WISE,
    SIZES,
    UNSAFE,
    check_against_eager,
    check_grad_mode_with_a_hint,
    check_moved_input_raises,
    check_threads_match_eager,
    check_training_matches_eager,
    compile_model,
)

pytestmark = pytest.mark.cuda
CUDA = {"device": "cuda", "runtime": "cuda"}


def compile_cuda(fn, mode: str, compiler: str = "inductor", **options):
    return compile_model(fn, mode, compiler, "cuda", **options)


@pytest.mark.parametrize("mode", GRAPH_MODES)
@pytest.mark.parametrize("case", UNSAFE, ids=str)
def test_outputs_padding_could_change_equal_eager_cuda(case, mode):
    fn = UNSAFE[case][0]
    check_against_eager(compile_cuda(fn, mode), fn, device="cuda")


@pytest.mark.parametrize("fn", ROW_WISE, ids=lambda fn: fn.__name__)
@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_row_wise_graphs_keep_padding_cuda(fn, mode):
    with cgcompile.counters.expect(num_eager_fallbacks=0):
        check_against_eager(compile_cuda(fn, mode), fn, device="cuda")


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_llama_keeps_padding_cuda(mode):
    model = Llama(LlamaConfig.tiny()).to("cuda").eval()
    eager = copy.deepcopy(model)
    compiled = compile_cuda(model, mode)
    with torch.no_grad(), cgcompile.counters.expect(num_eager_fallbacks=0):
        for n in SIZES:
            tokens, positions = make_inputs(model.cfg, n, "cuda")
            mark_batch(model.cfg, tokens, positions)
            got = compiled(tokens, positions)
            torch.testing.assert_close(got, eager(tokens, positions), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("mode", MODES)
def test_training_steps_give_eager_gradients_cuda(mode, compiler):
    check_training_matches_eager(mode, compiler, **CUDA)


@pytest.mark.parametrize("mode", MODES)
def test_concurrent_calls_from_threads_equal_eager_cuda(mode):
    check_threads_match_eager(mode, **CUDA)


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL"])
def test_an_input_that_moves_after_the_first_replay_raises_cuda(mode):
    check_moved_input_raises(mode, **CUDA)


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_deleted_model_frees_its_parameters_cuda(mode):
    model = Block().to("cuda")
    compiled = compile_cuda(model, mode)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 8, device="cuda")
            cgcompile.mark_dynamic_batch(x)
            torch.testing.assert_close(compiled(x), model(x))
    weight = weakref.ref(model.lin.weight)
    del model, compiled
    gc.collect()
    assert weight() is None


def scale(x: torch.Tensor, k: int) -> torch.Tensor:
    return x * k + 1


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL"])
def test_compile_sizes_with_another_dynamic_int_cuda(mode):
    f = compile_cuda(scale, mode, cudagraph_capture_sizes=[4, 8], compile_sizes=[4])
    for k in (1, 2, 3, 5, 2):
        x = torch.randn(4, 2, device="cuda")
        cgcompile.mark_dynamic_batch(x)
        torch.testing.assert_close(f(x, k), scale(x, k))


def test_grad_mode_with_a_hint_gives_eager_values_cuda():
    check_grad_mode_with_a_hint("cuda", "cuda")
