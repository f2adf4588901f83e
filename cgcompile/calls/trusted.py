"""`cgcompile.trusted(compiled)` and `cgcompile.guarded(compiled)`: call a compiled model's
captured graphs without Dynamo's per-call code.

Each call of a `torch.compile`d model enters Dynamo: its frame hook, the guard check of every
cache entry, and the compiled code that gathers every parameter and buffer as a graph input,
which grows with the model. Both callables skip that code: for a call whose graph key was
captured and replayed before (a `ReadyCall`), they copy the call's tensors into the static
buffers and replay, with parameters and buffers bound once (held). Any other call goes through
the compiled model as usual (Dynamo compiles, cgcompile captures), watching which
`CompiledGraph` it ran (`RETURNED`), and binds that graph: the graphs of its own compiled model,
never another compile's (every compile of a class, of any backend, shares the forward's code
object and so Dynamo's cache).

What both check per call, falling back to the compiled model (which recompiles, or recaptures,
if need be, and runs a call from a thread that does not own the graphs eagerly): the thread, no
forward context set by the caller (manual mode: its mode and descriptor decide), positional
arguments only, as many as at binding; each tensor argument's dtype and rank; grad mode; the
addresses of the state sized by the batch that the caller passes (a cache per batch size: each
cache replays graphs of its own, as in the default call), and of the other static-address tensors
it passes (another one goes through the compiled model); and, in O(1) whatever the model's
size, what the compiled model's own instance check sees (`instances`):
no parameter event since binding (a parameter, buffer or submodule assigned to any module:
`model.w = nn.Parameter(...)`, `load_state_dict(assign=True)`; a parameter's old storage freed:
`p.data = t` on any, `model.half()`, `.to(dtype or device)`) and the graph's two representative
parameters at the addresses they had.

`guarded` also runs, per call, the guard check of the Dynamo cache entry that holds the bound
graph on the call's frame locals (the module attributes, types and methods the forward read,
globals, global state, every input's dtype, device and sizes), less the guards on module
parameters and buffers, which the O(1) check above covers (`without_module_tensors`: two thirds
of the check at 16 layers), and goes through the compiled model when the top-level module or the
compiled wrapper has hooks: it checks what the default call checks, without the bytecode that
gathers the parameters (`benchmarks/guard_costs.py`), except a parameter's `.data` swapped for
one of another dtype, device or shape while the old data is held elsewhere. Its check still
grows with depth: the guards on each module's type, instance attributes and methods, which no
event reports. `trusted` checks nothing more (the promise): not `p.data = t` while the old data
is held elsewhere, writes that bypass the module (`module._parameters[name] = t`), the model's
Python attributes and hooks, global flags, tensor arguments' devices and non-batch sizes. Both
refuse, with one WARNING, and then always call the compiled model: a forward with graph breaks
or non-batch int inputs, or that picks state sized by the batch itself (a cache held by the
model, which only the forward knows per call), keyword arguments, one that returns anything but
a graph output or a tuple or list of them (Python work after the graph would be skipped, e.g. a
Hugging Face `ModelOutput`), and a call that ran no graph of backend='cudagraph_modes'.

Why the default call does not do this itself (torch 2.9-2.14; issue 41): a backend cannot change
the code Dynamo runs around its graph, which gathers every parameter (it grows with depth with no
guards at all). It could drop guards from Dynamo's tracing context while it compiles (private),
but those cgcompile's check covers in part, the tensor guards on parameters and buffers, send a
submodule moved to another dtype, device or shape to a new trace: without them its graphs would
rerun code compiled for the old one. `install_free_tensors` is process-wide and loses what
identifies the instance. Figures: `benchmarks/guard_costs.py` (`no-param-guards`, `no-guards`).

    fast = cgcompile.guarded(compiled)     # after warm-up calls of the compiled model
    logits = fast(tokens, positions)
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from cgcompile.calls.compiled_graph import CompiledGraph
from cgcompile.calls.forward_context import FORWARD_CONTEXT
from cgcompile.calls.frame_binding import (
    SIZE,
    Binding,
    compiled_graph_of,
    graph_break,
    hooked,
    returns_of,
    source_value,
    without_module_tensors,
)
from cgcompile.calls.parameter_events import EVENTS
from cgcompile.calls.steady_state import RETURNED
from cgcompile.errors import CGCompileError

logger = logging.getLogger(__name__)
_USER = re.compile(r"^L\['(\w+)'\]$")


class TrustedCall:
    """Calls `compiled`'s captured graphs directly; see the module docstring."""

    def __init__(self, compiled: Any, check_guards: bool = False) -> None:
        self.compiled = compiled
        self.check_guards = check_guards
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
        self._frame = dict(self._locals)
        """`guarded`'s frame locals, refilled per call."""
        self._grad = False
        """Grad mode at binding: a call in the other mode needs Dynamo's other graph."""
        self._bindings: dict[int | None, Binding] = {}
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
        if binding is None or binding.returns is None or binding.events != EVENTS.count:
            return self._through_dynamo(args, kwargs)
        first = binding.first  # `is_current`, inlined
        if first is not None and (
            first.data_ptr() != binding.first_address
            or binding.last.data_ptr() != binding.last_address
        ):
            return self._through_dynamo(args, kwargs)
        for position, dtype, rank in binding.checks:
            arg = args[position]
            if arg.dtype is not dtype or arg.dim() != rank:
                return self._through_dynamo(args, kwargs)
        for position, address in binding.fixed:
            if args[position].data_ptr() != address:
                return self._through_dynamo(args, kwargs)
        graph = binding.graph
        if graph.capture_turns is not None:  # a background capture_all: calls take turns
            return self._through_dynamo(args, kwargs)
        if graph.owner.ident != threading.get_ident():  # another thread's graphs: eager there
            return self._through_dynamo(args, kwargs)
        if FORWARD_CONTEXT.get() is not None:  # the caller's own mode and descriptor
            return self._through_dynamo(args, kwargs)
        if binding.guards is not None and not self._guards_pass(binding.guards, args):
            return self._through_dynamo(args, kwargs)
        # `SizeVariants.key` of a graph whose only variants are the caches the caller passes
        variant = tuple([args[i].data_ptr() for i in binding.state]) if binding.state else ()
        ready = graph._ready.get((binding.slot, n, graph._batch_kind(n), variant))
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

    def _guards_pass(self, guards: Any, args: tuple[Any, ...]) -> bool:
        """`guarded`: no module hooks outside the forward, and the entry's guards accept the
        call's frame locals (one dict, refilled per call and emptied after)."""
        if hooked(self.compiled):
            return False
        frame = self._frame
        for i, name in enumerate(self._params):
            frame[name] = args[i]
        passed = guards.check(frame)
        for name in self._params:
            frame[name] = None
        return passed

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
        """Bind the graph this call of the compiled model ran (never another compile's: the
        forward's code object, and so Dynamo's cache, is shared by every compile of the class)."""
        if self._grad is not torch.is_grad_enabled():
            self._grad = torch.is_grad_enabled()
            self._bindings.clear()
        if not returned:
            raise CGCompileError(
                "cgcompile.trusted needs backend='cudagraph_modes': no graph of it ran in this call"
            )
        if len(returned) > 1:
            raise graph_break(self._function)
        graph, out = returned[0]
        if not graph.uses_graphs:  # e.g. the graph of the other grad mode
            return
        entry = self._check_one_frame(graph)
        key = graph.plan.static_batch
        binding = self._bindings.get(key)
        if binding is None or binding.graph is not graph or not binding.is_current():
            binding = self._bindings[key] = self._binding(graph, args)
        binding.returns = returns_of(result, out)
        if key is None:  # Dynamo now runs the dynamic graph for this size (e.g. automatic
            self._bindings.pop(args[binding.batch_arg].shape[0], None)  # dynamic after a trace)
        if self.check_guards and (binding.guards is None or binding.entry is not entry):
            binding.entry, binding.guards = entry, without_module_tensors(entry.guard_manager)

    def _check_one_frame(self, graph: CompiledGraph) -> Any:
        """The cache entry of the forward itself whose only graph is `graph`; raise if there is
        none (a graph break leaves Python work between graphs, which replaying one would skip)."""
        for entry in _debug_get_cache_entry_list(self._function.__code__):
            names = [n for n in entry.code.co_names if n.startswith("__compiled_fn")]
            if graph not in (compiled_graph_of(self._function.__globals__.get(n)) for n in names):
                continue  # another compile's entry, of this or another backend
            if len(names) != 1 or any(n.startswith("__resume_at") for n in entry.code.co_names):
                raise graph_break(self._function)
            return entry
        raise graph_break(self._function)

    def _binding(self, graph: CompiledGraph, args: tuple[Any, ...]) -> Binding:
        if graph._variants.positions or graph._variants.host:
            raise CGCompileError(
                "cgcompile.trusted: the graph has int inputs other than the batch size (or host "
                "scalars), whose values Dynamo's guards would check; pass them as tensors"
            )
        frame = {**self._locals, **dict(zip(self._params, args, strict=False))}
        user, template = [], []
        for placeholder, name in enumerate(graph.plan.names):
            template.append(source_value(name, frame, self._function.__globals__, args))
            match = _USER.match(name)
            if match and match.group(1) in self._params:
                user.append((placeholder, self._params.index(match.group(1))))
            elif not isinstance(template[-1], torch.Tensor) and not SIZE.match(name):
                raise CGCompileError(
                    f"cgcompile.trusted: the graph reads {name}, a Python "
                    f"{type(template[-1]).__name__} that Dynamo passes as a graph input; its "
                    f"value would be frozen at binding (make it a tensor or a constant)"
                )
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
        passed = dict(user)
        if any(i not in passed for i in graph._variants.state):
            raise CGCompileError(
                "cgcompile.trusted: the graph writes state sized by the batch that the caller "
                "does not pass (a cache the forward picks per batch size); pass it as an argument "
                "or compile a graph per size"
            )
        self._batch_arg = batch_arg
        binding = Binding(graph, slot, tuple(user), batch_arg, template, checks, EVENTS.count)
        binding.state = tuple(passed[i] for i in graph._variants.state)
        binding.fixed = tuple(
            (passed[i], template[i].data_ptr()) for i in graph.plan.passed_static if i in passed
        )
        reps = graph.instances.reps
        if reps is not None:
            binding.first, binding.last = template[reps[0]], template[reps[1]]
            binding.first_address = binding.first.data_ptr()
            binding.last_address = binding.last.data_ptr()
        return binding


def trusted(compiled: Any) -> Callable[..., Any]:
    """A callable that replays `compiled`'s captured graphs without Dynamo (see the module
    docstring for what it checks and what it trusts); other calls go through `compiled`."""
    return TrustedCall(compiled)


def guarded(compiled: Any) -> Callable[..., Any]:
    """A callable that replays `compiled`'s captured graphs after the guard check of their
    Dynamo cache entry and cgcompile's own, without the bytecode that gathers every parameter
    (see the module docstring); other calls go through `compiled`."""
    return TrustedCall(compiled, check_guards=True)
