"""Padding a batch never changes what the caller sees: graphs whose result padding could change
run the sizes they would pad without graphs (warned once, naming the op); row-wise graphs,
LLM-style ones included, keep padding, and so does a KV-cache write at (slot, position) with a
pad value on the slot, the index that chooses the row."""

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


class SlotPositionCache(torch.nn.Module):
    """Writes each row's key at (its slot, its position) of a KV cache, then reads its slot's
    positions; slot TRASH is a trash slot no row reads."""

    SLOTS, LENGTH = 8, 16
    TRASH = SLOTS

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(self.SLOTS + 1, 2, self.LENGTH, 4))

    def forward(self, h: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        k = self.proj(h).view(-1, 2, 4)
        if self.how == "setitem":
            self.cache[slot, :, pos] = k
        elif self.how == "arange":  # rows from the batch size, as a decode step may number them
            self.cache[torch.arange(k.shape[0]), :, pos] = k
        else:
            self.cache.index_put_((slot[:, None], torch.arange(2), pos[:, None]), k)
        return self.cache[slot].sum(2).flatten(1) + k.flatten(1)


SLOT_CALLS = [3, 5, 3, 4, 5, 3, 8]  # padded (3 -> 4, 5 -> 8) and exact sizes, repeated


def run_slot_cache(how: str, pad: str | None, caplog) -> SlotPositionCache:
    """The compiled model and an eager copy on the same batches, `pad` (`slot`, `pos`) the
    input with a pad value; asserts outputs and every cache row but the trash one each call."""
    torch.manual_seed(0)
    model = SlotPositionCache(how)
    eager = copy.deepcopy(model)
    compiled = compile_model(model, "FULL")
    gen = torch.Generator().manual_seed(0)
    trash = SlotPositionCache.TRASH
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="cgcompile"):
        for n in SLOT_CALLS:
            h = torch.randn(n, 8)
            slot = torch.randperm(SlotPositionCache.SLOTS, generator=gen)[:n]
            pos = torch.randint(0, SlotPositionCache.LENGTH, (n,), generator=gen)
            cgcompile.mark_dynamic_batch(h, slot, pos)
            if pad == "slot":
                cgcompile.mark_dynamic_batch(slot, pad_value=trash)
            elif pad == "pos":  # the last position: still in every real slot
                cgcompile.mark_dynamic_batch(pos, pad_value=SlotPositionCache.LENGTH - 1)
            torch.testing.assert_close(compiled(h, slot, pos), eager(h, slot, pos))
            torch.testing.assert_close(model.cache[:trash], eager.cache[:trash])
    return model


@pytest.mark.parametrize("how", ["setitem", "index_put_"])
def test_a_pad_value_on_the_index_that_chooses_the_row_pads_the_write(how, caplog):
    with cgcompile.counters.expect(num_eager_fallbacks=0, num_cudagraph_captured=2):  # 4 and 8
        model = run_slot_cache(how, "slot", caplog)
    assert model.cache[SlotPositionCache.TRASH].abs().sum() > 0  # padded rows wrote the trash
    assert cgcompile.compiled_graphs()[-1].plan.pad_unsafe is None
    assert not [m for m in caplog.messages if "not padded" in m]


@pytest.mark.parametrize("pad", [None, "pos"], ids=["no_pad_value", "pad_value_on_pos"])
def test_a_write_whose_row_index_has_no_pad_value_is_not_padded(pad, caplog):
    """Padded rows would write real slots (slot 0), whatever `pos` holds: the message names the
    slot as the input to declare."""
    padded_calls = sum(n not in (4, 8) for n in SLOT_CALLS)
    with cgcompile.counters.expect(num_eager_fallbacks=padded_calls):
        run_slot_cache("setitem", pad, caplog)
    (unpadded,) = [m for m in caplog.messages if "not padded" in m]
    declare = unpadded.split("declare one for ")[1].split(" with ")[0]
    assert declare == """["L['slot']"] (the index that chooses the row)""", unpadded
    assert "other indices (read from [\"L['pos']\"]) need no pad value" in unpadded


def test_rows_computed_from_the_batch_size_are_not_padded_whatever_is_declared(caplog):
    """`cache[arange(n), :, pos] = k`: padded rows would write rows n.. (real ones) and no pad
    value steers them, so padded sizes run without graphs, and the message says why."""
    padded_calls = sum(n not in (4, 8) for n in SLOT_CALLS)
    with cgcompile.counters.expect(num_eager_fallbacks=padded_calls):
        run_slot_cache("arange", "pos", caplog)
    (unpadded,) = [m for m in caplog.messages if "not padded" in m]
    assert "rows computed from the batch size (e.g. torch.arange(n))" in unpadded


def test_an_outer_product_write_needs_every_index_pad_value():
    """`cache[slot[:, None], pos[None, :]]` pairs real slots with padded rows' positions: a pad
    value on the slot alone does not keep padded rows out of real slots."""
    cache = torch.zeros(5, 16, 4)

    def outer(slot: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cache.index_put_((slot[:, None], pos[None, :]), torch.ones(4))
        return slot * 2

    verdicts = []

    def backend(gm, example_inputs):
        plan = plan_inputs(gm, example_inputs)
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        slot_only = [i for i, name in enumerate(names) if "slot" in name]
        safety = check_pad_safety(
            gm, example_inputs, plan.batch_exprs, names=names, padded=slot_only
        )
        verdicts.append(safety.reason)
        return gm.forward

    slot, pos = torch.arange(3), torch.arange(3)
    cgcompile.mark_dynamic_batch(slot, pos)
    torch.compile(outer, backend=backend, fullgraph=True)(slot, pos)
    assert verdicts[0] is not None and "rows read from ['l_pos_']" in verdicts[0], verdicts
