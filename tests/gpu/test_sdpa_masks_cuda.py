"""Boolean SDPA masks made additive before the split (`passes.sdpa_masks`), on CUDA with the
SDPA kernel torch picks there (cuDNN on H100/H200): outputs and cache equal eager's bit for bit,
rows that allow no key included (the fill eager's kernel uses is the one the graph makes)."""

from __future__ import annotations

import copy

import pytest
import torch

import cgcompile
from tests.unit.test_sdpa_masks import MaskedLayers

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "PIECEWISE"])
def test_boolean_masks_equal_eager_bitwise_cuda(mode: str) -> None:
    torch.manual_seed(0)
    model = MaskedLayers(strict=True).cuda().bfloat16().eval()
    reference = copy.deepcopy(model)
    options = {"compiler": "eager", "cudagraph_mode": mode, "cudagraph_capture_sizes": [2, 4, 8]}
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    captured = cgcompile.counters.num_cudagraph_captured
    with torch.no_grad():
        for n in (3, 8, 2, 5, 8):
            g = torch.Generator().manual_seed(n)
            x = torch.randn(n, 8, generator=g).cuda().bfloat16()
            slot = torch.randperm(8, generator=g)[:n].cuda()
            pos = torch.randint(0, 16, (n,), generator=g)
            pos[0] = 0  # `keys < 0`: a row that allows no key
            pos = pos.cuda()
            cgcompile.mark_dynamic_batch(x, pos)
            cgcompile.mark_dynamic_batch(slot, pad_value=8)
            out, expected = compiled(x, slot, pos), reference(x, slot, pos)
            torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(
                model.cache[:, :8], reference.cache[:, :8], rtol=0, atol=0, equal_nan=True
            )
    assert cgcompile.counters.num_cudagraph_captured > captured
