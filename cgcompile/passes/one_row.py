"""Where a graph traced with a symbolic batch that admits one row differs from eager at one row.

A graph whose batch may be 1 (marked unbacked, or backed with torch's
`backed_size_oblivious` on) was traced without knowing whether the batch is 1, and torch
decides such questions as if it were not (size-oblivious semantics). Where eager code reads
the answer, the graph silently takes the other path at one row: `x.squeeze()` drops a batch
dim of size 1 in eager, and the code after it was traced for the dim kept. A backed batch is
safe: Dynamo traces batch 1 apart. `one_row_difference` names the first such op, so calls of
one row raise instead of returning what eager would not.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import fx

from cgcompile.passes.pad_safety import source_of

_SQUEEZES = {"squeeze", "squeeze_"}
_SQUEEZE_FUNCTIONS = {torch.squeeze, torch.Tensor.squeeze, torch.Tensor.squeeze_}


def one_row_difference(gm: fx.GraphModule, batch_exprs: Collection[Any]) -> str | None:
    """Why `gm` at one row could differ from an eager call (a squeeze that may drop a dim
    whose size is the batch), or None."""
    for node in gm.graph.nodes:
        squeezed = squeezed_input(node)
        value = squeezed.meta.get("example_value") if squeezed is not None else None
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        dims = node.args[1:] or ([node.kwargs["dim"]] if "dim" in node.kwargs else [])
        flat = [d for arg in dims for d in (arg if isinstance(arg, (list, tuple)) else [arg])]
        chosen = range(value.dim()) if not flat else [d % value.dim() for d in flat]
        for d in chosen:
            size = value.shape[d]
            if isinstance(size, torch.SymInt) and size.node.expr in batch_exprs:
                return (
                    f"{source_of(node)} squeezes dim {d}, whose size is the batch: at one row "
                    f"eager drops it, but the graph was traced for any batch size and keeps it"
                )
    return None


def squeezed_input(node: fx.Node) -> fx.Node | None:
    """The tensor `node` squeezes, if it is a squeeze (whose input's example value
    `one_row_difference` reads: a saved graph keeps it)."""
    squeeze = (node.op == "call_method" and node.target in _SQUEEZES) or (
        node.op == "call_function" and node.target in _SQUEEZE_FUNCTIONS
    )
    if squeeze and node.args and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None
