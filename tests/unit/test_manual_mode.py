"""Manual mode (the caller sets the forward context and owns persistent buffers): every replay
checks that the inputs the graphs read in place have not moved; module instances are told
apart by their parameters, so each replays graphs of its own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cgcompile
from cgcompile import BatchDescriptor, CUDAGraphMode
from tests.support.models import Block
from tests.support.semantics import check_moved_input_raises

SIM = {"graph_runtime": "simulated", "cudagraph_capture_sizes": [4], "compiler": "eager"}
GRAPH_MODES = [CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL]


def compile_model(model: nn.Module, mode: CUDAGraphMode) -> nn.Module:
    options = {**SIM, "cudagraph_mode": mode.name}
    return torch.compile(model, backend="cudagraph_modes", options=options)


def manual(mode: CUDAGraphMode):
    return cgcompile.set_forward_context(mode, BatchDescriptor(4))


@pytest.mark.parametrize("mode", GRAPH_MODES, ids=str)
def test_an_input_that_moves_after_the_first_replay_raises(mode):
    check_moved_input_raises(mode.name)


@pytest.mark.parametrize("mode", GRAPH_MODES, ids=str)
def test_each_module_instance_replays_its_own_graphs(mode):
    torch.manual_seed(0)
    models = [Block(), Block()]
    compiled = [compile_model(m, mode) for m in models]
    buffer = torch.randn(4, 8)
    cgcompile.mark_dynamic_batch(buffer)
    with torch.no_grad(), manual(mode):
        for _ in range(4):
            buffer.normal_()
            for c, m in zip(compiled, models, strict=True):
                torch.testing.assert_close(c(buffer), m(buffer))
