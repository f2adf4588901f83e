"""Split a Dynamo FX graph at its splitting ops into capturable and splitting pieces.

Every call of a splitting op (attention, by default) cuts the graph. A run of adjacent splitting
ops becomes one *splitting* piece, run eagerly; the nodes between runs become *capturable*
pieces, which the backend compiles and replays from CUDA graphs. Before and after, for
`x + 1 -> silly::attention -> x - 1` (`s0` is the symbolic batch size):

    before: gm                                 after: split_gm
    %add = add(%x, 1)                          %submod_0 = submod_0(%x, %s0)     # add, empty_like
    %out = empty_like(%add)                    %add = getitem(%submod_0, 0)
    %attention = silly.attention(%add, %add,   %out = getitem(%submod_0, 1)
                                 %add, %out)   %submod_1 = submod_1(%add, %s0, %out)  # attention
    %sub = sub(%out, 1)                        %submod_2 = submod_2(%out, %s0)   # sub
    return (%sub,)                             return (%submod_2,)

Rules: `getitem` nodes stay in their producer's piece, so tuples never cross a boundary; every
`x.size()` (and `torch.Size([...])`) is first rewritten into per-dim `aten.sym_size.int` nodes
or ints, and the boolean masks of the SDPA calls split off are made additive once
(`passes.sdpa_masks`), on a copy of the graph (the caller's `gm` is left untouched); the
original node order is kept, because the graph contains in-place mutations. No piece is empty,
so a graph without any operation gives no pieces at all.

    result = split_graph(gm, OpMatcher(["silly::attention"]))
    [(item.name, item.is_splitting, item.ops) for item in result.items]
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import operator
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.fx.node import map_aggregate
from torch.fx.passes.split_module import split_module

from cgcompile.passes.op_match import OpMatcher, describe
from cgcompile.passes.sdpa_masks import convert_bool_masks

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SplitItem:
    """One piece of the split graph, in execution order."""

    name: str
    """Submodule name in `split_gm`, e.g. "submod_0"."""
    index: int
    """Position in execution order, 0..len-1."""
    is_splitting: bool
    """True: holds splitting ops only and runs eagerly; False: a capturable piece."""
    graph: fx.GraphModule
    """The submodule."""
    ops: tuple[str, ...]
    """Readable names of the splitting ops it calls, in call order; () for capturable pieces."""
    fresh_arg_indices: tuple[int, ...]
    """Positions of the args that a splitting piece produced: tensors an eager op allocated
    freshly, which a graph of this piece must copy in. () for splitting pieces."""
    input_args: tuple[int | None, ...] = ()
    """Per arg of this piece: the position of the graph input it is, None if computed."""


@dataclasses.dataclass
class SplitResult:
    """The stitching graph and its pieces."""

    split_gm: fx.GraphModule
    """Calls the submodules in order; equivalent to the graph that was split."""
    items: list[SplitItem]
    """Every piece, in execution order."""

    @property
    def capturable(self) -> list[SplitItem]:
        return [item for item in self.items if not item.is_splitting]

    @property
    def splitting(self) -> list[SplitItem]:
        return [item for item in self.items if item.is_splitting]


def split_graph(gm: fx.GraphModule, matcher: OpMatcher) -> SplitResult:
    """Split `gm` at every node `matcher` matches; `gm` itself is not modified."""
    # a copy whose Python code is never generated: `split_module` reads only its graph
    gm = _LazyGraphModule(gm, copy.deepcopy(gm.graph))
    decompose_sizes(gm)
    convert_bool_masks(gm, matcher)  # eager SDPA between pieces would convert them per call
    piece_of = _assign_pieces(gm, matcher)
    # keep original order: the graph has in-place mutations that a topological sort may reorder;
    # lazy modules: a piece's code is generated when something needs it (`generated_forward`)
    with _use_lazy_graph_module(True):
        split_gm = split_module(
            gm, None, piece_of.__getitem__, keep_original_order=True, keep_original_node_name=True
        )
    calls = [node for node in split_gm.graph.nodes if node.op == "call_module"]
    items: list[SplitItem] = []
    for index, call in enumerate(calls):
        # producers run before their consumers, so `items` already holds every producer
        items.append(_make_item(split_gm, index, call, items, matcher))
    logger.debug("split into %d pieces: %s", len(items), [i.ops or i.name for i in items])
    return SplitResult(split_gm, items)


def generated_forward(gm: fx.GraphModule) -> Callable[..., Any]:
    """`gm`'s generated `forward`, bound: calling it skips `nn.Module.__call__` (hooks, tracing
    checks). A lazily recompiled GraphModule's `forward` is a stub that recompiles and then calls
    the module, every call, so it is recompiled first. Take it after the last change to `gm`'s
    graph: a later `recompile()` replaces the code, not this bound method."""
    recompile = getattr(gm, "real_recompile", None)
    if recompile is not None:
        recompile()
    return gm.forward


def decompose_sizes(gm: fx.GraphModule) -> None:
    """Rewrite, in place, uses of `x.size()` and `torch.Size([...])` into tuples of dims.

    A symbolic dim becomes an `aten.sym_size.int(x, dim)` node, a static dim a python int, so
    only SymInts and ints, never a `torch.Size`, cross a piece boundary. The graph output keeps
    any `torch.Size` it returns.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        dims = None
        if _is_full_size(node):
            dims = _size_dims(graph, node)
        elif _is_size_literal(node):
            dims = tuple(node.args[0])
        if dims is not None:
            _replace_uses(node, dims)
    gm.recompile()


def _replace_uses(node: fx.Node, value: tuple[fx.Node | int, ...]) -> None:
    """Put `value` in place of `node` in the args of its users but the output; drop it if unused."""
    for user in list(node.users):
        if user.op != "output":
            user.args = map_aggregate(user.args, lambda a: value if a is node else a)
            user.kwargs = map_aggregate(user.kwargs, lambda a: value if a is node else a)
    if not node.users:
        node.graph.erase_node(node)


def _is_full_size(node: fx.Node) -> bool:
    """`x.size()` without a dim; `x.size(dim)` gives an int or SymInt, fine across a boundary."""
    return node.op == "call_method" and node.target == "size" and len(node.args) == 1


def _is_size_literal(node: fx.Node) -> bool:
    """`torch.Size([s0, 4])`, which Dynamo emits for slices of a size."""
    is_call = node.op == "call_function" and node.target is torch.Size and len(node.args) == 1
    return is_call and isinstance(node.args[0], (list, tuple))


def _size_dims(graph: fx.Graph, node: fx.Node) -> tuple[fx.Node | int, ...] | None:
    """Per-dim replacements for a `size()` node, inserted where it stood; None without meta."""
    shape = node.meta.get("example_value")
    if not isinstance(shape, torch.Size):
        return None
    dims: list[fx.Node | int] = []
    with graph.inserting_before(node):
        for i, size in enumerate(shape):
            if is_concrete_int(size):
                dims.append(int(size))
                continue
            dim = graph.call_function(torch.ops.aten.sym_size.int, (node.args[0], i))
            dim.meta["example_value"] = size
            dims.append(dim)
    return tuple(dims)


def _assign_pieces(gm: fx.GraphModule, matcher: OpMatcher) -> dict[fx.Node, int]:
    """Piece id of every node `split_module` partitions; a new id whenever the kind changes."""
    piece_of: dict[fx.Node, int] = {}
    piece, is_splitting = -1, None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if _is_getitem(node) and node.args[0] in piece_of:
            # with its producer, so a tuple never crosses a boundary
            piece_of[node] = piece_of[node.args[0]]
            continue
        matched = matcher.matches(node)
        if matched is not is_splitting:
            piece, is_splitting = piece + 1, matched
        piece_of[node] = piece
    return piece_of


def _is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _make_item(
    split_gm: fx.GraphModule, index: int, call: fx.Node, done: list[SplitItem], matcher: OpMatcher
) -> SplitItem:
    name = str(call.target)
    piece = getattr(split_gm, name)
    ops = tuple(describe(n.target) for n in piece.graph.nodes if matcher.matches(n))
    splitting = {item.name for item in done if item.is_splitting}
    fresh = () if ops else _fresh_arg_indices(call, piece, splitting)
    inputs = {n: i for i, n in enumerate(split_gm.graph.find_nodes(op="placeholder"))}
    input_args = tuple(inputs.get(arg) if isinstance(arg, fx.Node) else None for arg in call.args)
    return SplitItem(name, index, bool(ops), piece, ops, fresh, input_args)


def _fresh_arg_indices(
    call: fx.Node, piece: fx.GraphModule, splitting: set[str]
) -> tuple[int, ...]:
    """Positions of `call`'s args that a splitting piece returned (directly or via getitem)."""
    placeholders = [n for n in piece.graph.nodes if n.op == "placeholder"]
    fresh = []
    for i, arg in enumerate(call.args):
        producer = arg.args[0] if isinstance(arg, fx.Node) and _is_getitem(arg) else arg
        if not isinstance(producer, fx.Node) or producer.op != "call_module":
            continue
        value = placeholders[i].meta.get("example_value", placeholders[i].meta.get("val"))
        is_tensor = value is None or isinstance(value, torch.Tensor)
        if producer.target in splitting and is_tensor:
            fresh.append(i)
    return tuple(fresh)


def graph_signature(gm: fx.GraphModule) -> Hashable:
    """Structural key of a piece: equal for pieces that differ only in node/placeholder names.

    Covers each node's op, target, constants and arg wiring (by position), and each
    placeholder's metadata (`meta["example_value"]` or `meta["val"]`): dtype, shape and stride
    with symbolic sizes as str, device, requires_grad; a SymInt as the str of its expr.
    `get_attr`/`call_module` targets also key on the identity of the object they fetch, so
    pieces that read different constants never share a compiled artifact.
    """
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    return tuple(_node_key(gm, node, position) for node in gm.graph.nodes)


def _node_key(gm: fx.GraphModule, node: fx.Node, position: dict[fx.Node, int]) -> Hashable:
    if node.op == "placeholder":
        return ("placeholder", _value_key(node.meta.get("example_value", node.meta.get("val"))))
    if node.op in ("get_attr", "call_module"):
        target: Any = (node.target, id(operator.attrgetter(node.target)(gm)))
    else:
        target = node.target
    args = _arg_key(node.args, position)
    kwargs = tuple((k, _arg_key(v, position)) for k, v in node.kwargs.items())
    return (node.op, target, args, kwargs)


def _arg_key(arg: Any, position: dict[fx.Node, int]) -> Hashable:
    if isinstance(arg, fx.Node):
        return ("node", position[arg])
    if isinstance(arg, (tuple, list)):
        return (type(arg).__name__, tuple(_arg_key(a, position) for a in arg))
    if isinstance(arg, dict):
        return ("dict", tuple((k, _arg_key(v, position)) for k, v in arg.items()))
    if isinstance(arg, slice):
        return ("slice", _arg_key((arg.start, arg.stop, arg.step), position))
    # type and repr: 1 and 1.0 differ (they give different dtypes), and nan equals itself
    return (type(arg).__qualname__, repr(arg))


def _value_key(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        return (
            "tensor",
            value.dtype,
            tuple(str(s) for s in value.shape),
            tuple(str(s) for s in value.stride()),
            str(value.device),
            value.requires_grad,
        )
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return (type(value).__name__, str(value.node.expr))
    return (type(value).__qualname__, repr(value))
