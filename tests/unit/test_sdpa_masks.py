"""Boolean SDPA masks made additive once before the split (`passes.sdpa_masks`): the split
graph computes what eager computes, bit for bit, with one conversion per mask."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import cgcompile
from cgcompile.passes.op_match import OpMatcher
from cgcompile.passes.sdpa_masks import SDPA
from cgcompile.passes.split import split_graph
from tests.unit.test_split import trace

SDPA_MATCHER = OpMatcher([F.scaled_dot_product_attention])


def two_layers(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Two attention calls sharing one boolean mask built from the positions."""
    mask = (torch.arange(x.shape[2], device=x.device) <= pos[:, None])[:, None, None, :]
    q = x[:, :, -1:]
    h = F.scaled_dot_product_attention(q, x, x, attn_mask=mask)
    return F.scaled_dot_product_attention(h * 2, x, x, attn_mask=mask)


def per_call_masks(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One mask per call (as a model whose layers each build it): one conversion per call."""
    h = x[:, :, -1:]
    for _ in range(3):
        mask = (torch.arange(x.shape[2], device=x.device) <= pos[:, None])[:, None, None, :]
        h = F.scaled_dot_product_attention(h, x, x, attn_mask=mask) + 1
    return h


def written_mask(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """A mask written in place between its two uses: left alone."""
    mask = (torch.arange(x.shape[2], device=x.device) <= pos[:, None])[:, None, None, :]
    h = F.scaled_dot_product_attention(x[:, :, -1:], x, x, attn_mask=mask)
    mask[..., 0] = False
    return F.scaled_dot_product_attention(h, x, x, attn_mask=mask)


def inputs(batch: int = 3, keys: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch * 100 + keys)
    return torch.randn(batch, 2, keys, 8, generator=g), torch.randint(
        0, keys, (batch,), generator=g
    )


def eager_masks(result_gm: torch.fx.GraphModule) -> list[torch.dtype]:
    """The dtypes of the masks the split graph's SDPA calls take (its splitting pieces)."""
    dtypes = []
    for module in result_gm.modules():
        for node in getattr(module, "graph", torch.fx.Graph()).nodes:
            if node.target is SDPA:
                mask = node.kwargs["attn_mask"]
                dtypes.append(mask.meta["example_value"].dtype)
    return dtypes


def test_one_conversion_per_mask_and_outputs_bit_equal() -> None:
    x, pos = inputs()
    traced = trace(two_layers, x, pos)
    result = split_graph(traced.gm, SDPA_MATCHER)
    assert eager_masks(result.split_gm) == [torch.float32, torch.float32]
    # the conversion runs once, in the piece before the first call
    conversions = [
        n
        for item in result.capturable
        for n in item.graph.graph.nodes
        if n.target is torch.logical_not
    ]
    assert len(conversions) == 1
    assert torch.equal(result.split_gm(*traced.args)[0], two_layers(x, pos))


def test_a_mask_per_call_is_converted_per_call() -> None:
    x, pos = inputs()
    traced = trace(per_call_masks, x, pos)
    result = split_graph(traced.gm, SDPA_MATCHER)
    assert eager_masks(result.split_gm) == [torch.float32] * 3
    assert torch.equal(result.split_gm(*traced.args)[0], per_call_masks(x, pos))


def test_a_mask_written_in_place_is_left_boolean() -> None:
    x, pos = inputs()
    traced = trace(written_mask, x.clone(), pos)
    result = split_graph(traced.gm, SDPA_MATCHER)
    assert eager_masks(result.split_gm) == [torch.bool, torch.bool]
    assert torch.equal(result.split_gm(*traced.args)[0], written_mask(x, pos))


def test_unsplit_graph_is_left_alone() -> None:
    x, pos = inputs()
    traced = trace(two_layers, x, pos)
    result = split_graph(traced.gm, OpMatcher([]))
    sdpa = [n for n in result.split_gm.submod_0.graph.nodes if n.target is SDPA]
    assert [n.kwargs["attn_mask"].meta["example_value"].dtype for n in sdpa] == [torch.bool] * 2


class MaskedLayers(torch.nn.Module):
    """Layers that write a KV row per request and attend over it with a boolean mask."""

    def __init__(self, layers: int = 3, rows: int = 9, keys: int = 16, strict: bool = False):
        super().__init__()
        self.strict = strict  # keys < pos: a row at pos 0 allows no key
        self.proj = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(layers))
        self.register_buffer("cache", torch.zeros(layers, rows, 2, keys, 8))

    def forward(self, x: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        keys = torch.arange(self.cache.shape[3], device=x.device)
        allowed = keys < pos[:, None] if self.strict else keys <= pos[:, None]
        mask = allowed[:, None, None, :]
        h = x
        for i, proj in enumerate(self.proj):
            h = proj(h)
            q = h[:, None, None].expand(-1, 2, 1, -1)  # [n, heads, 1, 8]
            self.cache[i, slot, :, pos] = q[:, :, 0]
            rows = self.cache[i, slot]
            h = h + F.scaled_dot_product_attention(q, rows, rows, attn_mask=mask).sum((1, 2))
        return h


@pytest.mark.parametrize("strict", [False, True], ids=["every-row-allows-a-key", "empty-rows"])
@settings(max_examples=8, deadline=None)
@given(sizes=st.lists(st.integers(1, 8), min_size=1, max_size=4))
def test_compiled_model_with_boolean_masks_equals_eager(strict: bool, sizes: list[int]) -> None:
    """Calls of any batch (padded or not) leave outputs and the cache as eager's, bit for bit
    (eager pieces: nothing but the mask's place changes), rows that allow no key included."""
    torch.manual_seed(0)
    model = MaskedLayers(strict=strict).eval()
    reference = copy.deepcopy(model)
    options = {
        "graph_runtime": "simulated",
        "compiler": "eager",
        "cudagraph_capture_sizes": [2, 4, 8],
    }
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    with torch.no_grad():
        for n in sizes:
            g = torch.Generator().manual_seed(n)
            x = torch.randn(n, 8, generator=g)
            slot = torch.randperm(8, generator=g)[:n]
            pos = torch.randint(0, 16, (n,), generator=g)
            cgcompile.mark_dynamic_batch(x, pos)
            cgcompile.mark_dynamic_batch(slot, pad_value=8)  # row 8: a trash slot
            pos[0] = 0  # with `strict`, a row that allows no key
            exact = {"rtol": 0, "atol": 0, "equal_nan": True}
            torch.testing.assert_close(compiled(x, slot, pos), reference(x, slot, pos), **exact)
            # every row but the trash row
            torch.testing.assert_close(model.cache[:, :8], reference.cache[:, :8], **exact)


def test_pieces_with_converted_masks_stay_cacheable() -> None:
    """The conversion's nodes keep AOTAutograd's cache usable (a warm restart loads the pieces
    instead of tracing them again): no compile bypasses it."""
    from torch._dynamo.utils import counters

    model = MaskedLayers().eval()
    options = {"graph_runtime": "simulated", "cudagraph_capture_sizes": [2, 4]}
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    counters.clear()
    with torch.no_grad():
        x, slot, pos = torch.randn(4, 8), torch.arange(4), torch.tensor([0, 3, 5, 15])
        cgcompile.mark_dynamic_batch(x, pos)
        cgcompile.mark_dynamic_batch(slot, pad_value=8)
        compiled(x, slot, pos)
    aot = counters["aot_autograd"]
    assert aot["total"] >= 2 and aot["autograd_cache_bypass"] == 0, dict(aot)
