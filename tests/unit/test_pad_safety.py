"""Padding a batch never changes what the caller sees: graphs whose result padding could change
run the sizes they would pad without graphs (warned once, naming the op); row-wise graphs,
LLM-style ones included, keep padding."""

from __future__ import annotations

import logging

import pytest
import torch

import cgcompile
from cgcompile.backend.inputs import InputPlan
from cgcompile.passes.pad_safety import check_pad_safety
from examples.llama import Llama, LlamaConfig, make_inputs
from tests.support.models import CacheStep, silly_model

SIM = {"graph_runtime": "simulated", "cudagraph_capture_sizes": [1, 2, 4, 8], "compiler": "eager"}
GRAPH_MODES = ["PIECEWISE", "FULL", "FULL_AND_PIECEWISE"]
SIZES = [4, 3, 3, 5, 8, 6]  # exact, padded (3 -> 4, 5 -> 8, 6 -> 8), repeated


def row_attention(h: torch.Tensor) -> torch.Tensor:
    """SDPA with each row its own sequence: rows stay independent."""
    q = h.unsqueeze(1)
    return torch.nn.functional.scaled_dot_product_attention(q, q.sin(), q.cos()).squeeze(1)


def y_of(x: torch.Tensor) -> torch.Tensor:
    return row_attention(x * 2)


UNSAFE = {
    "transposed": (lambda x: y_of(x).t(), "output 0 has shape (8, s"),
    "flattened": (lambda x: y_of(x).reshape(-1), "output 0 has shape (8*s"),
    "cat": (lambda x: torch.cat([y_of(x), x]), "aten.cat"),
    "sum0": (lambda x: y_of(x).sum(0), "y_of(x).sum(0)"),
    "mean": (lambda x: y_of(x).mean(), "aten.mean"),
    "last_row": (lambda x: y_of(x)[-1], "counted from the end"),
    "batch_size": (lambda x: (y_of(x), x.shape[0]), "output 1 is"),
}


def compile_fn(fn, mode):
    return torch.compile(fn, backend="cudagraph_modes", options={**SIM, "cudagraph_mode": mode})


def assert_same(got, want):
    if isinstance(want, tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
    elif isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want)
    else:
        assert got == want and type(got) is type(want)


@pytest.mark.parametrize("mode", GRAPH_MODES)
@pytest.mark.parametrize("case", UNSAFE, ids=str)
def test_outputs_padding_could_change_equal_eager(case, mode, caplog):
    fn, names = UNSAFE[case]
    compiled = compile_fn(fn, mode)
    with caplog.at_level(logging.WARNING, logger="cgcompile"), torch.no_grad():
        for n in SIZES:
            x = torch.randn(n, 8)
            cgcompile.mark_dynamic_batch(x)
            assert_same(compiled(x), fn(x))
    warnings = [m for m in caplog.messages if "not padded" in m]
    assert len(warnings) == 1 and names in warnings[0], caplog.messages


def test_unsafe_graph_uses_graphs_at_capture_sizes_only():
    compiled = compile_fn(UNSAFE["sum0"][0], "FULL_AND_PIECEWISE")
    with torch.no_grad():
        for calls, n in enumerate((4, 4, 3, 5)):  # 4: warm-up, then capture; 3 and 5 would pad
            x = torch.randn(n, 8)
            cgcompile.mark_dynamic_batch(x)
            with cgcompile.counters.expect(
                num_cudagraph_captured=2 if calls == 1 else 0,  # 2 pieces around SDPA
                num_eager_fallbacks=int(n != 4),
            ):
                torch.testing.assert_close(compiled(x), UNSAFE["sum0"][0](x))
    report = cgcompile.compiled_graphs()[-1].format_report()
    assert "padding off: `" in report


def heads_view(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    h = x.view(n, 2, 4).softmax(-1).reshape(n, 8)
    return row_attention(h) + x.flatten().view(n, 8)


def causal_self_attention(x: torch.Tensor) -> torch.Tensor:
    q = x[None, None]
    return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)[0, 0]


def first_row_into_state(x: torch.Tensor) -> torch.Tensor:
    y = row_attention(x)
    return y + y[0]


@pytest.mark.parametrize(
    "fn", [row_attention, heads_view, causal_self_attention, first_row_into_state], ids=str
)
@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_row_wise_graphs_keep_padding(fn, mode):
    compiled = compile_fn(fn, mode)
    with torch.no_grad(), cgcompile.counters.expect(num_eager_fallbacks=0):
        for n in SIZES:
            x = torch.randn(n, 8)
            cgcompile.mark_dynamic_batch(x)
            torch.testing.assert_close(compiled(x), fn(x))
    assert cgcompile.compiled_graphs()[-1].plan.pad_unsafe is None


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_llm_graphs_keep_padding(mode):
    llama = Llama(LlamaConfig.tiny()).eval()
    compiled_llama = torch.compile(
        llama, backend="cudagraph_modes", options={**SIM, "cudagraph_mode": mode}
    )
    step = CacheStep()
    compiled_step = compile_fn(step, mode)
    with torch.no_grad(), cgcompile.counters.expect(num_eager_fallbacks=0):
        for n in SIZES:
            tokens, positions = make_inputs(llama.cfg, n, "cpu")
            cgcompile.mark_dynamic_batch(tokens, positions)
            compiled_llama(tokens, positions)
            x, slot = torch.randn(n, 8), torch.arange(n)
            cgcompile.mark_dynamic_batch(x, slot)
            cgcompile.mark_dynamic_batch(slot, pad_value=CacheStep.SLOTS)
            compiled_step(x, slot)
    assert all(g.plan.pad_unsafe is None for g in cgcompile.compiled_graphs())


def pad_verdict(fn, *inputs):
    """`check_pad_safety`'s reason for the graph Dynamo traces from `fn(*inputs)`."""
    verdicts = []

    def backend(gm, example_inputs):
        plan = InputPlan.from_graph(gm, example_inputs)
        verdicts.append(check_pad_safety(gm, example_inputs, plan.batch_exprs).reason)
        return gm.forward

    cgcompile.mark_dynamic_batch(*inputs)
    torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    return verdicts[0]


def sdpa_over_rows(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(x[None], x[None], x[None])


def histogram_of_rows(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros(4, 8).index_add(0, torch.zeros_like(x[:, 0]).long(), x)


RULES = {
    "softmax_over_batch": (lambda x: x.softmax(0), "combines elements along the batch dim"),
    "cumsum_over_batch": (lambda x: x.cumsum(0), "combines elements along the batch dim"),
    "flip_batch": (lambda x: x.flip(0), "combines elements along the batch dim"),
    "batch_size_as_value": (lambda x: x * x.shape[0], "uses the batch size as a value"),
    "slice_of_batch": (lambda x: x[1:], "gives a dim the size s"),
    "contract_batch": (lambda x: x.t() @ x, "contracts over the batch dim"),
    "norm_over_batch": (lambda x: torch.nn.functional.layer_norm(x.t(), (x.shape[0],)), "over"),
    "transposed_flatten": (lambda x: x.t().reshape(-1), "together with the dims before"),
    "sdpa_keys_are_rows": (sdpa_over_rows, "attends over the batch rows as keys"),
    "scatter_rows": (histogram_of_rows, "writes batch rows into a tensor without the batch"),
    "rows_split_and_merged": (lambda x: x.view(-1, 4).sum(-1).view(x.shape[0], 2), None),
    "reduce_within_rows": (lambda x: x.softmax(-1).sum(-1), None),
}


@pytest.mark.parametrize("case", RULES)
def test_pad_safety_rules(case):
    fn, why = RULES[case]
    reason = pad_verdict(fn, torch.randn(3, 8))
    if why is None:
        assert reason is None
    else:
        assert reason is not None and why in reason, reason


def test_silly_attention_is_trusted_row_wise():
    assert pad_verdict(silly_model, torch.randn(3)) is None
