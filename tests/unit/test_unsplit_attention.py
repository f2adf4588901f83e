"""Attention below ALWAYS that the splitting ops leave inside a captured piece: piecewise
graphs would replay it with every kind of batch, so the mode is lowered with a WARNING naming
the op (PIECEWISE -> NONE, FULL_AND_PIECEWISE -> FULL_DECODE_ONLY where decode graphs allow)."""

from __future__ import annotations

import logging

import pytest
import torch

import cgcompile
from cgcompile import AttentionCGSupport, CUDAGraphMode
from cgcompile.backend.resolution import Rule, resolve_cudagraph_mode
from tests.support import silly
from tests.support.models import dyn, silly_closed_form, silly_model

NEVER, SINGLE = AttentionCGSupport.NEVER, AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
ALWAYS = AttentionCGSupport.ALWAYS


@pytest.fixture
def silly_never():
    silly.register_as_attention("NEVER")
    yield
    silly.register_as_attention("ALWAYS")


@pytest.mark.parametrize(
    ("mode", "support", "expected"),
    [
        (CUDAGraphMode.PIECEWISE, NEVER, CUDAGraphMode.NONE),
        (CUDAGraphMode.PIECEWISE, SINGLE, CUDAGraphMode.NONE),
        (CUDAGraphMode.FULL_AND_PIECEWISE, SINGLE, CUDAGraphMode.FULL_DECODE_ONLY),
        (CUDAGraphMode.FULL_AND_PIECEWISE, NEVER, CUDAGraphMode.NONE),
    ],
    ids=["piecewise-never", "piecewise-single", "fap-single", "fap-never"],
)
def test_unsplit_attention_below_always_lowers_piecewise(mode, support, expected):
    res = resolve_cudagraph_mode(
        mode, support, splits_attention=False, unsplit_attention={"my::attn": support}
    )
    assert res.mode == expected
    assert res.reasons[0].rule == Rule.ATTENTION_NOT_SPLIT
    assert "my::attn" in res.reasons[0].cause and "splitting_ops" in res.reasons[0].cause


def test_unsplit_attention_with_always_keeps_piecewise():
    res = resolve_cudagraph_mode(
        CUDAGraphMode.PIECEWISE, ALWAYS, splits_attention=False, unsplit_attention={"a": ALWAYS}
    )
    assert res.mode == CUDAGraphMode.PIECEWISE and res.reasons == ()


def test_never_attention_outside_the_splits_runs_without_graphs(silly_never, caplog):
    f = torch.compile(
        silly_model,
        backend="cudagraph_modes",
        options={
            "graph_runtime": "simulated",
            "cudagraph_mode": "PIECEWISE",
            "compiler": "eager",
            "splitting_ops": ["aten::scaled_dot_product_attention"],
            "cudagraph_capture_sizes": [2, 4],
        },
    )
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        with cgcompile.counters.expect(num_cudagraph_captured=0):
            for _ in range(3):
                x = dyn(torch.randn(4))
                torch.testing.assert_close(f(x), silly_closed_form(x))
    assert cgcompile.compiled_graphs()[-1].report.mode == "NONE"
    assert "ATTENTION_NOT_SPLIT" in caplog.text and "silly::attention (NEVER)" in caplog.text
