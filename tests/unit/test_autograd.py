"""Graph modes are for inference: a graph whose outputs require grad (grad mode on, an input or
parameter that requires grad) runs without CUDA graphs, warned once, and gives eager's
gradients; the same model under torch.no_grad() is traced apart and uses graphs."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import cgcompile
from tests.support.models import MODES

SIM = {"graph_runtime": "simulated", "cudagraph_capture_sizes": [1, 2, 4, 8]}


class TwoLayers(nn.Module):
    """Linear, row-wise SDPA, linear: split into two pieces in piecewise modes."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).relu().unsqueeze(1)
        h = torch.nn.functional.scaled_dot_product_attention(h, h, h).squeeze(1)
        return self.b(h)


def compile_model(model, mode, compiler):
    options = {**SIM, "cudagraph_mode": mode, "compiler": compiler}
    return torch.compile(model, backend="cudagraph_modes", options=options)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("mode", MODES)
def test_training_steps_give_eager_gradients(mode, compiler, caplog):
    torch.manual_seed(0)
    model = TwoLayers()
    eager = copy.deepcopy(model)
    compiled = compile_model(model, mode, compiler)
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        for n in (4, 3, 4, 5):
            x = torch.randn(n, 8, requires_grad=True)
            ex = x.detach().clone().requires_grad_()
            cgcompile.mark_dynamic_batch(x)
            out = compiled(x)
            assert out.requires_grad
            out.square().sum().backward()
            eager(ex).square().sum().backward()
            torch.testing.assert_close(x.grad, ex.grad)
            for p, q in zip(model.parameters(), eager.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad)
    warned = [m for m in caplog.messages if "NEEDS_AUTOGRAD" in m]
    assert len(warned) == (0 if mode == "NONE" else 1), warned  # one graph, all sizes
    assert "torch.no_grad()" in "".join(warned) or mode == "NONE"


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL", "FULL_AND_PIECEWISE"])
def test_parameters_requiring_grad_alone_turn_graphs_off(mode):
    torch.manual_seed(0)
    model = TwoLayers()
    compiled = compile_model(model, mode, "eager")
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
    compiled = compile_model(model, mode, "eager")
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
