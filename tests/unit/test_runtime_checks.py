"""`passes.runtime_checks`: a graph's `torch._check(cond)` becomes `aten._assert_scalar`, which
AOTAutograd's cache takes (the call it refuses made a piece compile again in every process on
torch 2.11), and the rewritten graph raises as the check did."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx
from torch._functorch._aot_autograd.autograd_cache import (
    BypassAOTAutogradCache,
    check_cacheable,
)

from cgcompile.passes.runtime_checks import checks_as_asserts


def _checked_graph() -> fx.GraphModule:
    """x + 1 for x of at most 16 rows, the bound checked as torch 2.11's Dynamo leaves it."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    rows = graph.call_function(torch.ops.aten.sym_size.int, (x, 0))
    graph.call_function(torch._check, (graph.call_function(operator.le, (rows, 16)),))
    graph.output((graph.call_function(operator.add, (x, 1)),))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_check_becomes_an_assert_that_the_compile_cache_takes():
    gm = _checked_graph()
    with pytest.raises(BypassAOTAutogradCache, match="_check"):
        check_cacheable(gm)
    assert checks_as_asserts(gm) == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch._check not in targets and torch.ops.aten._assert_scalar.default in targets
    check_cacheable(gm)
    assert checks_as_asserts(gm) == 0


def test_the_rewritten_graph_raises_where_the_check_did():
    gm = _checked_graph()
    x = torch.randn(20, 3)
    with pytest.raises(RuntimeError):
        gm(x)
    checks_as_asserts(gm)
    with pytest.raises(RuntimeError, match="torch._check"):
        gm(x)
    (out,) = gm(x[:4])
    assert torch.equal(out, x[:4] + 1)
