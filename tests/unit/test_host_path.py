"""The per-call path at the replay floor: the module-instance check is O(1) in the steady state
and still catches a replaced parameter and a second instance; a call whose key is captured
replays from a prebuilt `ReadyCall`; decode steps are recognised from a [batch, q] token input;
`cgcompile.trusted` replays without Dynamo and goes through it when its promise is broken."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import cgcompile
from cgcompile.calls import input_buffers
from cgcompile.calls.parameter_events import EVENTS
from examples.llama import Llama, LlamaConfig, _read_slots, make_inputs, mark_batch
from tests.support.state import compile_model, row_attention

DECODE_SIZES = [4, 4, 4, 2, 4, 8, 3]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(row_attention(self.a(x)))


def _graph() -> cgcompile.CompiledGraph:
    return cgcompile.compiled_graphs()[-1]


def _call(compiled, model, n: int = 4) -> None:
    x = torch.randn(n, 4)
    cgcompile.mark_dynamic_batch(x)
    with torch.no_grad(), cgcompile.batch_hint(uniform_decode=True):
        torch.testing.assert_close(compiled(x), model(x))


def test_the_instance_check_inspects_one_tensor_per_call_in_the_steady_state():
    model = Net().eval()
    compiled = compile_model(model, "FULL")
    _call(compiled, model)
    slots = _graph().instances
    before = slots.full_checks
    for _ in range(20):
        _call(compiled, model)
    assert slots.full_checks == before  # 4 parameters, none compared after the first call


def test_a_replaced_parameter_is_caught_and_gets_graphs_of_its_own():
    model = Net().eval()
    compiled = compile_model(model, "FULL")
    for _ in range(3):
        _call(compiled, model)
    slots = _graph().instances
    events, checks = EVENTS.count, slots.full_checks
    model.b.weight = nn.Parameter(torch.randn(4, 4))  # a registration: one event
    assert EVENTS.count > events
    for _ in range(3):
        _call(compiled, model)  # eager's values with the new weight, not the old graph's
    assert slots.full_checks == checks + 1


def test_a_second_instance_replays_graphs_of_its_own():
    first, second = Net().eval(), Net().eval()
    compiled = [compile_model(m, "FULL") for m in (first, second)]
    for _ in range(3):
        for c, m in zip(compiled, (first, second), strict=True):
            _call(c, m)
    captured = _graph().report.captured["FULL"]
    assert captured == ["4", "4#1"]


def test_two_instances_sharing_a_layer_and_their_buffers_are_told_apart():
    shared = nn.Linear(4, 4)
    first, second = Net().eval(), Net().eval()
    first.a = second.a = shared
    compiled = [compile_model(m, "FULL") for m in (first, second)]
    for _ in range(3):
        for c, m in zip(compiled, (first, second), strict=True):
            _call(c, m)
    assert len(_graph().report.captured["FULL"]) == 2


def test_a_captured_key_replays_without_the_wrappers():
    model = Net().eval()
    compiled = compile_model(model, "FULL")
    for _ in range(3):  # warm-up, capture, first replay (verified)
        _call(compiled, model)
    (wrapper,) = _graph().wrappers
    wrapper.runnable = None  # a call through the wrapper would fail now
    for _ in range(3):
        _call(compiled, model)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_piecewise_replay_calls_no_module(compiler, monkeypatch):
    """The split graph and its eager attention pieces run as their generated code: no
    `nn.Module.__call__` (hooks, a lazy graph module's recompile check) per piece per call."""
    model = Net().eval()
    compiled = compile_model(model, "PIECEWISE", compiler=compiler)
    for _ in range(3):  # warm-up, capture, first replay (verified)
        _call(compiled, model)
    calls = []
    original = nn.Module.__call__

    def counting(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "__call__", counting)
    monkeypatch.setattr(torch.fx.GraphModule, "__call__", counting)
    _call(compiled, model)
    # the compiled model's call, then the eager reference `_call` compares with
    assert calls == ["OptimizedModule", "Net", "Linear", "Linear"]


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "PIECEWISE", "FULL_DECODE_ONLY"])
def test_padded_rows_are_refilled_only_where_a_call_left_data(mode):
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny()).eval()
    eager = copy.deepcopy(model)
    compiled = compile_model(model, mode)
    with torch.no_grad(), cgcompile.batch_hint(uniform_decode=mode != "PIECEWISE"):
        for n in DECODE_SIZES + DECODE_SIZES[::-1]:  # rows n.. of a 4 or 8 buffer hold data
            tokens, positions = make_inputs(model.cfg, n, "cpu")
            mark_batch(model.cfg, tokens, positions)
            got = compiled(tokens, positions)
            torch.testing.assert_close(got, eager(tokens, positions), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["FULL", "PIECEWISE"])
def test_a_loop_at_one_size_pads_nothing_after_a_larger_call(mode, monkeypatch):
    """A decode loop after a prefill: rows the prefill left in the static buffers are padded
    once, not on every step (before, a batch padded to fewer rows than an earlier call wrote
    refilled its pad rows on every call), and the outputs still equal eager's."""
    fills = [0]
    written, pad = input_buffers.Rows.written, input_buffers.InputBuffers.pad

    def count_written(rows, n):
        fills[-1] += rows.dirty > n
        written(rows, n)

    def count_pad(self, i, rows):
        fills[-1] += 1
        pad(self, i, rows)

    monkeypatch.setattr(input_buffers.Rows, "written", count_written)
    monkeypatch.setattr(input_buffers.InputBuffers, "pad", count_pad)
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny()).eval()
    eager = copy.deepcopy(model)
    compiled = compile_model(model, mode)
    with torch.no_grad(), cgcompile.batch_hint(uniform_decode=mode == "FULL"):
        for n in [8, 8, 3, 3, 3, 3, 3, 3]:  # 3 rows padded to 4
            tokens, positions = make_inputs(model.cfg, n, "cpu")
            mark_batch(model.cfg, tokens, positions)
            torch.testing.assert_close(
                compiled(tokens, positions), eager(tokens, positions), rtol=1e-4, atol=1e-4
            )
            fills.append(0)
    assert fills[2] == 2  # the first 3-row call pads the rows the 8-row calls left (2 inputs)
    assert fills[3:8] == [0] * 5  # later calls, the replays of a ready key among them: none


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE"])
def test_a_steady_call_pads_the_rows_a_larger_call_left(mode):
    """A ready key replayed after a larger batch wrote its static rows: the pad rows get the
    pad value again (else the stale row's token writes the KV cache at its old position)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny()).eval()
    eager = copy.deepcopy(model)
    compiled = compile_model(model, mode)
    with torch.no_grad(), cgcompile.batch_hint(uniform_decode=True):
        for step, n in enumerate([3, 3, 3, 8, 8, 8, 3, 3]):  # 3 rows padded to 4
            tokens, positions = make_inputs(
                model.cfg, n, "cpu", torch.Generator().manual_seed(step)
            )
            mark_batch(model.cfg, tokens, positions)
            torch.testing.assert_close(
                compiled(tokens, positions), eager(tokens, positions), rtol=1e-4, atol=1e-4
            )
    torch.testing.assert_close(_read_slots(model), _read_slots(eager), rtol=1e-4, atol=1e-4)


class HFLike(nn.Module):
    """Token ids of shape [batch, seq], as Hugging Face passes `input_ids`."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.out = nn.Linear(8, 16)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        h = torch.nn.functional.scaled_dot_product_attention(h, h, h, is_causal=True)
        return self.out(h)


def _captured_kinds(calls: list[tuple[int, int]]) -> dict[str, list[str]]:
    model = HFLike().eval()
    compiled = compile_model(model, "FULL_AND_PIECEWISE")
    with torch.no_grad():
        for batch, seq in calls:
            ids = torch.randint(0, 16, (batch, seq))
            cgcompile.mark_dynamic_batch(ids)
            torch.testing.assert_close(compiled(ids), model(ids))
    captured: dict[str, list[str]] = {}
    for graph in cgcompile.compiled_graphs():
        for mode, keys in graph.report.captured.items():
            captured.setdefault(mode, []).extend(keys)
    return captured


def test_decode_steps_are_recognised_from_a_batch_by_one_token_input():
    captured = _captured_kinds([(4, 6), (4, 6), (4, 1), (4, 1), (4, 1), (3, 1), (3, 1)])
    assert captured["FULL"] == ["4u4"]  # decode steps replay full graphs, with no hint
    assert all("u" not in key for key in captured["PIECEWISE"])  # the prefill: piecewise


def test_a_hint_overrides_the_shape():
    model = HFLike().eval()
    compiled = compile_model(model, "FULL_AND_PIECEWISE")
    with torch.no_grad(), cgcompile.batch_hint(uniform_decode=False):
        for _ in range(3):
            ids = torch.randint(0, 16, (4, 1))
            cgcompile.mark_dynamic_batch(ids)
            compiled(ids)
    assert not _graph().report.captured.get("FULL")


def test_no_recognition_where_attention_is_below_always():
    model = HFLike().eval()
    options = {"attention_cg_support": "UNIFORM_BATCH"}
    compiled = compile_model(model, "FULL_AND_PIECEWISE", **options)
    with torch.no_grad():
        for _ in range(3):
            ids = torch.randint(0, 16, (4, 1))
            cgcompile.mark_dynamic_batch(ids)
            compiled(ids)
    assert not _graph().plan.decode_by_shape


def _trusted_loop(fast, model, eager, sizes, dtype=torch.long):
    with torch.no_grad(), cgcompile.batch_hint(uniform_decode=True):
        for n in sizes:
            tokens, positions = make_inputs(model.cfg, n, "cpu")
            mark_batch(model.cfg, tokens, positions)
            got = fast(tokens.to(dtype), positions)
            torch.testing.assert_close(got, eager(tokens, positions), rtol=1e-4, atol=1e-4)


def _trusted_llama(mode: str = "FULL"):
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny()).eval()
    eager = copy.deepcopy(model)
    fast = cgcompile.trusted(compile_model(model, mode))
    return fast, model, eager


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE", "PIECEWISE"])
def test_trusted_replays_without_dynamo_and_equals_eager(mode):
    fast, model, eager = _trusted_llama(mode)
    _trusted_loop(fast, model, eager, [4, 4, 4, 3])  # warm-up, capture, replay; 3 pads to 4
    through = fast.calls_through_dynamo
    _trusted_loop(fast, model, eager, [4, 3, 4, 3, 4])
    assert fast.calls_through_dynamo == through


def test_trusted_goes_through_dynamo_when_a_dtype_changes():
    fast, model, eager = _trusted_llama()
    _trusted_loop(fast, model, eager, [4, 4, 4])
    through = fast.calls_through_dynamo
    _trusted_loop(fast, model, eager, [4], dtype=torch.int32)  # Dynamo guards, recompiles
    assert fast.calls_through_dynamo == through + 1


def test_trusted_goes_through_dynamo_in_the_other_grad_mode():
    fast, model, eager = _trusted_llama()
    _trusted_loop(fast, model, eager, [4, 4, 4])
    through = fast.calls_through_dynamo
    tokens, positions = make_inputs(model.cfg, 4, "cpu")
    out = fast(tokens, positions)  # grad mode: autograd, no graphs
    assert out.requires_grad and fast.calls_through_dynamo == through + 1


def test_trusted_refuses_a_graph_break_once_and_stays_exact(caplog):
    class Broken(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            torch._dynamo.graph_break()
            return self.b(row_attention(h))

    model = Broken().eval()
    fast = cgcompile.trusted(compile_model(model, "FULL"))
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        for _ in range(4):
            _call(fast, model)
    assert "graph break" in fast.refused
    assert len([m for m in caplog.messages if "cgcompile.trusted" in m]) == 1


def test_trusted_refuses_python_work_after_the_graph(caplog):
    class Dict(Net):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"out": super().forward(x)}

    model = Dict().eval()
    fast = cgcompile.trusted(compile_model(model, "FULL"))
    x = torch.randn(4, 4)
    cgcompile.mark_dynamic_batch(x)
    with torch.no_grad(), cgcompile.batch_hint(uniform_decode=True):
        for _ in range(3):
            torch.testing.assert_close(fast(x)["out"], model(x)["out"])
    assert "returns dict" in fast.refused
