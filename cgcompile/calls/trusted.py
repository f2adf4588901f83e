"""`cgcompile.trusted(compiled)`: call a compiled model's captured graphs without Dynamo.

Each call of a `torch.compile`d model enters Dynamo: its frame hook, the guard check of every
cache entry, and the compiled code that gathers every parameter and buffer as a graph input,
which grows with the model. A caller who promises not to change the model after warm-up can
skip all of it: `trusted(compiled)` returns a callable that, for a call whose graph key was
captured and replayed before (a `ReadyCall`), copies the call's tensors into the static buffers
and replays, with parameters and buffers bound once (it holds them). Any other call goes
through the compiled model as usual (Dynamo compiles, cgcompile captures), and the bindings are
read again.

What it still checks per call, falling back to the compiled model (which recompiles if need
be): positional arguments only, as many as at binding; each tensor argument's dtype and rank;
grad mode. What it does not check (the promise): the model's parameters and buffers (replaced
ones are not seen: their old tensors are used), its Python attributes and hooks, global flags,
tensor arguments' devices and non-batch sizes. It refuses, with one WARNING, and then always
calls the compiled model: a forward with graph breaks or non-batch int inputs, and one that
returns anything but a graph output or a tuple or list of them (Python work after the graph
would be skipped).

    fast = cgcompile.trusted(compiled)     # after warm-up calls of the compiled model
    logits = fast(tokens, positions)
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from cgcompile.calls.compiled_graph import RETURNED, CompiledGraph
from cgcompile.errors import CGCompileError

logger = logging.getLogger(__name__)
_USER = re.compile(r"^L\['(\w+)'\]$")
_SIZE = re.compile(r"^L\['(\w+)'\]\.size\(\)\[(\d+)\]$")


@dataclasses.dataclass
class _Binding:
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
    returns: str | None = None
    """How the forward's return is made from the graph's outputs: 'first', 'tuple', 'list'."""


class TrustedCall:
    """Calls `compiled`'s captured graphs directly; see the module docstring."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        module = getattr(compiled, "_orig_mod", None)
        if module is not None:
            function = type(module).forward
            self._locals = {"self": module}
        else:
            function = getattr(compiled, "_torchdynamo_orig_callable", None)
            if function is None:
                raise CGCompileError(
                    f"cgcompile.trusted takes what torch.compile returned, got {type(compiled)}"
                )
            self._locals = {}
        self._function = function
        self._params = [p for p in inspect.signature(function).parameters if p not in self._locals]
        self._grad = False
        """Grad mode at binding: a call in the other mode needs Dynamo's other graph."""
        self._bindings: dict[int | None, _Binding] = {}
        """Batch size -> binding of the graph specialised to it; None: the dynamic graph."""
        self._batch_arg: int | None = None
        self.refused: str | None = None
        """Why calls always go through the compiled model (said once at WARNING)."""
        self.calls_through_dynamo = 0
        """Calls that went through the compiled model (first calls of a key, broken promises)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if (
            kwargs
            or self._batch_arg is None
            or len(args) != len(self._params)
            or torch.is_grad_enabled() is not self._grad
        ):
            return self._through_dynamo(args, kwargs)
        n = args[self._batch_arg].shape[0]
        binding = self._bindings.get(n) or self._bindings.get(None)
        if binding is None or binding.returns is None:
            return self._through_dynamo(args, kwargs)
        for position, dtype, rank in binding.checks:
            arg = args[position]
            if arg.dtype is not dtype or arg.dim() != rank:
                return self._through_dynamo(args, kwargs)
        graph = binding.graph
        if graph.capture_turns is not None:  # a background capture_all: calls take turns
            return self._through_dynamo(args, kwargs)
        ready = graph._ready.get((binding.slot, n, graph._batch_kind(n), ()))
        if ready is None or (ready.outputs.still_held() and not ready.outputs.release()):
            return self._through_dynamo(args, kwargs)
        if ready.graph is not None:  # FULL: only the caller's tensors are read
            values: Any = {placeholder: args[i] for placeholder, i in binding.user}
        else:
            values = binding.template.copy()
            for placeholder, i in binding.user:
                values[placeholder] = args[i]
        out = ready(values)
        if binding.returns == "first":
            return out[0]
        return out if binding.returns == "list" else tuple(out)

    def _through_dynamo(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The compiled model's own call, recording what each graph returned; then bind."""
        self.calls_through_dynamo += 1
        if self.refused is not None or kwargs:
            return self.compiled(*args, **kwargs)
        returned: list[tuple[CompiledGraph, Any]] = []
        token = RETURNED.set(returned)
        try:
            result = self.compiled(*args)
        finally:
            RETURNED.reset(token)
        try:
            self._bind(args, returned, result)
        except CGCompileError as exc:
            self.refused = str(exc)
            logger.warning("%s; every call goes through the compiled model", exc)
        return result

    def _bind(self, args: tuple[Any, ...], returned: list[Any], result: Any) -> None:
        if self._grad is not torch.is_grad_enabled():
            self._grad = torch.is_grad_enabled()
            self._bindings.clear()
        graphs = self._graphs()
        for graph in graphs:
            if not graph.uses_graphs:  # e.g. the graph of the other grad mode
                continue
            key = graph.plan.static_batch
            if key not in self._bindings or self._bindings[key].graph is not graph:
                self._bindings[key] = self._binding(graph, args)
        if len(returned) == 1:
            graph, out = returned[0]
            binding = self._bindings.get(graph.plan.static_batch)
            if binding is not None and binding.graph is graph:
                binding.returns = _returns(result, out)

    def _graphs(self) -> list[CompiledGraph]:
        entries = _debug_get_cache_entry_list(self._function.__code__)
        graphs = []
        for entry in entries:
            names = [n for n in entry.code.co_names if n.startswith("__compiled_fn")]
            if len(names) != 1 or any(n.startswith("__resume_at") for n in entry.code.co_names):
                raise CGCompileError(
                    f"cgcompile.trusted: {self._function.__qualname__} compiles to more than one "
                    f"graph (a graph break); compile it with fullgraph=True to find the break"
                )
            graph = self._function.__globals__.get(names[0])
            while graph is not None and not isinstance(graph, CompiledGraph):
                graph = getattr(graph, "__wrapped__", None)
            if graph is None:
                raise CGCompileError("cgcompile.trusted needs backend='cudagraph_modes'")
            graphs.append(graph)
        return graphs

    def _binding(self, graph: CompiledGraph, args: tuple[Any, ...]) -> _Binding:
        if graph._sized:
            raise CGCompileError(
                "cgcompile.trusted: the graph has int inputs other than the batch size (or host "
                "scalars), whose values Dynamo's guards would check; pass them as tensors"
            )
        frame = {**self._locals, **dict(zip(self._params, args, strict=False))}
        user, template = [], []
        for placeholder, name in enumerate(graph.plan.names):
            template.append(_value(name, frame, self._function.__globals__, args))
            match = _USER.match(name)
            if match and match.group(1) in self._params:
                user.append((placeholder, self._params.index(match.group(1))))
        checks = tuple(
            (i, a.dtype, a.dim()) for i, a in enumerate(args) if isinstance(a, torch.Tensor)
        )
        slot = graph.instances.slot_of(template)
        first = graph.plan.batch_tensors[0] if graph.plan.batch_tensors else None
        batch_arg = dict(user).get(first)
        if batch_arg is None:
            raise CGCompileError(
                "cgcompile.trusted: the graph has no batch input the caller passes"
            )
        self._batch_arg = batch_arg
        return _Binding(graph, slot, tuple(user), batch_arg, template, checks)


def _value(name: str, frame: dict[str, Any], globals_: dict[str, Any], args: Any) -> Any:
    size = _SIZE.match(name)
    if size:
        return frame[size.group(1)].shape[int(size.group(2))]
    try:
        return eval(name, {"G": globals_}, {"L": frame})  # Dynamo's source names are Python
    except Exception as exc:
        raise CGCompileError(
            f"cgcompile.trusted cannot bind the graph input {name} ({type(exc).__name__}); call "
            f"the compiled model instead"
        ) from exc


def _returns(result: Any, out: list[Any]) -> str | None:
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


def trusted(compiled: Any) -> Callable[..., Any]:
    """A callable that replays `compiled`'s captured graphs without Dynamo (see the module
    docstring for what it checks and what it trusts); other calls go through `compiled`."""
    return TrustedCall(compiled)
