"""The per-call path on real CUDA graphs: prebuilt steady-state calls with padded rows refilled
only where needed, decode steps recognised from a [batch, 1] token input, and
`cgcompile.trusted` and `cgcompile.guarded` replaying without Dynamo, each against eager."""

from __future__ import annotations

import copy

import pytest
import torch

import cgcompile
from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch
from tests.support.state import compile_model

pytestmark = pytest.mark.cuda
SIZES = [4, 4, 4, 2, 4, 8, 3, 8, 3, 1, 4]
OPT_INS = {"compiled": lambda c: c, "trusted": cgcompile.trusted, "guarded": cgcompile.guarded}


def _llama() -> tuple[Llama, Llama]:
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny()).to("cuda").eval()
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("opt_in", OPT_INS)
@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE", "PIECEWISE"])
def test_decode_steps_equal_eager_cuda(mode, opt_in):
    model, eager = _llama()
    compiled = compile_model(model, mode, "inductor", "cuda")
    call = OPT_INS[opt_in](compiled)
    with torch.no_grad(), cgcompile.batch_hint(uniform_decode=mode != "PIECEWISE"):
        for n in SIZES + SIZES[::-1]:
            tokens, positions = make_inputs(model.cfg, n, "cuda")
            mark_batch(model.cfg, tokens, positions)
            got = call(tokens, positions)
            torch.testing.assert_close(got, eager(tokens, positions), rtol=1e-3, atol=1e-3)
    assert cgcompile.counters.num_cudagraph_captured > 0
    if opt_in != "compiled":
        assert call.refused is None


def test_decode_steps_recognised_from_the_shape_cuda():
    class HFLike(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(16, 64)
            self.out = torch.nn.Linear(64, 16)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(input_ids)
            h = torch.nn.functional.scaled_dot_product_attention(h, h, h, is_causal=True)
            return self.out(h)

    model = HFLike().cuda().eval()
    compiled = compile_model(model, "FULL_AND_PIECEWISE", "inductor", "cuda")
    with torch.no_grad():
        for shape in [(4, 6), (4, 6), (4, 1), (4, 1), (4, 1), (2, 1), (2, 1)]:
            ids = torch.randint(0, 16, shape, device="cuda")
            cgcompile.mark_dynamic_batch(ids)
            torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-3, atol=1e-3)
    full = [k for g in cgcompile.compiled_graphs() for k in g.report.captured.get("FULL", [])]
    assert "4u4" in full  # the decode steps replayed full graphs, with no hint


@pytest.mark.parametrize("opt_in", OPT_INS)
def test_a_middle_parameters_swapped_data_is_read_after_the_swap_cuda(opt_in):
    """Real graphs bake in addresses: after `p.data = t` on a parameter that is neither the
    first nor the last, the next calls must read `t` (its old storage freed is an event)."""
    model, eager = _llama()
    compiled = compile_model(model, "FULL", "inductor", "cuda")
    call = OPT_INS[opt_in](compiled)
    name = [n for n, _ in model.named_parameters()][len(list(model.parameters())) // 2]
    with torch.no_grad(), cgcompile.batch_hint(uniform_decode=True):
        for swap in (False, False, True, False, False):
            if swap:
                new = torch.randn_like(model.get_parameter(name))
                model.get_parameter(name).data = new
                eager.get_parameter(name).data = new.clone()
            for n in (4, 4, 8, 4):
                tokens, positions = make_inputs(model.cfg, n, "cuda")
                mark_batch(model.cfg, tokens, positions)
                got = call(tokens, positions)
                torch.testing.assert_close(got, eager(tokens, positions), rtol=1e-3, atol=1e-3)
