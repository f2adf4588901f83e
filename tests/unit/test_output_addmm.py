"""The post-grad pass keeping a piece output's residual add out of cuBLAS (`passes.output_addmm`).

Graphs are traced on fake CUDA tensors (no GPU needed) and, rewritten, run on CPU tensors."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from cgcompile.passes.output_addmm import OutputAddmmPass, unfuse_output_addmm

aten = torch.ops.aten


def _trace(fn, *shapes, device="cuda"):
    with FakeTensorMode():
        args = [torch.empty(s, device=device) for s in shapes]
        return make_fx(fn)(*args)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _residual_then_norm(r, x, w):
    h = aten.addmm(r, x, w)
    return h, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True))


def _two_residuals(r, x, w, w2):
    h = aten.addmm(r, x, w)
    h2 = aten.addmm(h, h * 2, w2)
    return h2, h2.sin()


def test_an_output_residual_with_a_pointwise_user_becomes_mm_plus_add_and_computes_the_same():
    gm = _trace(_residual_then_norm, (4, 8), (4, 16), (16, 8))
    assert unfuse_output_addmm(gm.graph) == 1
    gm.recompile()
    assert aten.addmm.default not in _targets(gm)
    assert _targets(gm)[:2] == [aten.mm.default, aten.add.Tensor]
    add = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor)
    assert add.meta["val"].shape == (4, 8) and add.args[1].meta["val"].shape == (4, 8)
    r, x, w = torch.randn(4, 8), torch.randn(4, 16), torch.randn(16, 8)
    for got, want in zip(gm(r, x, w), _residual_then_norm(r, x, w), strict=True):
        torch.testing.assert_close(got, want)


def test_a_chain_of_residual_adds_unfuses_whole():
    gm = _trace(_two_residuals, (4, 8), (4, 16), (16, 8), (8, 8))
    assert unfuse_output_addmm(gm.graph) == 2
    assert aten.addmm.default not in _targets(gm)


@pytest.mark.parametrize(
    ("fn", "shapes", "device"),
    [
        pytest.param(_residual_then_norm, [(8,), (4, 16), (16, 8)], "cuda", id="a-bias"),
        pytest.param(_residual_then_norm, [(4, 8), (4, 16), (16, 8)], "cpu", id="on-cpu"),
        pytest.param(
            lambda r, x, w: (aten.addmm(r, x, w),),
            [(4, 8), (4, 16), (16, 8)],
            "cuda",
            id="no-pointwise-user",
        ),
        pytest.param(
            lambda r, x, w: (lambda h: (h, h @ w.t()))(aten.addmm(r, x, w)),
            [(4, 8), (4, 16), (16, 8)],
            "cuda",
            id="a-matmul-user",
        ),
        pytest.param(
            lambda r, x, w: (lambda h: (h, h.cos()))(aten.addmm(r, x, w, beta=2)),
            [(4, 8), (4, 16), (16, 8)],
            "cuda",
            id="beta-2",
        ),
    ],
)
def test_other_addmm_stay(fn, shapes, device):
    gm = _trace(fn, *shapes, device=device)
    assert unfuse_output_addmm(gm.graph) == 0
    assert aten.addmm.default in _targets(gm)


class _Counting(torch._inductor.custom_graph_pass.CustomGraphPass):
    def __init__(self, uuid):
        self.calls, self._uuid = 0, uuid

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return self._uuid


def test_the_pass_runs_after_the_configured_one_and_keys_the_cache_on_it():
    gm = _trace(_residual_then_norm, (4, 8), (4, 16), (16, 8))
    earlier = _Counting("v1")
    with torch._inductor.config.patch(post_grad_custom_post_pass=earlier):
        chained = OutputAddmmPass.after_configured()
    chained(gm.graph)
    assert earlier.calls == 1 and aten.addmm.default not in _targets(gm)
    assert chained.uuid() != OutputAddmmPass(_Counting("v2")).uuid()
    assert OutputAddmmPass().uuid() is not None
    assert OutputAddmmPass(lambda g: None).uuid() is None  # uncacheable, as without the pass
    with torch._inductor.config.patch(post_grad_custom_post_pass=chained):
        assert OutputAddmmPass.after_configured() is chained


def test_a_symbolic_batch_is_compared_without_a_guard():
    """A bias as long as the batch's hint (8): `8 == s` would specialize the batch to 8."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    shape_env = ShapeEnv()
    symbol = shape_env.create_symbol(8, ConstantSource("batch"), DimDynamic.DYNAMIC)
    batch = shape_env.create_symintnode(symbol, hint=8)
    with FakeTensorMode(shape_env=shape_env):
        shapes = [(batch, 8), (8,), (batch, 16), (16, 8)]
        r, bias, x, w = [torch.empty(s, device="cuda") for s in shapes]

        def fn(r, bias, x, w):
            return _residual_then_norm(r, x, w) + _residual_then_norm(bias, x, w)

        gm = make_fx(fn)(r, bias, x, w)
    assert unfuse_output_addmm(gm.graph) == 1  # the residual, not the bias
    assert shape_env.guards == []


def test_every_piece_compile_runs_the_pass(monkeypatch):
    """Wired into Inductor's post-grad passes for each piece (caches off: a hit runs none)."""
    import cgcompile.passes.output_addmm as output_addmm
    from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch

    graphs = []
    original = output_addmm.unfuse_output_addmm
    monkeypatch.setattr(
        output_addmm, "unfuse_output_addmm", lambda g: graphs.append(g) or original(g)
    )
    model = Llama(LlamaConfig.tiny()).eval()
    options = {"graph_runtime": "simulated", "compiler": "inductor"}
    f = torch.compile(model, backend="cudagraph_modes", options=options)
    tokens, positions = make_inputs(model.cfg, 8, "cpu")
    mark_batch(model.cfg, tokens, positions)
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
        torch.no_grad(),
    ):
        torch.testing.assert_close(f(tokens, positions), model(tokens, positions))
    assert len(graphs) == 3  # the 2-layer model's three capturable pieces
