"""Splitting Dynamo graphs at splitting ops: pieces, stitching, fresh args, signatures."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import fx

import tests.support.silly  # noqa: F401  (registers silly::attention and silly::attention_fresh)
from cgcompile.passes.op_match import OpMatcher
from cgcompile.passes.split import SplitResult, graph_signature, split_graph

SILLY = OpMatcher(["silly::attention", "silly::attention_fresh"])
ATTENTION_FRESH = torch.ops.silly.attention_fresh


@torch.library.custom_op("splittest::pair", mutates_args=())
def pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x + 1, x * 2


@pair.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


@dataclasses.dataclass
class Traced:
    """A Dynamo graph and the real args Dynamo passed it on the latest call."""

    gm: fx.GraphModule
    args: tuple[Any, ...]


def trace(fn: Callable[..., Any], *inputs: torch.Tensor) -> Traced:
    """The one Dynamo graph of `fn` (dynamic shapes), traced by calling it on `inputs`."""
    seen: dict[str, Any] = {}

    def capture_backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        seen["gm"] = gm

        def run(*args: Any) -> Any:
            seen["args"] = args
            return gm(*args)

        return run

    torch.compile(fn, backend=capture_backend, fullgraph=True, dynamic=True)(*inputs)
    return Traced(seen["gm"], seen["args"])


def split(traced: Traced, matcher: OpMatcher = SILLY) -> SplitResult:
    return split_graph(traced.gm, matcher)


def assert_stitched_equal(traced: Traced, result: SplitResult) -> None:
    torch.testing.assert_close(result.split_gm(*traced.args), traced.gm(*traced.args))


def piece_of(result: SplitResult, node_name: str) -> int:
    """Index of the piece that holds the node `node_name` of the original graph."""
    (index,) = [i.index for i in result.items if node_name in _names(i.graph)]
    return index


def _names(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def silly_model(x: torch.Tensor, attention: Any = torch.ops.silly.attention) -> torch.Tensor:
    x = x + 1
    x = x + 2
    out = torch.empty_like(x)
    attention(x, x, x, out)
    x = out - 2
    x = x - 1
    out = torch.empty_like(x)
    attention(x, x, x, out)
    return out + 1


def fresh_model(x: torch.Tensor) -> torch.Tensor:
    h = x * 2
    y = torch.ops.silly.attention_fresh(h, h, h)
    return y + h


@pytest.fixture
def silly() -> Traced:
    return trace(silly_model, torch.randn(5, 4))


def test_silly_model_splits_into_five_pieces_three_capturable(silly: Traced) -> None:
    result = split(silly)
    # 2 attention calls, none first/last or adjacent: 2N+1 pieces, N+1 capturable
    assert [i.is_splitting for i in result.items] == [False, True, False, True, False]
    assert [i.index for i in result.items] == [0, 1, 2, 3, 4]
    assert [i.ops for i in result.splitting] == [("silly::attention",)] * 2
    assert all(i.ops == () for i in result.capturable)


def test_silly_model_stitched_equals_original_and_closed_form(silly: Traced) -> None:
    result = split(silly)
    (x,) = [a for a in silly.args if isinstance(a, torch.Tensor)]
    # out = q + k + v = 3h: ((x + 3) * 3 - 3) * 3 + 1 = 9x + 19
    torch.testing.assert_close(result.split_gm(*silly.args)[0], 9 * x + 19)
    assert_stitched_equal(silly, result)


PACKET, OVERLOAD = torch.ops.silly.attention, torch.ops.silly.attention.default


@pytest.mark.parametrize(
    ("spec", "called_as"),
    [
        ("silly::attention", PACKET),
        ("silly::attention", OVERLOAD),
        ("silly::attention.default", OVERLOAD),
        ("silly::attention.default", PACKET),
        (PACKET, PACKET),
        (OVERLOAD, OVERLOAD),
        (OVERLOAD, PACKET),
    ],
    ids=[
        "name-matches-packet-call",
        "name-matches-overload-call",
        "overload-name-matches-overload-call",
        "overload-name-matches-packet-call",
        "packet-matches-packet-call",
        "overload-matches-overload-call",
        "overload-matches-packet-call",
    ],
)
def test_splitting_op_matched_by_any_spec_form(spec: Any, called_as: Any) -> None:
    traced = trace(lambda x: silly_model(x, called_as), torch.randn(5, 4))
    result = split(traced, OpMatcher([spec]))
    assert len(result.splitting) == 2


def test_sdpa_matched_by_function() -> None:
    def attention_block(q: torch.Tensor) -> torch.Tensor:
        h = q * 2
        return F.scaled_dot_product_attention(h, h, h) + 1

    traced = trace(attention_block, torch.randn(3, 2, 4, 8))
    result = split(traced, OpMatcher([F.scaled_dot_product_attention]))
    assert [i.is_splitting for i in result.items] == [False, True, False]
    assert_stitched_equal(traced, result)


@pytest.mark.parametrize(
    "matcher", [OpMatcher(["splittest::pair"]), OpMatcher([])], ids=["absent-op", "no-specs"]
)
def test_no_matching_op_gives_one_capturable_piece(silly: Traced, matcher: OpMatcher) -> None:
    result = split(silly, matcher)
    assert [(i.name, i.is_splitting) for i in result.items] == [("submod_0", False)]
    assert_stitched_equal(silly, result)


def test_splitting_op_first_and_last_gives_fewer_pieces() -> None:
    def model(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.silly.attention_fresh(x, x, x) + 1
        return torch.ops.silly.attention_fresh(y, y, y)

    traced = trace(model, torch.randn(4, 3))
    result = split(traced)
    assert [i.is_splitting for i in result.items] == [True, False, True]
    assert_stitched_equal(traced, result)


def test_adjacent_splitting_ops_share_one_piece() -> None:
    def model(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.silly.attention_fresh(x + 1, x, x)
        z = torch.ops.silly.attention_fresh(y, y, y)
        return z - 1

    traced = trace(model, torch.randn(4, 3))
    result = split(traced)
    assert [i.ops for i in result.items] == [(), ("silly::attention_fresh",) * 2, ()]
    assert_stitched_equal(traced, result)


def test_empty_like_alone_between_splitting_ops_stays_a_piece() -> None:
    def model(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.silly.attention_fresh(x, x, x)
        out = torch.empty_like(y)
        torch.ops.silly.attention(y, y, y, out)
        return out

    traced = trace(model, torch.randn(4, 3))
    result = split(traced)
    assert [i.is_splitting for i in result.items] == [True, False, True]
    assert [n.target for n in result.items[1].graph.graph.nodes if n.op == "call_function"] == [
        torch.empty_like
    ]
    assert_stitched_equal(traced, result)


def test_getitem_stays_with_splitting_producer() -> None:
    def model(x: torch.Tensor) -> torch.Tensor:
        a, b = torch.ops.splittest.pair(x * 3)
        return a - b

    traced = trace(model, torch.randn(4, 3))
    result = split(traced, OpMatcher(["splittest::pair"]))
    getitems = [n.name for n in traced.gm.graph.nodes if n.target is operator.getitem]
    assert len(getitems) == 2
    assert {piece_of(result, name) for name in getitems} == {result.splitting[0].index}
    last = result.capturable[1]
    placeholders = [n.name for n in last.graph.graph.nodes if n.op == "placeholder"]
    assert last.fresh_arg_indices == tuple(sorted(placeholders.index(g) for g in getitems))
    assert_stitched_equal(traced, result)


def test_late_getitem_stays_with_producer_before_the_boundary() -> None:
    # Dynamo unpacks tuples at once, so build the graph by hand: getitem after the attention
    graph = fx.Graph()
    x = graph.placeholder("x")
    stats = graph.call_function(torch.var_mean, (x,), {"dim": 1})
    y = graph.call_function(torch.ops.silly.attention_fresh, (x, x, x))
    var = graph.call_function(operator.getitem, (stats, 0))
    graph.output(graph.call_function(operator.add, (y, graph.call_method("unsqueeze", (var, 1)))))
    traced = Traced(fx.GraphModule(torch.nn.Module(), graph), (torch.randn(4, 3),))
    result = split(traced)
    assert piece_of(result, var.name) == piece_of(result, stats.name) == 0
    assert_stitched_equal(traced, result)


def size_model(x: torch.Tensor) -> torch.Tensor:
    shape = x.size()
    out = torch.empty(shape)
    torch.ops.silly.attention(x, x, x, out)
    return out.view(shape) + x.new_ones(shape)


def size_slice_model(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    torch.ops.silly.attention(x, x, x, out)
    return out + out.new_ones(x.shape[1:])  # Dynamo: torch.Size([s1])


@pytest.mark.parametrize("model", [size_model, size_slice_model], ids=["size", "size-slice"])
def test_size_used_after_boundary_crosses_as_dims(model: Callable[..., Any]) -> None:
    traced = trace(model, torch.randn(4, 3))
    assert any(n.target in ("size", torch.Size) for n in traced.gm.graph.nodes)
    result = split(traced)
    graphs = [result.split_gm, *(i.graph for i in result.items)]
    values = [n.meta.get("example_value") for gm in graphs for n in gm.graph.nodes]
    assert not any(isinstance(v, torch.Size) for v in values)
    assert not any(n.target in ("size", torch.Size) for gm in graphs for n in gm.graph.nodes)
    assert_stitched_equal(traced, result)


def test_fresh_arg_indices_point_at_fresh_attention_output() -> None:
    traced = trace(fresh_model, torch.randn(4, 3))
    result = split(traced)
    (fresh,) = [n.name for n in traced.gm.graph.nodes if n.target is ATTENTION_FRESH]
    last = result.capturable[-1]
    placeholders = [n.name for n in last.graph.graph.nodes if n.op == "placeholder"]
    assert last.fresh_arg_indices == (placeholders.index(fresh),)
    assert result.capturable[0].fresh_arg_indices == ()


def test_fresh_arg_indices_empty_for_in_place_attention(silly: Traced) -> None:
    # `out` is allocated by the piece before the attention, so no input is fresh
    result = split(silly)
    assert [i.fresh_arg_indices for i in result.items] == [()] * 5


def test_pieces_keep_placeholder_example_values(silly: Traced) -> None:
    result = split(silly)
    placeholders = [n for i in result.items for n in i.graph.graph.nodes if n.op == "placeholder"]
    assert placeholders
    assert all(n.meta.get("example_value") is not None for n in placeholders)


def test_split_leaves_input_graph_untouched() -> None:
    traced = trace(lambda x: torch.empty(x.size()).copy_(x) + 1, torch.randn(4, 3))
    before = str(traced.gm.graph)
    split(traced)
    assert str(traced.gm.graph) == before


class Layers(torch.nn.Module):
    def __init__(self, constants: tuple[float, ...]) -> None:
        super().__init__()
        self.constants = constants
        self.linears = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in constants)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for linear, constant in zip(self.linears, self.constants, strict=True):
            h = torch.relu(linear(h)) + constant
            h = torch.ops.silly.attention_fresh(h, h, h)
        return h


def layer_signatures(constants: tuple[float, ...]) -> list[Any]:
    with torch.no_grad():
        traced = trace(Layers(constants), torch.randn(4, 8))
    return [graph_signature(i.graph) for i in split(traced).capturable]


def test_signature_equal_for_identical_layers_with_different_weights() -> None:
    first, second = layer_signatures((1.0, 1.0))
    assert first == second
    assert hash(first) == hash(second)


def test_signature_differs_for_different_constant() -> None:
    first, second = layer_signatures((1.0, 2.0))
    assert first != second


# --- property: random programs of elementwise ops and attention calls ---

APPLY: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "add": lambda x, c: x + c,
    "mul": lambda x, c: x * c,
    "relu": lambda x, c: torch.relu(x),
    "fresh": lambda x, c: torch.ops.silly.attention_fresh(x, x, x),
    "inplace": lambda x, c: _attention_into_buffer(x),
}
ATTENTION = {"fresh", "inplace"}


def _attention_into_buffer(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    torch.ops.silly.attention(x, x, x, out)
    return out


def attention_runs(program: list[tuple[str, float]]) -> int:
    """Maximal runs of adjacent attention calls; "inplace" allocates its buffer first."""
    kinds = [kind for kind, _ in program]
    return sum(
        k in ATTENTION and (i == 0 or kinds[i - 1] not in ATTENTION or k == "inplace")
        for i, k in enumerate(kinds)
    )


def call_targets(gm: fx.GraphModule) -> list[Any]:
    """Targets of the real calls, without getitem/size plumbing and inserted sym_size nodes."""
    plumbing = (operator.getitem, "size", torch.ops.aten.sym_size.int)
    return [
        n.target
        for n in gm.graph.nodes
        if n.op in ("call_function", "call_method") and n.target not in plumbing
    ]


programs = st.lists(
    st.tuples(st.sampled_from(sorted(APPLY)), st.sampled_from([-1.5, 0.5, 2.0, 3.0])),
    min_size=1,
    max_size=8,
)


@given(program=programs, batch=st.integers(2, 6))
def test_split_program_invariants(program: list[tuple[str, float]], batch: int) -> None:
    torch._dynamo.reset()

    def fn(x: torch.Tensor) -> torch.Tensor:
        for kind, constant in program:
            x = APPLY[kind](x, constant)
        return x

    traced = trace(fn, torch.randn(batch, 3))
    result = split(traced)
    k = sum(kind in ATTENTION for kind, _ in program)

    assert_stitched_equal(traced, result)
    assert len(result.splitting) == attention_runs(program)
    assert len(result.items) <= 2 * k + 1
    assert all(_names(i.graph) for i in result.items)
    assert sorted(n for i in result.items for n in _names(i.graph)) == sorted(_names(traced.gm))
    assert [t for i in result.items for t in call_targets(i.graph)] == call_targets(traced.gm)
