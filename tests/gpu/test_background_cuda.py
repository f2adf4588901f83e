"""`capture_all(background=True)` on real CUDA graphs: every call made while the thread
captures equals eager's (logits and KV caches), and calls after it capture nothing."""

from __future__ import annotations

import pytest
import torch

import cgcompile
from tests.support.background import (
    calls_beside_capture,
    compile_pair,
    hf_calls_beside_capture,
    soak,
)

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "PIECEWISE", "FULL"])
def test_calls_during_background_capture_equal_eager_cuda(mode: str) -> None:
    model, reference, compiled = compile_pair("cuda", cudagraph_mode=mode)
    with torch.inference_mode():
        job, during = calls_beside_capture(compiled, model, reference)
        assert job.keys_done == job.total_keys > 0
        with cgcompile.counters.expect(num_cudagraph_captured=0):
            soak(compiled, reference, 200)
    assert during >= 1


def test_hf_static_caches_during_background_capture_equal_eager_cuda() -> None:
    """HF Llama (float32, Inductor pieces) with a `StaticCache` per batch size, calls beside
    the thread."""
    with torch.inference_mode():
        _, during = hf_calls_beside_capture("cuda")
    assert during >= 1
