"""Graph modes are for inference: a graph whose outputs require grad (grad mode on, an input or
parameter that requires grad) runs without CUDA graphs, warned once, and gives eager's
gradients; the same model under torch.no_grad() is traced apart and uses graphs."""

from __future__ import annotations

import logging

import pytest
import torch

import cgcompile
from tests.support.models import MODES
from tests.support.semantics import (
    TwoLayers,
    check_grad_mode_with_a_hint,
    check_training_matches_eager,
    compile_model,
)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("mode", MODES)
def test_training_steps_give_eager_gradients(mode, compiler, caplog):
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        check_training_matches_eager(mode, compiler)
    warned = [m for m in caplog.messages if "NEEDS_AUTOGRAD" in m]
    assert len(warned) == (0 if mode == "NONE" else 1), warned  # one graph, all sizes
    assert mode == "NONE" or "torch.no_grad()" in warned[0]


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL", "FULL_AND_PIECEWISE"])
def test_parameters_requiring_grad_alone_turn_graphs_off(mode):
    torch.manual_seed(0)
    model = TwoLayers()
    compiled = compile_model(model, mode)
    with cgcompile.counters.expect(num_cudagraph_captured=0):
        for _ in range(3):
            x = torch.randn(4, 8)
            cgcompile.mark_dynamic_batch(x)
            compiled(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL", "FULL_AND_PIECEWISE"])
def test_inference_under_no_grad_still_uses_graphs(mode):
    torch.manual_seed(0)
    model = TwoLayers()
    compiled = compile_model(model, mode)
    x = torch.randn(4, 8)
    cgcompile.mark_dynamic_batch(x)
    compiled(x).sum().backward()  # a training graph: no graphs
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 8)
            cgcompile.mark_dynamic_batch(x)
            torch.testing.assert_close(compiled(x), model(x))
    assert cgcompile.counters.num_cudagraph_captured > 0
    assert {g.report.mode for g in cgcompile.compiled_graphs()} >= {"NONE"}


def test_grad_mode_with_a_hint_gives_eager_values():
    check_grad_mode_with_a_hint("cpu", "simulated")
