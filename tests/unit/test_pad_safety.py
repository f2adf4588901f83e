"""Padding a batch never changes what the caller sees: graphs whose result padding could change
run the sizes they would pad without graphs (warned once, naming the op); row-wise graphs,
LLM-style ones included, keep padding."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import cgcompile
from cgcompile.backend.input_analysis import plan_inputs
from cgcompile.passes.pad_safety import check_pad_safety
from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch
from tests.support.models import CacheStep, silly_model
from tests.support.semantics import (
    GRAPH_MODES,
    ROW_WISE,
    SIZES,
    UNSAFE,
    check_against_eager,
    compile_model,
)


@pytest.mark.parametrize("mode", GRAPH_MODES)
@pytest.mark.parametrize("case", UNSAFE, ids=str)
def test_outputs_padding_could_change_equal_eager(case, mode, caplog):
    fn, names = UNSAFE[case]
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        check_against_eager(compile_model(fn, mode), fn)
    warnings = [m for m in caplog.messages if "not padded" in m]
    assert len(warnings) == 1 and names in warnings[0], caplog.messages


def test_unsafe_graph_uses_graphs_at_capture_sizes_only():
    compiled = compile_model(UNSAFE["sum0"][0], "FULL_AND_PIECEWISE")
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


@pytest.mark.parametrize("fn", ROW_WISE, ids=lambda fn: fn.__name__)
@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_row_wise_graphs_keep_padding(fn, mode):
    with cgcompile.counters.expect(num_eager_fallbacks=0):
        check_against_eager(compile_model(fn, mode), fn)
    assert cgcompile.compiled_graphs()[-1].plan.pad_unsafe is None


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_llm_graphs_keep_padding(mode):
    llama = Llama(LlamaConfig.tiny()).eval()
    eager_llama = copy.deepcopy(llama)
    compiled_llama = compile_model(llama, mode)
    step = CacheStep()
    eager_step = copy.deepcopy(step)
    compiled_step = compile_model(step, mode)
    with torch.no_grad(), cgcompile.counters.expect(num_eager_fallbacks=0):
        for n in SIZES:
            tokens, positions = make_inputs(llama.cfg, n, "cpu")
            mark_batch(llama.cfg, tokens, positions)  # padded rows write the trash slot
            got = compiled_llama(tokens, positions)
            torch.testing.assert_close(got, eager_llama(tokens, positions), rtol=1e-4, atol=1e-4)
            x, slot = torch.randn(n, 8), torch.arange(n)
            cgcompile.mark_dynamic_batch(x, slot)
            cgcompile.mark_dynamic_batch(slot, pad_value=CacheStep.SLOTS)
            torch.testing.assert_close(compiled_step(x, slot), eager_step(x, slot))
    assert all(g.plan.pad_unsafe is None for g in cgcompile.compiled_graphs())


def pad_verdict(fn, *inputs):
    """`check_pad_safety`'s reason for the graph Dynamo traces from `fn(*inputs)`."""
    verdicts = []

    def backend(gm, example_inputs):
        plan = plan_inputs(gm, example_inputs)
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


def test_a_check_whose_graph_never_ran_does_not_call_it_safe():
    """`PadCheck` judges ops during the effects' fake run: without that run it cannot say safe."""
    from cgcompile.passes.pad_safety import PadCheck

    verdicts = []

    def backend(gm, example_inputs):
        plan = plan_inputs(gm, example_inputs)
        verdicts.append(PadCheck(gm, plan.batch_exprs).verdict().reason)
        return gm.forward

    x = torch.randn(4, 8)
    cgcompile.mark_dynamic_batch(x)
    torch.compile(lambda x: x * 2, backend=backend, fullgraph=True)(x)
    assert verdicts == ["could not be checked for padding (the graph did not run)"]
