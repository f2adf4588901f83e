"""Match FX nodes against op specs: `"ns::op"`, `"ns::op.overload"`, op objects or callables.

In a Dynamo graph a custom op appears as an `OpOverloadPacket` (`torch.ops.ns.op(...)`) or an
`OpOverload` (`torch.ops.ns.op.default(...)`, or a `custom_op` object), and SDPA as the
callable `torch._C._nn.scaled_dot_product_attention`. Specs are normalised once to names and
callables; matching a node is then a set lookup.

    matcher = OpMatcher(["silly::attention", torch.nn.functional.scaled_dot_product_attention])
    [n for n in gm.graph.nodes if matcher.matches(n)]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch
from torch import fx


def op_names(target: Any) -> tuple[str, ...]:
    """Names a call target answers to: "ns::op", plus "ns::op.overload" where one is known."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        # A packet call (`torch.ops.ns.op(...)`) runs the default overload for ops that have one.
        name = target._qualified_op_name
        return (name, f"{name}.default") if "default" in target.overloads() else (name,)
    if isinstance(target, torch._ops.OpOverload):
        base = target._schema.name
        return (base, f"{base}.{target._overloadname}")
    return ()


def spec_key(spec: Any) -> str | Callable[..., Any]:
    """The canonical form of one spec: a name string, or the callable itself."""
    if isinstance(spec, str):
        return spec
    names = op_names(spec)
    if isinstance(spec, torch._ops.OpOverload) and spec._overloadname != "default":
        return names[1]
    if names:
        return names[0]
    if callable(spec):
        return spec
    raise TypeError(f"not an op spec: {spec!r}; expected 'ns::op', an op or a callable")


def describe(target: Any, names: tuple[str, ...] | None = None) -> str:
    """Readable name of a call target for logs and reports (`names`: its `op_names`, where
    known)."""
    names = op_names(target) if names is None else names
    if names:
        return names[0]
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))


def is_registered_op(name: str) -> bool:
    """Whether torch knows the op `"ns::op"` or `"ns::op.overload"` (a custom op once defined)."""
    base, _, overload = name.partition(".")
    schemas = torch._C._jit_get_schemas_for_operator(base)
    if not overload:
        return bool(schemas)
    return any((s.overload_name or "default") == overload for s in schemas)


def unknown_op_names(specs: Iterable[Any], called: Collection[str]) -> list[str]:
    """Name specs that no call answers to (`called`: the graph's op names) and that torch does
    not know: likely misspelt."""
    return [s for s in specs if isinstance(s, str) and s not in called and not is_registered_op(s)]


@dataclasses.dataclass(frozen=True)
class OpCall:
    """One call target of a graph, read once (`scan_calls`)."""

    target: Any
    names: tuple[str, ...]
    """`op_names(target)`."""
    readable: str
    """`describe(target)`."""
    matched: bool
    """Whether the matcher's ops include it."""


def scan_calls(
    gm: fx.GraphModule, matcher: OpMatcher, specs: Iterable[Any]
) -> tuple[list[OpCall], list[str]]:
    """Each distinct call target of `gm`, in order, with its names and whether `matcher`
    matches it, in one pass over the nodes; and the name specs among `specs` that no call
    answers to and torch does not know (`unknown_op_names`)."""
    calls: dict[int, OpCall] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and id(node.target) not in calls:
            target = node.target
            names = op_names(target)
            matched = matcher.matches_target(target, names)
            calls[id(target)] = OpCall(target, names, describe(target, names), matched)
    called = {name for call in calls.values() for name in call.names}
    return list(calls.values()), unknown_op_names(specs, called)


class OpMatcher:
    """Answers whether a node calls one of the given ops."""

    def __init__(self, specs: Iterable[Any]) -> None:
        keys = [spec_key(s) for s in specs]
        self.names = frozenset(k for k in keys if isinstance(k, str))
        self.callables = tuple(k for k in keys if not isinstance(k, str))

    def matches_target(self, target: Any, names: tuple[str, ...] | None = None) -> bool:
        """Whether `target` is one of the ops (`names`: its `op_names`, where known)."""
        if any(target is c for c in self.callables):
            return True
        names = op_names(target) if names is None else names
        return any(name in self.names for name in names)

    def matches(self, node: fx.Node) -> bool:
        return node.op == "call_function" and self.matches_target(node.target)

    def __bool__(self) -> bool:
        return bool(self.names or self.callables)
