"""The steady state of a compiled graph's calls: a call of a captured key whose module
instance is known and whose last outputs are free runs the key's prebuilt `ReadyCall`, skipping
dispatch, the input plan and the wrappers (`CompiledGraph` in `compiled_graph` inherits it; every
other call takes its full path).

Checked per call, each at O(1) whatever the model's depth: the thread owns the graphs, no forward
context or background capture is active, the instance is known by its first and last parameter
(identity and address, and no parameter event since its full check: `parameter_events`), the
in-place inputs are where they were, the batch tensors agree on n, a `ReadyCall` exists for
(instance, n, batch kind, sizes), and the last call's outputs are no longer held. Anything else
is a `MISS`. Nothing here allocates, logs or grows with the parameter count.

    out = graph.steady(args)     # the outputs, or MISS: `CompiledGraph.__call__` goes on
"""

from __future__ import annotations

import contextvars
import threading
from sys import getrefcount
from typing import TYPE_CHECKING, Any

import torch

from cgcompile.calls.forward_context import BATCH_HINT, FORWARD_CONTEXT, current_batch_hint
from cgcompile.calls.parameter_events import EVENTS

if TYPE_CHECKING:
    from cgcompile.calls.background import Turns
    from cgcompile.calls.dispatcher import CudagraphDispatcher
    from cgcompile.calls.input_plan import InputPlan
    from cgcompile.calls.instances import InstanceSlots
    from cgcompile.calls.ownership import ThreadOwner
    from cgcompile.calls.ready import ReadyCall
    from cgcompile.calls.variants import SizeVariants

MISS = object()
"""What `SteadyState.steady` returns for a call that is not a steady state."""
_use_count = torch._C._storage_Use_Count

RETURNED: contextvars.ContextVar[list[tuple[SteadyState, Any]] | None] = contextvars.ContextVar(
    "cgcompile_returned", default=None
)
"""Where set, each graph call of this thread (or task) appends (its `CompiledGraph`, outputs):
how `trusted` learns what a model call's graphs returned."""


class SteadyState:
    """The steady-state call of a `CompiledGraph`, whose attributes it reads."""

    owner: ThreadOwner
    uses_graphs: bool
    capture_turns: Turns | None
    instances: InstanceSlots
    plan: InputPlan
    dispatcher: CudagraphDispatcher
    _kind_by_shape: tuple[bool, bool]
    _ready: dict[tuple[Any, ...], ReadyCall]
    _variants: SizeVariants
    _sized: bool

    def steady(self, args: Any, any_ready: bool = True) -> Any:
        """This call's outputs if it is a key's steady state (graphs verified, instance known,
        no output of the last call held), else `MISS`. In one frame, inlined: `known_slot`,
        `batch_size`, the usual `still_held`, a full `ReadyCall` with `hand_out_prebuilt` (one
        `Handed.handed` per output): it runs right after Dynamo's guard check, caches cold,
        where every frame and object costs. Reads `args` only at `steady_reads`: a caller may
        pass a mapping of those (`PaddedBatchOne`, `any_ready=False`: a key whose `ReadyCall`
        is not `inline` is a MISS, as its call reads every argument, and so is every call while
        `trusted` watches one, to see the graph in `RETURNED`)."""
        if (
            self.owner.ident != threading.get_ident()
            or FORWARD_CONTEXT.get() is not None
            or not self.uses_graphs
            or self.capture_turns is not None
            or (not any_ready and RETURNED.get() is not None)  # `trusted` sees `__call__`s
        ):
            return MISS
        instances = self.instances
        reps = instances.reps
        if reps is None:
            slot = instances.known_slot(args)  # a graph without parameters or buffers
        else:
            first, last = args[reps[0]], args[reps[1]]
            slot = instances.by_reps.get((id(first), id(last)))
            if slot is not None:
                instance = instances.slots[slot]
                if (
                    instance.checked != EVENTS.count  # a parameter event since its full check
                    or first.data_ptr() != instance.first_address  # moved: `.data`, `.to()`
                    or last.data_ptr() != instance.last_address
                ):
                    slot = None
        if slot is None or (instances.has_in_place and not instances.same_in_place(slot, args)):
            return MISS
        batch = self.plan.batch_tensors
        if not batch:
            return MISS
        n = args[batch[0]].shape[0]
        for i in batch:
            if args[i].shape[0] != n:
                return MISS
        kind = self._kind_by_shape if BATCH_HINT.get() is None else self._batch_kind(n)
        ready = self._ready.get((slot, n, kind, self._variants.key(args) if self._sized else ()))
        if ready is None:
            return MISS
        outputs = ready.outputs
        if outputs.last_held or outputs.pinned:
            if outputs.still_held() and not outputs.release():
                return MISS
        else:
            for h in outputs.last_handed:  # `Handed.held`
                if getrefcount(h.tensor) > h.refs or _use_count(h.cdata) > h.users:
                    if not outputs.release():
                        return MISS
                    break
        if not ready.inline or outputs.copies:
            return ready(args) if any_ready else MISS
        torch._foreach_copy_(ready.targets, ready.gather(args))
        for rows in ready.marked:
            if rows.dirty != n:  # pad rows an earlier call wrote, or note n data rows
                rows.written(n)
        ready.launch()
        out = list(ready.output)
        handed = ready.prebuilt
        for h in handed:  # `Outputs.hand_out_prebuilt`
            out[h.position] = h.handed()
        outputs.last_held, outputs.last_handed = (), handed
        outputs.held_in_graph_memory = True
        return out

    def steady_reads(self) -> tuple[int, ...] | None:
        """The argument positions `steady` reads; None until the first call chose them."""
        reps = self.instances.reps
        if reps is None and self.instances.has_statics:
            return None
        plan = self.plan
        reads = (*(reps or ()), *plan.kept_in_place, *plan.batch_tensors, *plan.copied_tensors)
        variants = self._variants
        return tuple(sorted({*reads, *variants.positions, *variants.host, *variants.state}))

    def _batch_kind(self, n: int) -> tuple[bool, bool] | None:
        """(uniform decode, LoRA) of this call, from `batch_hint` or, without one, from the
        inputs' shape (`plan.decode_by_shape`); None when the hint forbids runtime modes."""
        hint = current_batch_hint()
        if hint is None:
            return self._kind_by_shape
        if hint.invalid_modes:
            return None
        uniform = hint.uniform_decode
        if uniform is None:
            if hint.num_reqs is None:
                uniform = self.plan.decode_by_shape
            else:
                uniform = n == hint.num_reqs * self.dispatcher.uniform_decode_query_len
        return bool(uniform), hint.has_lora
