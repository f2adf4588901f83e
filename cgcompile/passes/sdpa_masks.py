"""Boolean SDPA masks made additive once, in the graph, as eager SDPA would make them per call.

Eager `scaled_dot_product_attention` turns a boolean `attn_mask` into an additive one on every
call (`where(mask, 0, fill)`, one or two kernels) before its attention kernel. Where the graph is
split at attention, SDPA runs eagerly between the pieces, so a decode step pays those kernels
once per layer; a whole-graph compile fuses them and makes the mask once. This pass gives the
split graph the same: each boolean mask's additive form is computed once per mask, fill and
dtype, right before the first call that takes it (so in the piece before that call), and every
SDPA call the split runs eagerly takes it instead of the boolean mask:

    before: %mask = le(%arange, %pos)          after: %mask = le(%arange, %pos)
            %a0 = sdpa(%q0, %k0, %v0,                 %not = logical_not(%mask)
                       attn_mask=%mask)               %zeros = zeros_like(%mask, dtype=bf16)
            %a1 = sdpa(..., attn_mask=%mask)          %additive = masked_fill(%zeros, %not, -inf)
                                                      %a0 = sdpa(..., attn_mask=%additive)
                                                      %a1 = sdpa(..., attn_mask=%additive)

A mask that any node writes in place (it, or a view of it) is left alone. The additive mask is
the one eager SDPA makes: its fill value and dtype are read from SDPA itself, run on fake
tensors of the call's example sizes under a dispatch mode that records the ops it decomposes
into (cuDNN fills with a finite value on some torch versions, the others with -inf); a call is
rewritten only where SDPA picks the same kernel for the additive mask as for the boolean one.
Were a call at another size to pick a kernel of the other fill, only rows that allow no key
would differ from eager's.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from cgcompile.passes.op_match import OpMatcher

logger = logging.getLogger(__name__)

SDPA = torch._C._nn.scaled_dot_product_attention
_MASK_POSITION = 3  # sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, ...)
_CONVERSION_OPS = ("aten.logical_not", "aten.where", "aten.scalar_tensor")


def convert_bool_masks(gm: fx.GraphModule, matcher: OpMatcher) -> int:
    """Rewrite, in place, the SDPA calls `matcher` matches (those the split runs eagerly) to
    take the additive form of their boolean mask, made once per mask before its first call;
    returns how many calls were rewritten."""
    graph = gm.graph
    written = {_storage(n.args[0]) for n in graph.nodes if writes_first_arg(n) and n.args}
    made: dict[tuple[fx.Node, float, torch.dtype], fx.Node] = {}
    memo: dict[Any, Any] = {}
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not SDPA or not matcher.matches(node):
            continue
        mask = _mask_arg(node)
        if not isinstance(mask, fx.Node) or getattr(_value(mask), "dtype", None) != torch.bool:
            continue
        if _storage(mask) is None or _storage(mask) in written:  # a mask written in place
            continue
        conversion = eager_conversion(node, memo)
        if conversion is None:
            continue
        fill, dtype = conversion
        key = (mask, fill, dtype)
        if key not in made:
            made[key] = _insert_additive(graph, node, mask, fill, dtype)
        if "attn_mask" in node.kwargs:
            node.update_kwarg("attn_mask", made[key])
        else:
            node.update_arg(_MASK_POSITION, made[key])
        rewritten += 1
    if rewritten:
        gm.recompile()
        logger.debug(
            "%d boolean SDPA masks made additive once (%d masks) before the split",
            rewritten,
            len(made),
        )
    return rewritten


def eager_conversion(
    node: fx.Node, memo: dict[Any, Any] | None = None
) -> tuple[float, torch.dtype] | None:
    """(fill, dtype) of the additive mask eager SDPA makes from this call's boolean mask, or
    None: the call's arguments are not all known, SDPA made no such mask, or it picks another
    kernel for the additive mask. `memo` keeps the answer per argument layout (layers alike)."""
    args, kwargs = _fake_call(node)
    specs = None if args is None else [_spec(a) for a in args]
    if specs is None or any(spec is None for spec in specs):
        return None
    key = (tuple(specs), tuple(sorted(kwargs.items())))
    if memo is not None and key in memo:
        return memo[key]
    with FakeTensorMode():
        concrete = [_concrete(spec) for spec in specs]
        boolean = _record(concrete, kwargs)
        found = _fill(boolean, concrete[_MASK_POSITION])
        if found is not None:
            fill, dtype = found
            additive = torch.zeros_like(concrete[_MASK_POSITION], dtype=dtype)
            additive = additive.masked_fill(~concrete[_MASK_POSITION], fill)
            with_additive = _record([*concrete[:_MASK_POSITION], additive], kwargs)
            if _kernels(boolean) != _kernels(with_additive):
                logger.debug("SDPA picks another kernel for an additive mask at %s", node.name)
                found = None
    if memo is not None:
        memo[key] = found
    return found


def _mask_arg(node: fx.Node) -> Any:
    if "attn_mask" in node.kwargs:
        return node.kwargs["attn_mask"]
    return node.args[_MASK_POSITION] if len(node.args) > _MASK_POSITION else None


def _value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _storage(node: Any) -> Any:
    """A key of the storage `node`'s value lives in (views share it), or None."""
    value = _value(node) if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return StorageWeakRef(value.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None


def writes_first_arg(node: fx.Node) -> bool:
    """An in-place call (`x.masked_fill_(...)`, `x[i] = v`, `out=`): it may write its first
    argument."""
    if "out" in node.kwargs or node.target is operator.setitem:
        return True
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function":
        name = getattr(node.target, "__name__", "")
    else:
        return False
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


def _fake_call(node: fx.Node) -> tuple[list[Any] | None, dict[str, Any]]:
    """The call's (query, key, value, mask) values and its other arguments, which must be
    constants (a computed scale or flag: None)."""
    args = [*node.args[:_MASK_POSITION], _mask_arg(node)]
    extra = list(node.args[_MASK_POSITION + 1 :])
    names = ("dropout_p", "is_causal", "scale", "enable_gqa")
    kwargs = {k: v for k, v in node.kwargs.items() if k != "attn_mask"}
    kwargs |= dict(zip(names, extra, strict=False))
    if len(args) != 4 or any(isinstance(v, fx.Node) for v in kwargs.values()):
        return None, {}
    values = [_value(a) if isinstance(a, fx.Node) else None for a in args]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return None, {}
    return values, kwargs


def _spec(t: torch.Tensor) -> tuple[Any, ...] | None:
    """`t`'s layout at its example sizes (no symbols: probing SDPA adds no guard), or None for
    a size without a hint (unbacked)."""
    try:
        shape = tuple(_hint(s) for s in t.shape)
        stride = tuple(_hint(s) for s in t.stride())
    except TypeError:
        return None
    return shape, stride, t.dtype, t.device, t.requires_grad


def _concrete(spec: tuple[Any, ...]) -> torch.Tensor:
    """A tensor of `spec` (a fake one, under a fake mode); `requires_grad` as the call's
    argument, since a kernel may be chosen for its backward."""
    shape, stride, dtype, device, requires_grad = spec
    t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    return t.requires_grad_(requires_grad)


def _hint(size: Any) -> int:
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        if hint is None:
            raise TypeError("no hint")
        return int(hint)
    return int(size)


class _Recorder(TorchDispatchMode):
    """Records every aten call below it: (name, args, output)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[Any, ...], Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        self.calls.append((str(func.overloadpacket), args, out))
        return out


def _record(args: list[torch.Tensor], kwargs: dict[str, Any]) -> list[tuple[str, tuple, Any]]:
    with _Recorder() as recorder:
        query, key, value, mask = args
        SDPA(query, key, value, attn_mask=mask, **kwargs)
    return recorder.calls


def _fill(
    calls: list[tuple[str, tuple, Any]], mask: torch.Tensor
) -> tuple[float, torch.dtype] | None:
    """(fill, dtype) of the `where` among `calls` that makes the additive mask: 0 where `mask`
    allows a key, `fill` where it does not (as `where(mask, 0, fill)` or `where(~mask, fill,
    0)`, its values scalars or scalar tensors), or None."""
    scalars = {id(out): args[0] for name, args, out in calls if name == "aten.scalar_tensor"}
    negated = {
        id(out) for name, args, out in calls if name == "aten.logical_not" and args[0] is mask
    }

    def number(x: Any) -> float | None:
        x = scalars.get(id(x), x)
        return float(x) if isinstance(x, (int, float)) else None

    for name, args, out in calls:
        if name != "aten.where" or len(args) != 3 or not isinstance(out, torch.Tensor):
            continue
        if args[0] is mask:
            allowed, masked = number(args[1]), number(args[2])
        elif id(args[0]) in negated:
            masked, allowed = number(args[1]), number(args[2])
        else:
            continue
        if allowed == 0.0 and masked is not None:
            return masked, out.dtype
    return None


def _kernels(calls: list[tuple[str, tuple, Any]]) -> list[str]:
    """The ops SDPA ran but the mask's conversion: the attention kernel and its helpers."""
    return [n for n, _, _ in calls if n not in _CONVERSION_OPS and not n.startswith("prim.")]


def _insert_additive(
    graph: fx.Graph, first_use: fx.Node, mask: fx.Node, fill: float, dtype: torch.dtype
) -> fx.Node:
    """`masked_fill(zeros_like(mask, dtype), logical_not(mask), fill)` right before the first
    SDPA call that takes `mask`, with example values."""
    value = _value(mask)
    with graph.inserting_before(first_use):
        negated = graph.call_function(torch.logical_not, (mask,))
    with graph.inserting_after(negated):
        zeros = graph.call_function(torch.zeros_like, (mask,), {"dtype": dtype})
    with graph.inserting_after(zeros):
        additive = graph.call_function(torch.masked_fill, (zeros, negated, fill))
    fake_mode = getattr(value, "fake_mode", None)
    if fake_mode is not None:
        with fake_mode:
            negated.meta["example_value"] = torch.logical_not(value)
            zeros.meta["example_value"] = torch.zeros_like(value, dtype=dtype)
            additive.meta["example_value"] = zeros.meta["example_value"].masked_fill(
                negated.meta["example_value"], fill
            )
    return additive
