"""Hugging Face `generate()` through the backend gives eager's greedy tokens in every mode
(CPU, simulated graphs; `tests/gpu/test_hf_cuda.py` runs the same on real graphs)."""

from __future__ import annotations

import pytest
import torch

import cgcompile
from tests.support.hf import PATHS, generate_tokens
from tests.support.models import MODES

pytest.importorskip("transformers")


def check(path: str, mode: str, compiler: str) -> None:
    options = {"cudagraph_mode": mode, "graph_runtime": "simulated", "compiler": compiler}
    torch._dynamo.utils.counters.clear()
    got, want = generate_tokens(path, options, device="cpu")
    assert got.tolist() == want.tolist()
    if path == "static-cache":  # HF compiles the decode step: one graph, replayed
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # no recompiles
        assert (cgcompile.counters.num_cudagraph_captured > 0) == (mode != "NONE")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", PATHS)
def test_generate_matches_eager(path, mode):
    check(path, mode, "eager")


@pytest.mark.parametrize("path", PATHS)
def test_generate_matches_eager_with_inductor(path):
    if path == "compiled-forward" and torch.__version__ < "2.13":
        pytest.skip(
            "torch < 2.13's Inductor emits C++ that does not compile for this model's dynamic "
            "cache on CPU ('tmp2' was not declared); plain torch.compile(model.forward) fails too"
        )
    check(path, "FULL_AND_PIECEWISE", "inductor")
