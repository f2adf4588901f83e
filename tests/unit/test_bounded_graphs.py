"""Bounded graphs: int inputs other than the batch size (a Llama-style `start_pos`) get graphs
for a bounded number of values, then run without graphs, warned once; a batch marked in a dim
other than 0 is refused clearly in graph modes (they pad and slice dim 0 only)."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from torch import nn

import cgcompile
from cgcompile.calls.variants import MAX_SIZE_VARIANTS

SIM = {
    "graph_runtime": "simulated",
    "cudagraph_capture_sizes": [1, 2, 4, 8],
    "compiler": "eager",
    "num_warmups": 0,
}


class StartPos(nn.Module):
    """forward(x, start_pos: int): a position table read at a Python int, as Llama-style code."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("table", torch.randn(64, 8))

    def forward(self, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        h = (self.lin(x) + self.table[start_pos]).unsqueeze(1)
        return torch.nn.functional.scaled_dot_product_attention(h, h, h).squeeze(1)


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL", "FULL_AND_PIECEWISE"])
def test_changing_int_argument_gets_a_bounded_number_of_graphs(mode, caplog):
    model = StartPos()
    options = {**SIM, "cudagraph_mode": mode}
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    rng = random.Random(0)
    with caplog.at_level(logging.WARNING, logger="cgcompile"), torch.no_grad():
        for start_pos in range(40):
            x = torch.randn(rng.choice([2, 3, 4, 8]), 8)
            cgcompile.mark_dynamic_batch(x)
            torch.testing.assert_close(compiled(x, start_pos), model(x, start_pos))
    for graph in cgcompile.compiled_graphs():
        values = {key[1] for w in graph.wrappers for key in w.captured_keys()}
        assert len({sizes[1:] for sizes in values}) <= MAX_SIZE_VARIANTS
    warnings = [m for m in caplog.messages if "distinct values" in m]
    assert warnings and all("L['start_pos']" in m for m in warnings)
    assert len(warnings) == len({m.split()[1] for m in warnings})  # once per graph


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_batch_marked_in_another_dim_is_refused_in_graph_modes():
    f = torch.compile(double, backend="cudagraph_modes", options={**SIM})
    x = torch.randn(4, 5)
    cgcompile.mark_dynamic_batch(x, dim=1)
    with pytest.raises(Exception, match=r"mark_dynamic_batch\(dim=1\) .* dim 0 only"):
        f(x)


def test_batch_marked_in_another_dim_runs_in_mode_none():
    f = torch.compile(double, backend="cudagraph_modes", options={**SIM, "cudagraph_mode": "NONE"})
    for n in (3, 5, 9):
        x = torch.randn(4, n)
        cgcompile.mark_dynamic_batch(x, dim=1)
        torch.testing.assert_close(f(x), double(x))


def test_marking_dim_0_again_clears_another_dim():
    x = torch.randn(4, 5)
    cgcompile.mark_dynamic_batch(x, dim=1)
    cgcompile.mark_dynamic_batch(x, dim=0)
    f = torch.compile(double, backend="cudagraph_modes", options={**SIM})
    torch.testing.assert_close(f(x), double(x))
