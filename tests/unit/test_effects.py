"""The effects run (`passes.mutation.find_effects`) at example sizes finds what the run with a
symbolic batch finds: the inputs written in place (schema-marked or not) and the outputs that
alias an input, on stateful models; a graph that reads a value from data takes the symbolic
run."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import fx, nn

import cgcompile
from benchmarks._rows_model import RowsConfig, RowsLlama, rows_inputs
from cgcompile.passes.mutation import _concrete_effects, find_effects
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


def _llama() -> tuple[nn.Module, list[tuple[Any, ...]]]:
    cfg = LlamaConfig(num_layers=2, hidden=32, heads=2, ffn=64, vocab=64, cache_len=32)
    calls = []
    for n in (4, 1):
        tokens, positions = make_inputs(cfg, n, "cpu")
        mark_batch(cfg, tokens, positions)
        calls.append((tokens, positions))
    return Llama(cfg).eval(), calls


def _rows() -> tuple[nn.Module, list[tuple[Any, ...]]]:
    cfg = RowsConfig(hidden=32, heads=2, ffn=64, vocab=64, cache_len=8)
    calls = []
    for n in (4, 1):
        tokens, pos = rows_inputs(cfg, n, "cpu", n)
        cgcompile.mark_dynamic_batch(tokens, pos)
        calls.append((tokens, pos))
    return RowsLlama(cfg).eval(), calls


def _cache_step() -> tuple[nn.Module, list[tuple[Any, ...]]]:
    x, slot = torch.randn(4, 8), torch.arange(4)
    cgcompile.mark_dynamic_batch(x, slot)
    return CacheStep().eval(), [(x, slot)]


def _aliases_and_writes() -> tuple[Callable[..., Any], list[tuple[Any, ...]]]:
    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y.mul_(2)
        return x.view(-1), x[1:], y.t(), x * 2

    x, y = torch.randn(4, 3), torch.randn(3, 5)
    cgcompile.mark_dynamic_batch(x)
    return step, [(x, y)]


def _batch_norm() -> tuple[nn.Module, list[tuple[Any, ...]]]:
    x = torch.randn(6, 4)
    cgcompile.mark_dynamic_batch(x)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train(), [(x,)]


@pytest.mark.parametrize("build", [_llama, _rows, _cache_step, _aliases_and_writes, _batch_norm])
def test_the_run_at_example_sizes_finds_the_symbolic_runs_effects(build):
    model, calls = build()
    graphs = _graphs(model, calls)
    assert graphs
    for gm, example_inputs in graphs:
        concrete = _concrete_effects(gm, example_inputs)
        assert concrete is not None  # the shortcut ran
        symbolic = find_effects(gm, example_inputs, _symbolic(gm))
        assert concrete == symbolic and (concrete.mutated or concrete.output_aliases)
        assert find_effects(gm, example_inputs) == symbolic


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
