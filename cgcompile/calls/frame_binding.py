"""How a compiled model's call maps onto the Dynamo graph it ran, for `trusted` and `guarded`
(`calls/trusted.py`): the binding of one graph to the caller's arguments (`Binding`), the graph
a cache entry's compiled function calls, a graph input's value from its Dynamo source name in
the caller's frame, how the forward's return is made from the graph's outputs, and whether
module hooks run outside the forward's frame.

    value = source_value("L['self'].w", {"self": model}, forward.__globals__, args)
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch.nn.modules import module as _module

from cgcompile.calls.compiled_graph import CompiledGraph
from cgcompile.calls.parameter_events import EVENTS
from cgcompile.errors import CGCompileError

SIZE = re.compile(r"^L\['(\w+)'\]\.size\(\)\[(\d+)\]$")
"""A Dynamo source naming a size of a frame local: `L['x'].size()[0]`."""


@dataclasses.dataclass
class Binding:
    """One compiled graph of the forward, bound to the call's positional arguments."""

    graph: CompiledGraph
    slot: int
    user: tuple[tuple[int, int], ...]
    """(placeholder, argument position) of each tensor the caller passes."""
    batch_arg: int
    """The argument position of the first batch tensor."""
    template: list[Any]
    """Every placeholder's value; the caller's tensors and sizes are replaced per call."""
    checks: tuple[tuple[int, torch.dtype, int], ...]
    """(argument position, dtype, rank) of the tensor arguments at binding."""
    events: int = -1
    """`EVENTS.count` at binding: a parameter, buffer or submodule assigned since (anywhere)
    makes calls go through the compiled model, which checks the instance, and binds again."""
    first: torch.Tensor | None = None
    last: torch.Tensor | None = None
    """The graph's two representative static tensors (`InstanceSlots.reps`) as bound; None for
    a graph without parameters or buffers."""
    first_address: int = 0
    last_address: int = 0
    """Their `data_ptr` at binding: found elsewhere (`p.data = t`, `model.half()`,
    `.to(...)`), calls go through the compiled model, whose check drops the moved graphs."""
    state: tuple[int, ...] = ()
    """Argument positions of the state sized by the batch (`InputPlan.batch_state`), whose
    addresses are part of the graph key: another cache of a size replays its own graphs."""
    fixed: tuple[tuple[int, int], ...] = ()
    """(argument position, `data_ptr` at binding) of the static-address tensors the caller
    passes that are not sized by the batch (`InputPlan.passed_static`): another one goes through
    the compiled model, which runs it eagerly."""
    returns: str | None = None
    """How the forward's return is made from the graph's outputs: 'first', 'tuple', 'list'."""
    entry: Any = None
    guards: Any = None
    """`guarded`: the Dynamo cache entry that runs `graph` and its guard tree, less the module
    tensors' guards (`without_module_tensors`)."""

    def is_current(self) -> bool:
        """Whether the model is as bound, as far as an O(1) check sees (the per-call check)."""
        first = self.first
        return self.events == EVENTS.count and (
            first is None
            or (
                first.data_ptr() == self.first_address and self.last.data_ptr() == self.last_address
            )
        )


def hooked(compiled: Any) -> bool:
    """Whether a call of `compiled` runs module hooks outside the forward's frame (the compiled
    wrapper's, its model's, or global ones), as `nn.Module.__call__` would see them."""
    modules = (compiled, getattr(compiled, "_orig_mod", None))  # a compiled function: neither
    return any(
        isinstance(m, torch.nn.Module)
        and (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)
        for m in modules
    ) or bool(
        _module._global_forward_hooks
        or _module._global_forward_pre_hooks
        or _module._global_backward_hooks
        or _module._global_backward_pre_hooks
    )


def compiled_graph_of(function: Any) -> CompiledGraph | None:
    """The `CompiledGraph` a compiled function Dynamo installed calls, else None."""
    while function is not None and not isinstance(function, CompiledGraph):
        function = getattr(function, "__wrapped__", None)
    return function


def graph_break(function: Any) -> CGCompileError:
    return CGCompileError(
        f"cgcompile.trusted: {function.__qualname__} compiles to more than one graph (a graph "
        f"break); compile it with fullgraph=True to find the break"
    )


def source_value(name: str, frame: dict[str, Any], globals_: dict[str, Any], args: Any) -> Any:
    size = SIZE.match(name)
    if size:
        return frame[size.group(1)].shape[int(size.group(2))]
    try:
        return eval(name, {"G": globals_}, {"L": frame})  # Dynamo's source names are Python
    except Exception as exc:
        raise CGCompileError(
            f"cgcompile.trusted cannot bind the graph input {name} ({type(exc).__name__}); call "
            f"the compiled model instead"
        ) from exc


def returns_of(result: Any, out: list[Any]) -> str | None:
    if isinstance(result, torch.Tensor) and out and result is out[0]:
        return "first"
    if isinstance(result, (tuple, list)) and len(result) == len(out):
        if all(r is o for r, o in zip(result, out, strict=True)):
            return "list" if isinstance(result, list) else "tuple"
    raise CGCompileError(
        f"cgcompile.trusted: the forward returns {type(result).__name__} built from the graph's "
        f"outputs, and Python work after the graph would be skipped; return the graph's "
        f"outputs (a tensor, or a tuple of them) or call the compiled model"
    )


_MODULE_TENSOR = re.compile(r"\._(parameters|buffers)(\[[^\]]*\])?$")
"""A guard tree node that is a module's parameter or buffer dict, or one of their entries:
`..._parameters`, `..._parameters['weight']`."""


def without_module_tensors(guard_manager: Any) -> Any:
    """A copy of a cache entry's guard tree without the subtrees of module parameters and
    buffers (each tensor's dtype, device, sizes, strides, a None entry, the dicts' types;
    most of a deep model's guards), which the per-call instance check covers in O(1): a
    tensor assigned to any module, or the old storage of one freed (`.half()`, `.to()`,
    `p.data = t`), is a parameter event, and the graph's representatives must be at their
    addresses. Every other guard is kept (module attributes, types and dict keys, globals,
    global state, the inputs). The whole tree where torch has no `clone_manager` (it came
    with the diff guards of recompiles)."""
    root = guard_manager.root
    if not hasattr(root, "clone_manager"):
        return guard_manager
    return root.clone_manager(lambda node: not _MODULE_TENSOR.search(node.get_source()))
