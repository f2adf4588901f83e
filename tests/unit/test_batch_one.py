"""Batch 1 of a backed dynamic batch: Dynamo traces it apart, and the dynamic graph's compile
serves it, padded to 2 rows, when the two graphs match node by node (`batch_one="padded"`)."""

from __future__ import annotations

import copy
import logging
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cgcompile
from cgcompile.passes.batch_one_match import match_batch_one
from examples.llama import Llama, LlamaConfig, _read_slots, make_inputs, mark_batch
from tests.support.models import CacheStep

SIM = {"graph_runtime": "simulated", "compiler": "eager", "cudagraph_capture_sizes": [1, 2, 4, 8]}
CFG = LlamaConfig(num_layers=2, hidden=32, heads=2, ffn=64, vocab=64, cache_len=32)


def _llama_pair(mode: str, **options):
    torch.manual_seed(0)
    model = Llama(CFG).eval()
    reference = copy.deepcopy(model)
    opts = {**SIM, "cudagraph_mode": mode, **options}
    return torch.compile(model, backend="cudagraph_modes", options=opts), model, reference


def _step(compiled, reference, n: int, decode: bool | None = None) -> None:
    tokens, positions = make_inputs(CFG, n, "cpu")
    mark_batch(CFG, tokens, positions)
    with cgcompile.batch_hint(uniform_decode=decode):
        out = compiled(tokens, positions)
    torch.testing.assert_close(out, reference(tokens, positions))


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL", "FULL_AND_PIECEWISE"])
def test_batch_one_replays_the_dynamic_graph_padded_to_two(mode):
    compiled, model, reference = _llama_pair(mode)
    with torch.no_grad():
        _step(compiled, reference, 8)
        before = cgcompile.counters.snapshot()
        with cgcompile.counters.expect(num_graphs_seen=1, num_graphs_shared=1):
            for decode in (True, False, True, True, False, False):
                _step(compiled, reference, 1, decode)
        for n in (3, 1, 2):
            _step(compiled, reference, n)
    after = cgcompile.counters.snapshot()
    assert after["num_backend_compilations"] == before["num_backend_compilations"]
    torch.testing.assert_close(_read_slots(model), _read_slots(reference))
    (graph,) = cgcompile.compiled_graphs()  # nothing compiled for batch 1
    report = graph.report
    assert report.serves_batch_one and "batch-1 graph, padded to 2 rows" in report.format()
    keys = [k for keys in report.captured.values() for k in keys]
    assert keys and not any(k.startswith("1") for k in keys)  # batch 1 replays size 2


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE"])
def test_a_steady_batch_one_call_reads_only_what_it_copies(mode, monkeypatch):
    """Once captured, a batch-1 call replays without rebuilding Dynamo's argument list (it grows
    with the parameters): the steady state reads the few inputs it checks and copies; a replaced
    parameter still gets graphs of its own."""
    compiled, model, reference = _llama_pair(mode)
    from cgcompile.calls.compiled_graph import CompiledGraph

    with torch.no_grad():
        for n in (8, 1, 1, 1):
            _step(compiled, reference, n, decode=True)
        slow = []
        original = CompiledGraph.__call__
        counted = lambda g, *a: slow.append(1) or original(g, *a)  # noqa: E731
        monkeypatch.setattr(CompiledGraph, "__call__", counted)
        for _ in range(4):
            _step(compiled, reference, 1, decode=True)
        assert slow == []
        weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
        model.lm_head.weight = weight
        reference.lm_head.weight = torch.nn.Parameter(weight.detach().clone())
        for _ in range(4):  # a full check, then graphs of the new instance's own
            _step(compiled, reference, 1, decode=True)
    assert slow and len(slow) < 4
    torch.testing.assert_close(_read_slots(model), _read_slots(reference))


def test_batch_one_own_compiles_it_apart():
    compiled, model, reference = _llama_pair("FULL", batch_one="own")
    with torch.no_grad(), cgcompile.counters.expect(num_graphs_seen=2, num_graphs_shared=0):
        for n in (8, 1, 1, 1):
            _step(compiled, reference, n)
    assert len(cgcompile.compiled_graphs()) == 2


def test_batch_one_first_compiles_both():  # the batch-1 graph came first: nothing to share
    compiled, model, reference = _llama_pair("FULL")
    with torch.no_grad(), cgcompile.counters.expect(num_graphs_seen=2, num_graphs_shared=0):
        for n in (1, 8, 1, 8):
            _step(compiled, reference, n)


class BranchOnOne(torch.nn.Module):
    """Eager takes another branch at one row: Dynamo's batch-1 graph is not the dynamic one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return self.lin(x) * 2
        return self.lin(x)


class SqueezeAll(torch.nn.Module):
    """`squeeze()` drops the batch dim at one row only: the shapes differ at batch 1."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).unsqueeze(1).squeeze() + 1


def _traced(model: torch.nn.Module, sizes: tuple[int, ...]):
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=keep)
    with torch.no_grad():
        for n in sizes:
            x = torch.randn(n, 8)
            cgcompile.mark_dynamic_batch(x)
            compiled(x)
    return graphs


def _batch_exprs(gm):
    from cgcompile.backend.input_analysis import plan_inputs

    values = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
    return plan_inputs(gm, values).batch_exprs


@pytest.mark.parametrize(
    "model, why",
    [(BranchOnOne(), "against"), (SqueezeAll(), "shape")],
    ids=["branch-on-size-1", "squeeze-drops-batch"],
)
def test_a_graph_that_differs_at_batch_one_is_not_matched(model, why):
    dynamic, static = _traced(model, (4, 1))
    match = match_batch_one(dynamic, static, _batch_exprs(dynamic))
    assert match.mismatch is not None and why in match.mismatch


def test_a_graph_of_the_same_ops_matches_with_the_size_positions():
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(CacheStep().eval(), backend=keep)
    with torch.no_grad():
        for n in (4, 1):
            x, slot = torch.randn(n, 8), torch.arange(n)
            cgcompile.mark_dynamic_batch(x, slot)
            compiled(x, slot)
    dynamic, static = graphs
    match = match_batch_one(dynamic, static, _batch_exprs(dynamic))
    assert match.mismatch is None
    values = [n.meta["example_value"] for n in dynamic.graph.nodes if n.op == "placeholder"]
    sizes = tuple(i for i, v in enumerate(values) if isinstance(v, torch.SymInt))
    assert match.size_positions == sizes and sizes


@pytest.mark.parametrize("model", [BranchOnOne(), SqueezeAll()], ids=["branch", "squeeze"])
def test_mismatched_batch_one_compiles_apart_and_matches_eager(model, caplog):
    model = model.eval()
    compiled = torch.compile(
        model, backend="cudagraph_modes", options={**SIM, "cudagraph_mode": "FULL"}
    )
    with torch.no_grad(), caplog.at_level(logging.INFO, "cgcompile.backend.batch_one_sharing"):
        for n in (4, 1, 1, 3, 1):
            x = torch.randn(n, 8)
            cgcompile.mark_dynamic_batch(x)
            torch.testing.assert_close(compiled(x), model(x))
    assert cgcompile.counters.num_graphs_shared == 0
    assert "compiles on its own: it is not graph" in caplog.text
    own = cgcompile.compiled_graphs()[-1].report
    assert own.batch_one_not_shared and own.batch_one_not_shared in own.format()


def test_a_pad_unsafe_graph_does_not_serve_batch_one():
    def total(x: torch.Tensor) -> torch.Tensor:
        return x * x.sum(0)  # rows mix: padding would change every row

    compiled = torch.compile(
        total, backend="cudagraph_modes", options={**SIM, "cudagraph_mode": "FULL"}
    )
    for n in (4, 1, 1):
        x = torch.randn(n, 8)
        cgcompile.mark_dynamic_batch(x)
        torch.testing.assert_close(compiled(x), total(x))
    assert cgcompile.counters.num_graphs_shared == 0 and cgcompile.counters.num_graphs_seen == 2


def _guard_rows(graph):
    """Make the dynamic graph's compiled code refuse fewer than 2 rows (it is compiled for >= 2)."""
    runnable = graph.runnable

    def checked(*args):
        n = graph.plan.batch_size(args)
        assert n is None or n >= 2, f"compiled code ran at {n} rows"
        return runnable(*args)

    graph.runnable = checked


def test_calls_without_graphs_at_batch_one_run_the_traced_graph():
    compiled, model, reference = _llama_pair("FULL")
    with torch.no_grad():
        _step(compiled, reference, 8)
        _guard_rows(cgcompile.compiled_graphs()[0])
        _step(compiled, reference, 1)  # warm-up at 2 rows
        _step(compiled, reference, 1)  # capture
        tokens, positions = make_inputs(CFG, 1, "cpu")
        mark_batch(CFG, tokens, positions)
        held = compiled(tokens, positions)[:, :4]  # a view kept: the next call runs eagerly
        with cgcompile.counters.expect(num_eager_fallbacks=1):
            _step(compiled, reference, 1)
        del held
        results = []
        thread = threading.Thread(target=lambda: results.append(_step(compiled, reference, 1)))
        thread.start()
        thread.join()
    assert results == [None]  # the other thread's call matched eager
    torch.testing.assert_close(_read_slots(model), _read_slots(reference))


def test_manual_mode_at_batch_one_runs_the_traced_graph_and_warns_once(caplog):
    compiled, model, reference = _llama_pair("FULL")
    with torch.no_grad():
        _step(compiled, reference, 8)
        _step(compiled, reference, 1)
        descriptor = cgcompile.BatchDescriptor(num_tokens=1)
        with caplog.at_level(logging.WARNING), cgcompile.counters.expect(num_eager_fallbacks=2):
            for _ in range(2):
                tokens, positions = make_inputs(CFG, 1, "cpu")
                with cgcompile.set_forward_context(cgcompile.CUDAGraphMode.NONE, descriptor):
                    out = compiled(tokens, positions)
                torch.testing.assert_close(out, reference(tokens, positions))
    assert caplog.text.count("manual mode") == 1
    assert cgcompile.compiled_graphs()[0].report.num_eager_fallbacks == 2


def test_trusted_serves_batch_one_through_the_dynamic_graph():
    compiled, model, reference = _llama_pair("FULL")
    fast = cgcompile.trusted(compiled)

    def call(n: int) -> None:
        tokens, positions = make_inputs(CFG, n, "cpu")
        mark_batch(CFG, tokens, positions)
        torch.testing.assert_close(fast(tokens, positions), reference(tokens, positions))

    with torch.no_grad():
        for n in (8, 8, 8, 1, 1, 1):  # each size: warm-up, capture, first replay via Dynamo
            call(n)
        before = fast.calls_through_dynamo
        for n in (1, 1, 8, 1):  # then both replay without Dynamo
            call(n)
    assert fast.calls_through_dynamo == before and fast.refused is None


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 2, 3, 5, 8]), st.booleans()), min_size=1, max_size=8))
def test_any_batch_sequence_after_the_first_compile_matches_eager_and_compiles_nothing(calls):
    if "pair" not in _SHARED:  # one compiled model for every example: its state carries over
        _SHARED["pair"] = _llama_pair("FULL_AND_PIECEWISE")
        with torch.no_grad():
            _step(*_SHARED["pair"][::2], 8)
            _step(*_SHARED["pair"][::2], 1)
    compiled, model, reference = _SHARED["pair"]
    with torch.no_grad(), cgcompile.counters.expect(num_backend_compilations=0, num_graphs_seen=0):
        for n, decode in calls:
            _step(compiled, reference, n, decode)
    torch.testing.assert_close(_read_slots(model), _read_slots(reference))
    assert cgcompile.counters.num_graphs_shared == 1


_SHARED: dict[str, tuple] = {}


def test_a_precompiled_batch_one_graph_is_served_only_by_the_graph_it_was_matched_with():
    """A batch-1 graph rebuilt from a precompiled file skips the node-by-node match: it names
    the dynamic graph that served it when saved (by its code), and no other serves it."""
    from cgcompile.backend.batch_one_sharing import (
        code_digest,
        dynamic_gm_of,
        serve_matched_batch_one,
    )
    from cgcompile.config import CompilationConfig
    from cgcompile.errors import CGCompileError

    compiled, model, reference = _llama_pair("FULL")
    with torch.no_grad():
        _step(compiled, reference, 8)
    (graph,) = cgcompile.compiled_graphs()
    config = CompilationConfig.from_options({**SIM, "cudagraph_mode": "FULL"})
    dynamic_gm = dynamic_gm_of(graph)
    served = []

    def rebuild(gm, example_inputs):  # as the load does, with Dynamo's batch-1 graph
        positions = match_batch_one(dynamic_gm, gm, graph.plan.batch_exprs).size_positions
        with pytest.raises(CGCompileError, match="not loaded"):
            serve_matched_batch_one(gm, example_inputs, config, positions, "0" * 64, gm.forward)
        digest = code_digest(dynamic_gm)
        served.append(
            serve_matched_batch_one(gm, example_inputs, config, positions, digest, gm.forward)
        )
        return served[-1]

    tokens, positions = make_inputs(CFG, 1, "cpu")
    with torch.no_grad():
        out = torch.compile(copy.deepcopy(model), backend=rebuild)(tokens, positions)
        torch.testing.assert_close(out, reference(tokens, positions))
    assert served[0].graph is graph


@pytest.mark.parametrize("marking", ["unbacked", "backed_size_oblivious"])
def test_a_one_row_graph_that_squeezes_the_batch_raises_at_one_row(marking, caplog):
    """A graph whose batch admits one row was traced as if the batch were not 1, so a squeeze
    keeps the batch dim eager drops at one row: its compile warns, calls of one row raise,
    naming the line and the fix; other sizes equal eager's."""
    if marking == "unbacked" and not cgcompile.torch_features.SHARED_UNBACKED_BATCH.available:
        pytest.skip("needs mark_unbacked's shape_id (torch >= 2.11)")
    oblivious = torch.fx.experimental._config.patch(backed_size_oblivious=marking != "unbacked")
    model = SqueezeAll().eval()
    compiled = torch.compile(model, backend="cudagraph_modes", options=SIM)
    with torch.no_grad(), oblivious, caplog.at_level(logging.WARNING, logger="cgcompile"):
        for n in (4, 3):
            x = torch.randn(n, 8)
            cgcompile.mark_dynamic_batch(x, unbacked=marking == "unbacked")
            torch.testing.assert_close(compiled(x), model(x))
        x = torch.randn(1, 8)
        cgcompile.mark_dynamic_batch(x, unbacked=marking == "unbacked")
        assert model(x).shape == (8,)
        where = r"squeeze\(\) \+ 1` \(test_batch_one.py:\d+\) squeezes dim 0"
        with pytest.raises(cgcompile.CGCompileError, match=where):
            compiled(x)
    graph = cgcompile.compiled_graphs()[0]
    assert graph.plan.min_batch == 1 and graph.dispatcher.capture_sizes[0] == 2  # 1 never runs
    warned = [m for m in caplog.messages if "calls of one row will raise" in m]
    assert len(warned) == 1 and "squeezes dim 0" in warned[0]


def test_a_one_row_graph_without_squeezes_serves_one_row():
    """The check names only squeezes of the batch: an unbacked example Llama serves one row."""
    if not cgcompile.torch_features.SHARED_UNBACKED_BATCH.available:
        pytest.skip("needs mark_unbacked's shape_id (torch >= 2.11)")
    compiled, model, reference = _llama_pair("FULL")
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        for n in (4, 1, 3, 1):
            tokens, positions = make_inputs(CFG, n, "cpu")
            mark_batch(CFG, tokens, positions, unbacked=True)
            torch.testing.assert_close(compiled(tokens, positions), reference(tokens, positions))
    assert cgcompile.compiled_graphs()[0].plan.one_row is None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
