"""The arguments each capturable piece is compiled with: Dynamo's fake values as the split copied
them onto the piece's placeholders, the same as a fake run of the stitching graph would give."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx
from torch._dispatch.python import enable_python_dispatcher

import tests.support.silly  # noqa: F401  (registers silly::attention and silly::attention_fresh)
from cgcompile.backend import piece_compiler
from cgcompile.backend.piece_compiler import compile_pieces, recorded_args
from cgcompile.passes.op_match import OpMatcher
from cgcompile.passes.split import SplitResult, generated_forward, split_graph
from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch
from tests.unit.test_split import APPLY

MATCHER = OpMatcher(
    [
        "silly::attention",
        "silly::attention_fresh",
        torch.nn.functional.scaled_dot_product_attention,
    ]
)


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        shape = tuple(str(s) for s in value.shape)
        stride = tuple(str(s) for s in value.stride())
        return ("tensor", value.dtype, shape, stride, value.device, value.requires_grad)
    if isinstance(value, torch.SymInt):
        return ("symint", str(value.node.expr))
    return (type(value).__name__, value)


def _interpreted_args(split: SplitResult, example_inputs: list[Any]) -> dict[str, list[Any]]:
    """Each capturable piece's arguments in a fake run of the stitching graph."""
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    seen: dict[str, list[Any]] = {}
    capturable = {item.name for item in split.capturable}

    class Recorder(fx.Interpreter):
        def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
            if target in capturable:
                seen[target] = list(args)
            return super().call_module(target, args, kwargs)

    fakes = [fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in example_inputs]
    with fake_mode, enable_python_dispatcher():
        Recorder(split.split_gm).run(*fakes)
    return seen


def check_recorded_args_match_a_fake_run(
    fn: Callable[..., Any], *inputs: Any, dynamic: bool | None = None
) -> int:
    """Compile `fn`; inside the backend compare, per capturable piece, the recorded args with
    the fake run's. Returns the number of pieces compared."""
    compared = []

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        split = split_graph(gm, MATCHER)
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        interpreted = _interpreted_args(split, list(example_inputs))
        fakes = [
            fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in example_inputs
        ]
        for item in split.capturable:
            recorded = recorded_args(item, fakes, fake_mode)
            assert recorded is not None, item.name
            assert [_meta(a) for a in recorded] == [_meta(a) for a in interpreted[item.name]]
            for arg, graph_input in zip(recorded, item.input_args, strict=True):
                if graph_input is not None:  # the graph's own argument, as the fake run's
                    assert arg is fakes[graph_input]
            compared.append(item.name)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*inputs)
    return len(compared)


def test_llama_pieces_get_the_fake_runs_args() -> None:
    """The example Llama: KV caches written in place, views and SDPA; batch marked dynamic."""
    cfg = LlamaConfig(num_layers=3, hidden=64, heads=4, ffn=128, vocab=256, cache_len=32)
    model = Llama(cfg).eval()
    tokens, positions = make_inputs(cfg, 5, "cpu")
    mark_batch(cfg, tokens, positions)
    assert check_recorded_args_match_a_fake_run(model, tokens, positions) == 4


def test_a_scalar_tensor_input_read_with_item() -> None:
    """nn.Embedding's float norm_type is a graph input read with .item() under dynamic=True:
    it takes the graph's own fake argument, not Dynamo's traced value (which cannot .item())."""
    embed = torch.nn.Embedding(16, 4)
    ids = torch.randint(0, 16, (3, 6))
    assert check_recorded_args_match_a_fake_run(embed, ids, dynamic=True) == 1


def test_strided_and_transposed_values_crossing_a_boundary() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        t = x.t()[1:]  # a strided view crosses into the attention piece and out again
        y = torch.ops.silly.attention_fresh(t, t, t)
        return (y + t).sum(0, keepdim=True) * x[::2].sum()

    x = torch.randn(6, 10)
    torch._dynamo.mark_dynamic(x, 0)
    assert check_recorded_args_match_a_fake_run(fn, x) == 2


@settings(max_examples=25, deadline=None)
@given(
    program=st.lists(st.sampled_from(sorted(APPLY)), min_size=1, max_size=6),
    batch=st.integers(2, 6),
)
def test_random_programs_pieces_get_the_fake_runs_args(program: list[str], batch: int) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        for kind in program:
            x = APPLY[kind](x, 2.0)
        return x

    x = torch.randn(batch, 3)
    torch._dynamo.mark_dynamic(x, 0)
    check_recorded_args_match_a_fake_run(fn, x)


def test_a_placeholder_without_a_fake_value_runs_the_split_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A piece whose input lost its fake value (a pass added the node without one) is still
    compiled: compile_pieces falls back to the fake run of the stitching graph."""
    runs = []
    original_run = piece_compiler._Interpreter.run
    monkeypatch.setattr(
        piece_compiler._Interpreter,
        "run",
        lambda self, *a: runs.append(1) or original_run(self, *a),
    )
    # a compiler that needs the arguments (as Inductor does), without Inductor's compile time
    compiled_with = []
    monkeypatch.setattr(
        piece_compiler,
        "compile_one",
        lambda gm, args, compiler: compiled_with.append(args) or generated_forward(gm),
    )

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        split = split_graph(gm, MATCHER)
        compile_pieces(split, example_inputs, "inductor")
        assert runs == []  # every placeholder had its value
        assert compiled_with and all(compiled_with)
        last = split.capturable[-1].graph
        next(iter(last.graph.find_nodes(op="placeholder"))).meta.pop("example_value")
        runners = compile_pieces(split, example_inputs, "inductor")
        assert runs == [1]
        assert sorted(runners) == sorted(item.name for item in split.capturable)
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(4, 3)
    torch._dynamo.mark_dynamic(x, 0)
    fn = lambda x: torch.ops.silly.attention_fresh(x * 2, x, x) + 1  # noqa: E731
    torch.compile(fn, backend=backend, fullgraph=True)(x)


def test_eager_pieces_are_built_without_fake_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager pieces run their generated forward: no fake argument is made for them (a fake per
    graph input cost ~0.1 s on a 16-layer HF model), and they still compute the graph."""
    monkeypatch.setattr(piece_compiler, "_fake", lambda *a: pytest.fail("a fake argument made"))
    monkeypatch.setattr(piece_compiler, "recorded_args", lambda *a: pytest.fail("args recorded"))
    seen = []

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        split = split_graph(gm, MATCHER)
        runners = compile_pieces(split, example_inputs, "eager")
        seen.append(sorted(runners) == sorted(item.name for item in split.capturable))
        for item in split.capturable:
            split.split_gm.set_submodule(item.name, _Runner(runners[item.name]))
        return split.split_gm.forward

    torch._dynamo.reset()
    x = torch.randn(4, 3)
    torch._dynamo.mark_dynamic(x, 0)
    fn = lambda x: torch.ops.silly.attention_fresh(x * 2, x, x) + 1  # noqa: E731
    assert torch.equal(torch.compile(fn, backend=backend, fullgraph=True)(x), fn(x))
    assert seen == [True]


class _Runner(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)
