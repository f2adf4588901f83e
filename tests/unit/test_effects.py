"""The effects run (`passes.mutation.find_effects`) at example sizes finds what the run with a
symbolic batch finds: the inputs written in place (schema-marked or not) and the outputs that
alias an input, on stateful models, the batch backed or unbacked (at the real input's size); a
graph that reads a value from data, or whose unbacked batch came with one row, takes the
symbolic run. Dynamo's record of its trace (`recorded_effects`) finds the same where it can tell,
and says it cannot where inputs share storage, batch norm writes unmarked, or a node has no
fake value."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import fx, nn

import cgcompile
from benchmarks._rows_model import RowsConfig, RowsLlama, rows_inputs
from cgcompile.passes.mutation import _concrete_effects, find_effects, recorded_effects
from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch
from tests.support.models import CacheStep


def _symbolic(gm: fx.GraphModule) -> Callable[[list[Any]], Any]:
    return lambda args: (fx.Interpreter(gm), contextlib.nullcontext())


def _graphs(model: Callable[..., Any], calls: list[tuple[Any, ...]]) -> list[tuple[Any, Any]]:
    graphs = []

    def keep(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphs.append((gm, example_inputs))
        return gm.forward

    compiled = torch.compile(model, backend=keep)
    with torch.no_grad():
        for args in calls:
            compiled(*args)
    return graphs


def _llama(unbacked: bool) -> tuple[nn.Module, list[tuple[Any, ...]]]:
    cfg = LlamaConfig(num_layers=2, hidden=32, heads=2, ffn=64, vocab=64, cache_len=32)
    calls = []
    for n in (4, 1):
        tokens, positions = make_inputs(cfg, n, "cpu")
        mark_batch(cfg, tokens, positions, unbacked=unbacked)
        calls.append((tokens, positions))
    return Llama(cfg).eval(), calls


def _rows(unbacked: bool) -> tuple[nn.Module, list[tuple[Any, ...]]]:
    cfg = RowsConfig(hidden=32, heads=2, ffn=64, vocab=64, cache_len=8)
    calls = []
    for n in (4, 1):
        tokens, pos = rows_inputs(cfg, n, "cpu", n)
        cgcompile.mark_dynamic_batch(tokens, pos, unbacked=unbacked)
        calls.append((tokens, pos))
    return RowsLlama(cfg).eval(), calls


def _cache_step(unbacked: bool) -> tuple[nn.Module, list[tuple[Any, ...]]]:
    x, slot = torch.randn(4, 8), torch.arange(4)
    cgcompile.mark_dynamic_batch(x, slot, unbacked=unbacked)
    return CacheStep().eval(), [(x, slot)]


def _aliases_and_writes(unbacked: bool) -> tuple[Callable[..., Any], list[tuple[Any, ...]]]:
    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y.mul_(2)
        return x.view(-1), x[1:], y.t(), x * 2

    x, y = torch.randn(4, 3), torch.randn(3, 5)
    cgcompile.mark_dynamic_batch(x, unbacked=unbacked)
    return step, [(x, y)]


def _batch_norm(unbacked: bool) -> tuple[nn.Module, list[tuple[Any, ...]]]:
    x = torch.randn(6, 4)
    cgcompile.mark_dynamic_batch(x, unbacked=unbacked)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train(), [(x,)]


_STATEFUL = [_llama, _rows, _cache_step, _aliases_and_writes]


# train-mode batch norm with an unbacked batch: Dynamo hands the backend no graph
@pytest.mark.parametrize(
    ("build", "unbacked"),
    [(b, False) for b in [*_STATEFUL, _batch_norm]] + [(b, True) for b in _STATEFUL],
)
def test_the_run_at_example_sizes_finds_the_symbolic_runs_effects(build, unbacked):
    model, calls = build(unbacked)
    graphs = _graphs(model, calls)
    assert graphs
    for gm, example_inputs in graphs:
        concrete = _concrete_effects(gm, example_inputs)
        assert concrete is not None  # the shortcut ran
        symbolic = find_effects(gm, example_inputs, _symbolic(gm))
        assert concrete == symbolic and (concrete.mutated or concrete.output_aliases)
        assert find_effects(gm, example_inputs) == symbolic
        recorded = recorded_effects(gm)
        assert recorded == (None if build is _batch_norm else symbolic)


def test_inputs_sharing_storage_take_a_run():
    def step(k: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        v.add_(x)  # k shares v's storage and version counter but is only read
        return k * 2

    kv = torch.randn(2, 4, 3)
    (gm, example_inputs), *_ = _graphs(step, [(kv[0], kv[1], torch.randn(4, 3))])
    assert recorded_effects(gm) is None
    v = next(i for i, t in enumerate(example_inputs) if t._base is kv and t.storage_offset())
    assert find_effects(gm, example_inputs).mutated == (v,)


def test_a_graph_without_dynamos_fake_values_takes_a_run():
    model, calls = _cache_step(False)
    ((gm, example_inputs),) = _graphs(model, calls)
    expected = find_effects(gm, example_inputs)
    for node in gm.graph.nodes:
        node.meta.pop("example_value", None)
    assert recorded_effects(gm) is None
    assert find_effects(gm, example_inputs) == expected and expected.mutated


def test_a_value_read_from_data_takes_the_symbolic_run():
    def scaled(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x * scale.item()

    x = torch.randn(4, 3)
    cgcompile.mark_dynamic_batch(x)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        (gm, example_inputs), *_ = _graphs(scaled, [(x, torch.tensor(2.0))])
        assert _concrete_effects(gm, example_inputs) is None
        (written,) = find_effects(gm, example_inputs).mutated
        assert example_inputs[written].dim() == 2  # x, not the scale


def test_an_unbacked_batch_of_one_row_takes_the_symbolic_run():
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        y.add_(1)
        return x.reshape(-1)  # a view at one row or contiguous rows, else a copy

    x, y = torch.randn(1, 3), torch.randn(3)
    cgcompile.mark_dynamic_batch(x, unbacked=True)
    (gm, example_inputs), *_ = _graphs(step, [(x, y)])
    assert _concrete_effects(gm, example_inputs) is None
    assert find_effects(gm, example_inputs).mutated == (_position(example_inputs, y),)


def _position(example_inputs: list[Any], tensor: torch.Tensor) -> int:
    return next(i for i, t in enumerate(example_inputs) if t is tensor)
