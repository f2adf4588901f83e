"""Keep a matmul's residual add out of cuBLAS when the sum leaves the graph.

Inductor turns `mm(a, b) + c` into `addmm(c, a, b)` unless every user of the sum is pointwise
(then it keeps the add, to fuse it into those users' kernel). A graph output is not a pointwise
user, so a piece of a split graph whose residual sum is handed to the next piece gets an addmm:
on a GPU, a copy of `c` into the result and a gemm that reads it back, where the unsplit graph
has a plain mm and the add fused into the RMSNorm kernel that follows: one extra copy and
one extra read per residual add, which made full graphs replaying the pieces slower than a
whole-graph compile (docs/BENCHMARKS.md, "Does FULL_AND_PIECEWISE cost anything on decode
steps?").

`unfuse_output_addmm` undoes it after Inductor's own patterns: an addmm on a GPU whose added
tensor has the result's shape (a residual, not a broadcast bias), with alpha and beta 1, whose
users are pointwise ops or the output, at least one of them pointwise, becomes `c + mm(a, b)`,
the order of the eager code's rounding. Sums are visited last first, so a chain of residual
adds unfuses whole. `OutputAddmmPass` runs it as Inductor's `post_grad_custom_post_pass`
(after the pass set before it, if any):

    chained = OutputAddmmPass.after_configured()
    with torch._inductor.config.patch(post_grad_custom_post_pass=chained):
        compile_fx(gm, args)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.utils import is_gpu, is_pointwise_use
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

aten = torch.ops.aten


def unfuse_output_addmm(graph: fx.Graph) -> int:
    """Rewrite each such addmm as `c + mm(a, b)`; returns how many were rewritten."""
    rewritten = 0
    for node in reversed(graph.find_nodes(op="call_function", target=aten.addmm.default)):
        if not _is_output_residual_addmm(node):
            continue
        added, a, b = node.args[:3]
        with graph.inserting_before(node):
            mm = graph.call_function(aten.mm.default, (a, b))
            total = graph.call_function(aten.add.Tensor, (added, mm))
        mm.meta["val"] = aten.mm.default(a.meta["val"], b.meta["val"])
        total.meta["val"] = aten.add.Tensor(added.meta["val"], mm.meta["val"])
        node.replace_all_uses_with(total)
        graph.erase_node(node)
        rewritten += 1
    return rewritten


def _is_output_residual_addmm(node: fx.Node) -> bool:
    if any(node.kwargs.get(k, 1) != 1 for k in ("alpha", "beta")):
        return False
    added, result = node.args[0], node.meta.get("val")
    value = added.meta.get("val") if isinstance(added, fx.Node) else None
    if not isinstance(value, torch.Tensor) or not isinstance(result, torch.Tensor):
        return False
    # never `!=` on shapes: a symbolic batch against a bias length would guard on the batch
    if not is_gpu(result.device.type) or not statically_known_true(
        sym_eq(value.shape, result.shape)
    ):
        return False
    users = list(node.users)
    pointwise = [u for u in users if is_pointwise_use(u)]
    outputs = [u for u in users if u.op == "output"]
    return bool(pointwise) and len(pointwise) + len(outputs) == len(users)


class OutputAddmmPass(CustomGraphPass):
    """`unfuse_output_addmm` as an Inductor post-grad pass, after `before` (the pass that was
    set, a list of them, or None). Its uuid keys Inductor's cache on this file and `before`'s."""

    def __init__(self, before: Any = None) -> None:
        passes = before if isinstance(before, (list, tuple)) else (before,)
        self.before = tuple(p for p in passes if p is not None)

    def __call__(self, graph: fx.Graph) -> None:
        for earlier in self.before:
            earlier(graph)
        unfuse_output_addmm(graph)

    def uuid(self) -> Any:
        earlier = tuple(p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.before)
        if None in earlier:
            return None  # a pass without a uuid: Inductor must not cache, as without us
        return (get_hash_for_files((__file__,)), earlier)

    @classmethod
    def after_configured(cls) -> OutputAddmmPass:
        """This pass after whatever `post_grad_custom_post_pass` is set now."""
        current = torch._inductor.config.post_grad_custom_post_pass
        if isinstance(current, OutputAddmmPass):
            return current
        return cls(current)
