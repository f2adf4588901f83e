"""`compile_sizes` artifacts are specialised to one batch size and to the traced value of every
other size: calls with other ints or shapes take the general artifact, in every mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cgcompile
from cgcompile.backend.piece_artifacts import PieceRunner, Specialized

SIM = {"graph_runtime": "simulated", "cudagraph_capture_sizes": [4, 8], "compile_sizes": [4]}


def scale(x: torch.Tensor, k: int) -> torch.Tensor:
    return x * k + 1


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL"])
def test_other_dynamic_int_is_not_baked_into_the_specialised_compile(mode):
    f = torch.compile(scale, backend="cudagraph_modes", options={**SIM, "cudagraph_mode": mode})
    for k in (1, 2, 3, 5, 2):  # 1 is traced on its own; 2 makes k dynamic
        x = torch.randn(4, 2)
        cgcompile.mark_dynamic_batch(x)
        torch.testing.assert_close(f(x, k), scale(x, k))


class SeqSum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu().sum(1)


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL"])
def test_dynamic_sequence_length_with_compile_sizes(mode):
    torch.manual_seed(0)
    model = SeqSum()
    f = torch.compile(model, backend="cudagraph_modes", options={**SIM, "cudagraph_mode": mode})
    with torch.no_grad():
        for seq in (3, 5, 7, 3):
            x = torch.randn(4, seq, 8)
            cgcompile.mark_dynamic_batch(x)
            torch._dynamo.mark_dynamic(x, 1)
            torch.testing.assert_close(f(x), model(x))


def test_runner_takes_the_specialised_artifact_only_for_its_layout():
    runner = PieceRunner(lambda x, n, k: "general")
    runner.size_index = 1
    traced = (torch.zeros(4, 3), 4, 2)
    runner.by_size[4] = Specialized(lambda x, n, k: "special", (((4, 3), (3, 1)), 4, 2))
    assert runner(*traced) == "special"
    assert runner(torch.zeros(4, 3), 4, 3) == "general"  # another int
    assert runner(torch.zeros(4, 5), 4, 2) == "general"  # another shape
    assert runner(torch.zeros(3, 4).t(), 4, 2) == "general"  # another stride
    assert runner(torch.zeros(8, 3), 8, 2) == "general"  # another batch size
