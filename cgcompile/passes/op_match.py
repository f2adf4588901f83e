"""Match FX nodes against op specs: `"ns::op"`, `"ns::op.overload"`, op objects or callables.

In a Dynamo graph a custom op appears as an `OpOverloadPacket` (`torch.ops.ns.op(...)`) or an
`OpOverload` (`torch.ops.ns.op.default(...)`, or a `custom_op` object), and SDPA as the
callable `torch._C._nn.scaled_dot_product_attention`. Specs are normalised once to names and
callables; matching a node is then a set lookup.

    matcher = OpMatcher(["silly::attention", torch.nn.functional.scaled_dot_product_attention])
    [n for n in gm.graph.nodes if matcher.matches(n)]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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


def describe(target: Any) -> str:
    """Readable name of a call target for logs and reports."""
    names = op_names(target)
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


def unknown_op_names(specs: Iterable[Any], targets: Iterable[Any]) -> list[str]:
    """Name specs that no target answers to and that torch does not know: likely misspelt."""
    called = {name for target in targets for name in op_names(target)}
    return [s for s in specs if isinstance(s, str) and s not in called and not is_registered_op(s)]


class OpMatcher:
    """Answers whether a node calls one of the given ops."""

    def __init__(self, specs: Iterable[Any]) -> None:
        keys = [spec_key(s) for s in specs]
        self.names = frozenset(k for k in keys if isinstance(k, str))
        self.callables = tuple(k for k in keys if not isinstance(k, str))

    def matches_target(self, target: Any) -> bool:
        if any(target is c for c in self.callables):
            return True
        return any(name in self.names for name in op_names(target))

    def matches(self, node: fx.Node) -> bool:
        return node.op == "call_function" and self.matches_target(node.target)

    def __bool__(self) -> bool:
        return bool(self.names or self.callables)
