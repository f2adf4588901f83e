"""Per-op rules: can appending rows to the batch dim change an op's real rows?

Every aten op is judged from the symbolic shapes of its fake inputs and outputs, where the
batch size is a symbol `s` (see `pad_safety`). A *batch dim* is a dim whose size involves `s`.
`check_op` returns why an op is unsafe, or None:

- rows vanish: outputs with fewer batch dims than the inputs reduce, select or contract over
  the batch (`y.sum(0)`, `y.mean()`, `y.t() @ y`, `x[mask]`);
- sizes move: an output dim whose size involves `s` but is neither a batch symbol nor an
  input's batch size (`cat([y, x])` is `2*s`, `y[1:]` is `s - 1`); views may merge the batch
  with the dims after it (`[s, 8] -> [8*s]`), never with those before it;
- mixing along a batch dim: softmax, cumsum, sort, flip, roll, layer norm over it, training
  batch norm, convolution or pooling over it;
- the batch size used as a value (`x * x.shape[0]`), a row counted from the end (`y[-1]`),
  writes to rows at positions read from the batch, or batch rows written into a tensor that
  is not the graph's state;
- writes into the graph's state (`State`: tensors without the batch dim that outlive the
  call, such as a KV cache): a region sized by the batch (`cache[: x.shape[0]] = x`) would get
  the padded rows too; rows at positions read from the batch (`cache.index_copy_(0, slot, k)`)
  are steered by the pad value of the inputs those positions come from, so `State.indexed_write`
  says whether they have one (of a write at several indices, `cache[slot, :, pos] = k`, the one
  that chooses the row decides).

    why = check_op(torch.ops.aten.sum.dim_IntList, (y, [0]), {}, out, batch, state)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
from torch.utils._pytree import tree_leaves

Rule = Callable[["BatchDims", dict[str, Any], list[torch.Tensor]], "str | None"]
_SIZED = (torch.SymInt, torch.SymFloat, torch.SymBool)


class BatchDims:
    """Which dims of a fake tensor are batch dims, given the batch symbols."""

    def __init__(self, symbols: frozenset[sympy.Symbol]) -> None:
        self.symbols = symbols

    def expr(self, size: Any) -> sympy.Expr | None:
        """The symbolic expression of a size (or SymInt value) when it involves the batch."""
        if not isinstance(size, _SIZED):
            return None
        expr = size.node.expr
        return expr if expr.free_symbols & self.symbols else None

    def dims(self, t: torch.Tensor) -> list[tuple[int, sympy.Expr]]:
        """(dim, size expression) of every batch dim of `t`."""
        found = ((d, self.expr(size)) for d, size in enumerate(t.shape))
        return [(d, e) for d, e in found if e is not None]

    def is_rows(self, expr: sympy.Expr) -> bool:
        """`s * c` for a batch symbol s and a factor c free of it: whole rows, the batch
        outermost (a view merged it with the dims after it, `[s, 8] -> [8*s]`)."""
        _, rows = expr.as_independent(*self.symbols, as_Add=False)
        return rows in self.symbols


@dataclasses.dataclass(frozen=True)
class State:
    """What the rules know of the graph's state: the tensors without the batch dim that outlive
    the call (parameters, buffers, in-place inputs)."""

    is_state: Callable[[torch.Tensor], bool]
    """Whether a tensor is (a view of) state."""
    indexed_write: Callable[[torch.Tensor, list[torch.Tensor]], str | None] = lambda dst, index: (
        None
    )
    """Why writing rows into state `dst` at positions `index` (the index tensors read from the
    batch, in the order of the dims they index) could land padded rows where an eager call
    writes nothing, or None (the positions have pad values)."""


def check_op(
    func: torch._ops.OpOverload,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    out: Any,
    batch: BatchDims,
    state: State,
) -> str | None:
    """Why padding could change what `func` computes for the real rows, or None."""
    outputs = _tensors(out)
    bound = _bind(func, args, kwargs)
    written = [bound[a.name] for a in func._schema.arguments if _writes(a) and a.name in bound]
    outputs += written
    if not outputs:
        return None
    name = func._schema.name.split("::")[-1].rstrip("_")
    why = _value_use(func, bound, batch, name)
    if why is not None:
        return why
    if name in _SCATTERS:
        return _scatter(batch, bound, outputs, state, _writes(func._schema.arguments[0]))
    for t in _tensors(written):
        if batch.dims(t) and state.is_state(t):
            return (
                "writes a region of state sized by the batch: padded rows would write where "
                "an eager call does not"
            )
    rule = _RULES.get(name) or _family_rule(name)
    if rule is not None:
        return rule(batch, bound, outputs)
    return generic(batch, _tensors((args, kwargs)), outputs)


def generic(
    batch: BatchDims, inputs: list[torch.Tensor], outputs: list[torch.Tensor]
) -> str | None:
    """Rows vanish, or a batch size changes: the checks every op gets."""
    inputs_dims = [batch.dims(t) for t in inputs]
    outputs_dims = [batch.dims(t) for t in outputs]
    if max(map(len, outputs_dims), default=0) < max(map(len, inputs_dims), default=0):
        return "reduces, selects or contracts over the batch dim"
    known = batch.symbols | {e for dims in inputs_dims for _, e in dims}
    for dims in outputs_dims:
        for _, expr in dims:
            if expr not in known:
                return (
                    f"gives a dim the size {expr}: padded rows would not stay at the end of "
                    f"the batch (e.g. a concatenation, slice or pad along it)"
                )
    return None


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _writes(argument: Any) -> bool:
    return argument.alias_info is not None and argument.alias_info.is_write


def _bind(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> dict:
    """Argument name -> value, positional and keyword alike."""
    schema = func._schema.arguments
    defaults = {a.name: a.default_value for a in schema if a.has_default_value()}
    return {**defaults, **dict(zip([a.name for a in schema], args, strict=False)), **kwargs}


def _value_use(
    func: torch._ops.OpOverload, bound: dict[str, Any], batch: BatchDims, name: str
) -> str | None:
    """A batch size passed where the op reads a value (not a size): `x * x.shape[0]`."""
    if name in ("arange", "range"):  # a size in disguise: each row gets its own index
        return None
    for argument in func._schema.arguments:
        value = bound.get(argument.name)
        if "int" in str(argument.type):  # sizes, dims and indices: shapes say the rest
            continue
        if any(batch.expr(v) is not None for v in tree_leaves(value)):
            return f"uses the batch size as a value (argument {argument.name})"
    return None


def _dims_of(bound: dict[str, Any], key: str, ndim: int) -> list[int]:
    value = bound.get(key, [])
    dims = [value] if isinstance(value, int) else list(value or [])
    return [d % ndim if ndim else 0 for d in dims]


def _mixes_along(key: str) -> Rule:
    """An op that combines the elements along its `key` dims (softmax, cumsum, sort, flip)."""

    def rule(batch: BatchDims, bound: dict[str, Any], outputs: list[torch.Tensor]) -> str | None:
        t = next(v for v in bound.values() if isinstance(v, torch.Tensor))
        along = _dims_of(bound, key, t.dim())
        if key == "dims" and not along:  # roll without dims rolls the flattened tensor
            along = list(range(t.dim()))
        if any(d in along for d, _ in batch.dims(t)):
            return "combines elements along the batch dim"
        return generic(batch, [t], outputs)

    return rule


def _layer_norm(batch: BatchDims, bound: dict[str, Any], outputs: list[torch.Tensor]) -> str | None:
    t = bound["input"]
    first = t.dim() - len(bound["normalized_shape"])
    if any(d >= first for d, _ in batch.dims(t)):
        return "normalises over the batch dim"
    return generic(batch, [t], outputs)


def _batch_norm(batch: BatchDims, bound: dict[str, Any], outputs: list[torch.Tensor]) -> str | None:
    t = bound["input"]
    training = bound.get("training", "training" not in bound)  # _batch_norm_with_update
    if training and any(d != 1 for d, _ in batch.dims(t)):
        return "takes batch statistics over the batch dim (training-mode batch norm)"
    return generic(batch, [t], outputs)


def _leading_only(
    batch: BatchDims, bound: dict[str, Any], outputs: list[torch.Tensor]
) -> str | None:
    """Convolution, pooling, resampling, group norm: each sample of dim 0 on its own."""
    t = next(v for v in bound.values() if isinstance(v, torch.Tensor))
    if any(d != 0 for d, _ in batch.dims(t)):
        return "slides over (or normalises across) the batch dim"
    return generic(batch, [t], outputs)


def _select(batch: BatchDims, bound: dict[str, Any], outputs: list[torch.Tensor]) -> str | None:
    t, dim, index = bound["self"], bound["dim"] % bound["self"].dim(), bound["index"]
    if batch.expr(t.shape[dim]) is None:
        return generic(batch, [t], outputs)
    if isinstance(index, int) and index >= 0:
        return None  # row k of the real rows: the same row in a padded batch
    return "selects a row counted from the end of the batch (or at a batch-dependent index)"


def _view(batch: BatchDims, bound: dict[str, Any], outputs: list[torch.Tensor]) -> str | None:
    """A reshape keeps rows whole when the batch stays outermost in its dim and the dims
    before it hold as many elements as before (`[s, 64] -> [s, 4, 16]`, `[s, 8] -> [8*s]`)."""
    t = next(v for v in bound.values() if isinstance(v, torch.Tensor))
    before, after = _layout(batch, t), _layout(batch, outputs[0])
    if before == after or (
        len(before) == len(after)
        and all(p == q and batch.is_rows(e) for (p, _), (q, e) in zip(before, after, strict=True))
    ):
        return None
    return "reshapes the batch dim together with the dims before it"


def _layout(batch: BatchDims, t: torch.Tensor) -> list[tuple[sympy.Expr, sympy.Expr]]:
    """(elements before, size) of each batch dim of `t`."""
    sizes = [s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(s) for s in t.shape]
    return [(sympy.Mul(*sizes[:d]), e) for d, e in batch.dims(t)]


def _as_strided(batch: BatchDims, bound: dict[str, Any], outputs: list[torch.Tensor]) -> str | None:
    if batch.dims(bound["self"]) or batch.dims(outputs[0]):
        return "reinterprets the batch dim's memory (as_strided)"
    return None


def _scatter(
    batch: BatchDims,
    bound: dict[str, Any],
    outputs: list[torch.Tensor],
    state: State,
    in_place: bool,
) -> str | None:
    """Writes at indexed positions: rows of a batch tensor at indices read from the batch may
    land on real rows; batch rows written into a non-batch tensor are fine only for state, at
    positions whose padded rows have a pad value (`State.indexed_write`)."""
    dst = bound.get("self", bound.get("input"))
    index = _tensors([bound.get(k) for k in ("index", "indices", "mask")])
    source = _tensors([bound.get(k) for k in ("source", "src", "values")])
    index_batched = any(batch.dims(t) for t in index)
    if batch.dims(dst):
        if index_batched:
            return "writes rows at positions read from the batch: a padded row could hit a real one"
        return generic(batch, [dst, *index, *source], outputs)
    if not index_batched and not any(batch.dims(t) for t in source):
        return None
    if in_place and state.is_state(dst):
        # a KV cache: padded rows write where their positions' pad value says
        return state.indexed_write(dst, [t for t in index if batch.dims(t)])
    return "writes batch rows into a tensor without the batch dim, which the graph then reads"


def check_sdpa(batch: BatchDims, bound: dict[str, Any]) -> str | None:
    """Attention is row-wise when the batch is among the queries, not the keys: padded keys
    would be attended to, unless the attention is causal over the same rows."""
    q, k = bound["query"], bound["key"]
    mask = bound.get("attn_mask", bound.get("attn_bias"))
    key_rows = batch.expr(k.shape[-2])
    if key_rows is not None and not (
        bound.get("is_causal") and key_rows == batch.expr(q.shape[-2])
    ):
        return "attends over the batch rows as keys (only causal attention over them is safe)"
    if isinstance(mask, torch.Tensor) and batch.expr(mask.shape[-1]) is not None:
        return "masks keys with a batch-sized mask"
    return None


def _sdpa(batch: BatchDims, bound: dict[str, Any], outputs: list[torch.Tensor]) -> str | None:
    return check_sdpa(batch, bound) or generic(batch, [bound["query"]], outputs[:1])


_MIXING = """_softmax _log_softmax _safe_softmax softmax log_softmax cumsum cumprod cummax cummin
    logcumsumexp sort argsort topk msort _cummax_helper _cummin_helper""".split()
_BATCH_NORMS = """native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_functional
    cudnn_batch_norm miopen_batch_norm _batch_norm_with_update""".split()
_VIEWS = "view _unsafe_view reshape _reshape_alias view_copy".split()
_SCATTERS = frozenset(
    """index_put _index_put_impl _unsafe_index_put index_copy index_add index_fill index_reduce
    scatter scatter_add scatter_reduce masked_scatter put""".split()
)
_RULES: dict[str, Rule] = {
    **dict.fromkeys(_MIXING, _mixes_along("dim")),
    "flip": _mixes_along("dims"),
    "roll": _mixes_along("dims"),
    "native_layer_norm": _layer_norm,
    "_fused_rms_norm": _layer_norm,
    "native_group_norm": _leading_only,
    **dict.fromkeys(_BATCH_NORMS, _batch_norm),
    "select": _select,
    **dict.fromkeys(_VIEWS, _view),
    "as_strided": _as_strided,
    "scaled_dot_product_attention": _sdpa,
}
_LEADING_ONLY = re.compile(r"conv(olution|_|\d|$)|pool|upsample|grid_sampler|im2col|col2im")


def _family_rule(name: str) -> Rule | None:
    if name.startswith("_scaled_dot_product") and "backward" not in name:
        return _sdpa
    if _LEADING_ONLY.search(name):
        return _leading_only
    return None
