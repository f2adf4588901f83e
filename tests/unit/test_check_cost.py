"""The per-call check inspects as many tensors at 16 layers as at 2: the steady state of the
compiled model (`CompiledGraph.steady`, Dynamo's own work aside) and of `cgcompile.trusted` read
a fixed set of graph arguments and call `data_ptr` a fixed number of times, whatever the depth."""

from __future__ import annotations

import pytest
import torch

import cgcompile
from cgcompile.calls.compiled_graph import CompiledGraph
from cgcompile.calls.instances import InstanceSlots
from cgcompile.calls.steady_state import MISS
from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch
from tests.support.state import compile_model

CALLS = 5


class _Reads(tuple):
    """A graph's arguments that note each position read (`itemgetter` reads through this too)."""

    read: set[int]

    def __getitem__(self, i):
        self.read.add(i)
        return tuple.__getitem__(self, i)


def _step(call, cfg: LlamaConfig) -> None:
    tokens, positions = make_inputs(cfg, 4, "cpu")
    mark_batch(cfg, tokens, positions)
    call(tokens, positions)


def _steady_cost(layers: int, path: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Per call, in the steady state of a FULL graph: graph arguments `steady` reads, `data_ptr`
    calls, full checks of the module instance; the calls that missed the steady state."""
    cfg = LlamaConfig(num_layers=layers, hidden=16, heads=2, ffn=16, vocab=32, cache_len=16)
    model = Llama(cfg).eval()
    compiled = compile_model(model, "FULL")
    call = cgcompile.trusted(compiled) if path == "trusted" else compiled
    cost = {"reads": 0, "data_ptr": 0, "full_checks": 0, "misses": 0, "arguments": 0}
    steady, full_check = CompiledGraph.steady, InstanceSlots._full_check

    def counted_steady(graph, args, any_ready=True):
        reads = _Reads(args)
        reads.read = set()
        out = steady(graph, reads, any_ready)
        cost["reads"] += len(reads.read)
        cost["misses"] += out is MISS
        cost["arguments"] = len(args)
        return out

    def counted_data_ptr(tensor):
        cost["data_ptr"] += 1
        return torch._C.TensorBase.data_ptr(tensor)

    def counted_full_check(slots, args):
        cost["full_checks"] += 1
        return full_check(slots, args)

    with torch.no_grad(), cgcompile.batch_hint(uniform_decode=True):
        for _ in range(3):  # warm-up, capture, first replay
            _step(call, cfg)
        through = getattr(call, "calls_through_dynamo", 0)
        monkeypatch.setattr(CompiledGraph, "steady", counted_steady)
        monkeypatch.setattr(torch.Tensor, "data_ptr", counted_data_ptr)
        monkeypatch.setattr(InstanceSlots, "_full_check", counted_full_check)
        for _ in range(CALLS):
            _step(call, cfg)
        monkeypatch.undo()
    assert getattr(call, "calls_through_dynamo", 0) == through
    return {k: v // CALLS if k != "arguments" else v for k, v in cost.items()}


@pytest.mark.parametrize("path", ["compiled", "trusted"])
def test_the_steady_call_inspects_as_many_tensors_at_16_layers_as_at_2(path, monkeypatch):
    shallow, deep = (_steady_cost(layers, path, monkeypatch) for layers in (2, 16))
    if path == "compiled":  # 16 layers pass 6x the arguments, of which `steady` reads 4
        assert deep.pop("arguments") > 5 * shallow.pop("arguments")
        assert shallow["reads"] == 4  # the two representatives, the two batch inputs
    else:  # trusted calls no `CompiledGraph`: its replay is bound
        assert shallow["reads"] == deep["reads"] == deep["arguments"] == 0
    assert shallow == deep
    assert shallow["full_checks"] == 0 and shallow["data_ptr"] == 2  # the representatives
    assert shallow["misses"] == 0
