"""Outputs and state equal eager's on real CUDA graphs: a counter and a KV cache written inside
the graph, inputs written in place, strided inputs, `capture_all` without side effects, and
Hugging Face `generate()` (fp32 greedy tokens) both ways."""

from __future__ import annotations

import pytest
import torch

import cgcompile
from tests.support.hf import PATHS, generate_tokens
from tests.support.models import MODES
from tests.support.state import (
    LAYOUTS,
    check_mutated_inputs,
    check_pad_rows_after_steady_calls,
    check_strided_inputs,
    run_against_eager,
)

pytestmark = pytest.mark.cuda
CUDA = {"device": "cuda", "runtime": "cuda"}


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("mode", MODES)
def test_state_advances_once_per_call_cuda(mode, compiler):
    run_against_eager(mode, compiler, **CUDA)


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL", "FULL_AND_PIECEWISE"])
def test_pad_rows_after_steady_full_size_calls_hold_the_pad_value_cuda(mode):
    check_pad_rows_after_steady_calls(mode, "inductor", **CUDA)


@pytest.mark.parametrize("mode", MODES)
def test_capture_all_changes_no_state_cuda(mode):
    model, _ = run_against_eager(mode, "inductor", **CUDA)
    state = {name: t.clone() for name, t in model.state_dict().items()}
    cgcompile.capture_all(progress=False)
    torch.cuda.synchronize()
    for name, t in model.state_dict().items():
        assert torch.equal(t, state[name]), f"capture_all changed {name}"


@pytest.mark.parametrize("mode", MODES)
def test_mutated_user_inputs_equal_eager_cuda(mode):
    check_mutated_inputs(mode, "inductor", **CUDA)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_strided_inputs_equal_eager_cuda(mode, layout):
    check_strided_inputs(mode, "inductor", layout, **CUDA)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", PATHS)
def test_hf_generate_matches_eager_cuda(path, mode):
    pytest.importorskip("transformers")
    got, want = generate_tokens(path, {"cudagraph_mode": mode}, device="cuda", new_tokens=12)
    assert got.tolist() == want.tolist()
