"""`torch._check(cond)` calls in a Dynamo graph become `aten._assert_scalar(cond, msg)`, the
node later torch versions trace them to.

Models that slice by a dynamic batch check its bound (`torch._check(b <= rows)`, as the guide
advises for an unbacked batch). Torch 2.11 keeps that check in the graph as a call of the Python
function when the size is backed; AOTAutograd's cache does not take a graph that calls it (not on
its list of cacheable functions) and gives the piece a throwaway key, so the piece compiled again
in every process, a precompiled warm restart included (the KV-rows step's first piece: 2 cache
hits and 1 miss on every warm rebuild). `aten._assert_scalar` raises the same RuntimeError when
the condition is false and is cacheable; torch 2.13 emits it itself (nothing to rewrite).

    checks_as_asserts(gm)      # in place; the number of checks rewritten
"""

from __future__ import annotations

import logging

import torch
from torch import fx

logger = logging.getLogger(__name__)


def checks_as_asserts(gm: fx.GraphModule) -> int:
    """Rewrite `gm`'s `torch._check(cond)` calls on a traced condition (no message) in place."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch._check:
            continue
        if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
            continue
        (cond,) = node.args
        message = f"Expected {cond.name} to be True, but got False (torch._check)"
        with gm.graph.inserting_before(node):
            check = gm.graph.call_function(torch.ops.aten._assert_scalar.default, (cond, message))
        check.meta = dict(node.meta)
        node.replace_all_uses_with(check)
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.recompile()
        logger.debug("%d torch._check calls as aten._assert_scalar", rewritten)
    return rewritten
