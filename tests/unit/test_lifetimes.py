"""Lifetimes: compiled graphs hold a model's parameters weakly, so a deleted model and its
graphs are freed; every live instance of a class gets graphs of its own (a bounded number);
capture_all works after calls under torch.no_grad() on a stateful model."""

from __future__ import annotations

import copy
import gc
import logging
import weakref

import pytest
import torch
from torch import nn

import cgcompile
from cgcompile.calls.instances import MAX_INSTANCES
from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch
from tests.support.models import Block

SIM = {"graph_runtime": "simulated", "cudagraph_capture_sizes": [1, 2, 4, 8], "compiler": "eager"}
GRAPH_MODES = ["PIECEWISE", "FULL", "FULL_AND_PIECEWISE"]


_first_id = 0


@pytest.fixture(autouse=True)
def _only_new_graphs() -> None:
    """Graphs of earlier tests may stay alive (Dynamo keeps a module's compiled functions in
    its globals): each test looks at its own."""
    global _first_id
    _first_id = max((g.report_id + 1 for g in cgcompile.compiled_graphs()), default=0)


def new_graphs() -> list[cgcompile.CompiledGraph]:
    return [g for g in cgcompile.compiled_graphs() if g.wrappers and g.report_id >= _first_id]


def compile_model(model: nn.Module, mode: str) -> nn.Module:
    options = {**SIM, "cudagraph_mode": mode}
    return torch.compile(model, backend="cudagraph_modes", options=options)


def run(compiled, model, n: int = 4) -> None:
    x = torch.randn(n, 8)
    cgcompile.mark_dynamic_batch(x)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_deleted_model_frees_its_parameters_and_graphs(mode):
    model = Block()
    compiled = compile_model(model, mode)
    for _ in range(3):  # warm-up, capture, replay
        run(compiled, model)
    weight = weakref.ref(model.lin.weight)
    (graph,) = new_graphs()
    assert sum(w.num_captures for w in graph.wrappers) > 0
    del model, compiled
    gc.collect()
    assert weight() is None
    assert sum(w.num_captures for w in graph.wrappers) == 0


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_every_instance_of_a_class_gets_graphs(mode, caplog):
    torch.manual_seed(0)
    models = [Block(), Block()]
    compiled = [compile_model(m, mode) for m in models]
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        with cgcompile.counters.expect(num_eager_fallbacks=0):
            for _ in range(3):
                for c, m in zip(compiled, models, strict=True):
                    run(c, m)
    (graph,) = new_graphs()
    captured = [key for keys in graph.report.captured.values() for key in keys]
    assert {key.endswith("#1") for key in captured} == {False, True}
    assert "graph break" not in caplog.text


def test_instances_beyond_the_limit_run_eagerly(caplog):
    models = [Block() for _ in range(MAX_INSTANCES + 1)]
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        with cgcompile.counters.expect(num_eager_fallbacks=1):
            for m in models:
                run(compile_model(m, "FULL"), m)
    assert f"more than {MAX_INSTANCES} live module instances" in caplog.text


def test_a_freed_instance_leaves_its_slot_to_the_next():
    with cgcompile.counters.expect(num_eager_fallbacks=0):
        for _ in range(MAX_INSTANCES + 2):
            model = Block()
            run(compile_model(model, "FULL"), model)
            del model
            gc.collect()


class AddsIntoItsInput(Block):
    """Writes its batch input in place with a value computed from its parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(self.lin(x))
        return super().forward(x)


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_capture_all_after_no_grad_calls_on_a_stateful_model(mode):
    torch.manual_seed(0)
    model = AddsIntoItsInput()
    eager = copy.deepcopy(model)
    compiled = compile_model(model, mode)
    for i, n in enumerate((3, 2, 3, 5)):
        x = torch.randn(n, 8)
        ex = x.clone()
        cgcompile.mark_dynamic_batch(x)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x).clone(), eager(ex))
        torch.testing.assert_close(x, ex)
        if i == 0:
            cgcompile.capture_all(progress=False)  # outside no_grad, as a user would


def test_capture_all_after_no_grad_calls_on_the_llama_example():
    model = Llama(LlamaConfig.tiny()).eval()
    eager = copy.deepcopy(model)
    compiled = compile_model(model, "FULL_AND_PIECEWISE")
    for i, n in enumerate((3, 5, 2)):
        tokens, positions = make_inputs(model.cfg, n, "cpu")
        mark_batch(model.cfg, tokens, positions)
        with torch.no_grad():
            got = compiled(tokens, positions).clone()
            torch.testing.assert_close(got, eager(tokens, positions), rtol=1e-4, atol=1e-4)
        if i == 0:
            cgcompile.capture_all(progress=False)
