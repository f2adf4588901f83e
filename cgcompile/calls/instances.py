"""Which module instance a call runs with; each instance's graphs, referenced weakly.

Dynamo compiles a module class's forward once and passes each instance's parameters and
buffers as graph inputs, so one compiled graph serves every instance of the class (identical
layers split into frames by a graph break, too). Graphs bake in parameter addresses, so each
instance gets graphs of its own: `slot_of(args)` names the instance by the identity of its
static tensors (0 for the first; at most `MAX_INSTANCES` live ones), and the slot goes into
every graph key. A slot holds its tensors only through weak references: when one of them is
freed (the model was deleted), the slot is dropped, `on_drop(slot)` frees its graphs and a
later instance reuses the number. Per slot it also keeps the addresses of the inputs the graph
writes in place and the example calls `capture_all` records with (one per size of a state
allocated per batch size, as Hugging Face's `StaticCache`: each serves only its own size).

The check costs O(1) per call in the steady state, whatever the model's size: two representative
tensors, the first and the last parameter among the static inputs (buffers, such as rotary
tables, are often shared by the instances of a layer), name the slot by their identity and must
be at the addresses they had, and the identity and address of all static tensors are compared
again only after a *parameter event*, counted process-wide (`EVENTS`): a parameter, buffer or
submodule assigned to any module (torch's registration hooks: `module.weight = p`,
`load_state_dict(assign=True)`; not the new container a slice `layers[:n]` builds), a static
tensor of a slot freed, or the storage one had at the last full check freed (`p.data = t`,
`model.half()`, `.to(...)` drop the old data); or after a representative moved. A slot whose
tensors moved keeps its number and loses its graphs (`on_drop`): they read the old addresses.
Not seen: writes that bypass the module (`module._parameters[name] = t`, as
`torch.func.functional_call` does), `p.data = t` on a non-representative while the old data is
held elsewhere (graphs read the old, valid memory), and two instances of one class sharing both
representatives but not every parameter, when neither was built after the other's first call
(building registers parameters: an event).

    slots = InstanceSlots(plan.static_tensors, plan.in_place, on_drop=forget, borrow=borrow)
    slot = slots.slot_of(args)          # None: more live instances than MAX_INSTANCES
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from cgcompile.calls.parameter_events import EVENTS

MAX_INSTANCES = 16
"""Live module instances that get graphs of their own; calls of further ones run eagerly."""


@dataclasses.dataclass(eq=False)
class Instance:
    """One module instance seen by a compiled graph."""

    ids: tuple[int, ...]
    """`id` of each static tensor, in input order: the instance's identity while all live."""
    refs: list[weakref.ref[torch.Tensor]]
    checked: int = -1
    """`EVENTS.count` when `ids` were last compared in full: until the next event, the two
    representatives alone name this instance."""
    addresses: tuple[int, ...] = ()
    """`data_ptr` of each static tensor at the last full check: what its graphs read."""
    storages: list[weakref.ref[Any]] = dataclasses.field(default_factory=list)
    """The static tensors' storages at the last full check, weakly: one freed is an event."""
    first_address: int = 0
    last_address: int = 0
    """`data_ptr` of the two representatives then; a call that finds them elsewhere is checked
    in full (`CompiledGraph.steady` reads these, inlined)."""
    in_place_ptrs: tuple[int, ...] | None = None
    """Addresses of the inputs written in place, at this instance's first call."""
    examples: dict[int | None, list[Any]] = dataclasses.field(default_factory=dict)
    """Per size of its batch-sized state (None without one): the arguments of its first call
    (then of its first call with graphs, whose batch tensors are static buffers, not the
    caller's); tensors it does not own held weakly."""
    examples_with_graphs: set[int | None] = dataclasses.field(default_factory=set)


class InstanceSlots:
    """Slot numbers of the live module instances of one compiled graph."""

    def __init__(
        self,
        static: Sequence[int],
        in_place: Sequence[int],
        on_drop: Callable[[int], None],
        borrow: Callable[[Iterable[torch.Tensor]], None],
        batch_state: Sequence[int] = (),
    ) -> None:
        self._static = tuple(static)
        self._in_place = tuple(in_place)
        self.has_in_place = bool(self._in_place)
        """Whether calls must pass the tensors a slot's first call used in place (read per call:
        no tuple built)."""
        self._state = batch_state[0] if batch_state else None
        """A static tensor sized by the batch: its size names an example call."""
        # a tuple even for one index: that one is repeated
        self._get = operator.itemgetter(*static, *static[:1]) if static else lambda args: ()
        self.slots: list[Instance | None] = []
        self.reps: tuple[int, int] | None = None
        """Positions of the two representative tensors, chosen at the first call."""
        self.by_reps: dict[tuple[int, int], int] = {}
        """`id`s of the representatives -> slot, for instances whose pair is theirs alone (a
        pair shared by live instances is in `_shared`). `known_slot` reads these three, and
        `CompiledGraph.steady` too (inlined)."""
        self._shared: set[tuple[int, int]] = set()
        self.full_checks = 0
        """Calls whose static tensors were compared in full (the rest cost one lookup)."""
        self._on_drop = on_drop
        self._borrow = borrow
        self._remembered = False

    def slot_of(self, args: Sequence[Any]) -> int | None:
        """The slot of the instance whose static tensors `args` carries, new if unseen."""
        slot = self.known_slot(args)
        if slot is not None:
            return slot
        if not self._static:
            return self._slot_without_statics()
        return self._full_check(args)

    def known_slot(self, args: Sequence[Any]) -> int | None:
        """`slot_of` where the two representatives name a slot checked in full since the last
        parameter event (the steady state); else None. Reads `args` at `reps` only."""
        reps = self.reps
        if reps is None:
            return 0 if not self._static and self.slots else None
        first, last = args[reps[0]], args[reps[1]]
        slot = self.by_reps.get((id(first), id(last)))
        if slot is not None:
            instance = self.slots[slot]
            if (
                instance.checked == EVENTS.count
                and first.data_ptr() == instance.first_address
                and last.data_ptr() == instance.last_address
            ):
                return slot
        return None

    @property
    def has_statics(self) -> bool:
        """Whether the graph takes parameters or buffers (else one instance serves every call)."""
        return bool(self._static)

    def _full_check(self, args: Sequence[Any]) -> int | None:
        self.full_checks += 1
        statics = self._get(args)
        ids = tuple(map(id, statics))
        slot = next((k for k, inst in enumerate(self.slots) if inst and inst.ids == ids), None)
        if slot is None:
            slot = self._add(ids, statics)
            if slot is None:
                return None
        instance = self.slots[slot]
        instance.checked = EVENTS.count
        addresses = tuple(t.data_ptr() for t in statics)
        if instance.addresses != addresses:
            if instance.addresses:  # the same tensors moved: `.data` swapped, `.to(...)`
                instance.in_place_ptrs = None
                self._on_drop(slot)
            instance.addresses = addresses
            instance.storages = _watch_storages(statics)
        if self.reps is None:
            params = [i for i in self._static if isinstance(args[i], torch.nn.Parameter)]
            self.reps = (params[0], params[-1]) if params else (self._static[0], self._static[-1])
        instance.first_address = args[self.reps[0]].data_ptr()
        instance.last_address = args[self.reps[1]].data_ptr()
        pair = (id(args[self.reps[0]]), id(args[self.reps[1]]))
        if pair not in self._shared:
            owner = self.by_reps.setdefault(pair, slot)
            if owner != slot and self.slots[owner] is not None:
                self._shared.add(pair)  # two live instances share both representatives
                del self.by_reps[pair]
            else:
                self.by_reps[pair] = slot
        return slot

    def _slot_without_statics(self) -> int:
        """A graph without parameters or buffers: every call is the one instance."""
        if not self.slots:
            self.slots.append(Instance((), []))
        return 0

    def live(self) -> list[int]:
        return [slot for slot, instance in enumerate(self.slots) if instance is not None]

    def same_in_place(self, slot: int, args: Sequence[Any]) -> bool:
        """Whether the inputs written in place are where this instance's first call had them:
        its graphs read and write them there."""
        instance = self.slots[slot]
        ptrs = tuple(args[i].data_ptr() for i in self._in_place)
        if instance.in_place_ptrs is None:
            instance.in_place_ptrs = ptrs
            self._borrow(args[i] for i in self._in_place)
        return ptrs == instance.in_place_ptrs

    def remember(self, slot: int, args: Sequence[Any], with_graphs: bool) -> None:
        """Keep arguments for `capture_all`, per size of the batch-sized state: the first
        call's, replaced once by the first call's with graphs; the model's and in-place
        tensors weakly."""
        instance = self.slots[slot]
        size = None if self._state is None else args[self._state].shape[0]
        if instance is None or size in instance.examples_with_graphs:
            return
        if size not in instance.examples or with_graphs:
            weak = set(self._static) | set(self._in_place)
            example = [weakref.ref(a) if i in weak else a for i, a in enumerate(args)]
            instance.examples[size] = example
            if with_graphs:
                instance.examples_with_graphs.add(size)
            self._remembered = True

    @property
    def remembered(self) -> bool:
        """Whether an example call was ever kept (its instance may since have been freed)."""
        return self._remembered

    def examples(self, slot: int) -> list[list[Any]]:
        """The remembered arguments, one list per state size; none where one was freed."""
        instance = self.slots[slot]
        found = []
        for example in instance.examples.values() if instance is not None else ():
            args = [a() if isinstance(a, weakref.ref) else a for a in example]
            if all(a is not None for a in args):
                found.append(args)
        return found

    def _add(self, ids: tuple[int, ...], statics: tuple[Any, ...]) -> int | None:
        free = [slot for slot, instance in enumerate(self.slots) if instance is None]
        if not free and len(self.slots) >= MAX_INSTANCES:
            return None
        slot = free[0] if free else len(self.slots)
        instance = Instance(ids, [])
        unique = {id(t): t for t in statics}.values()
        instance.refs = [
            weakref.ref(t, lambda _, s=slot, i=instance: self._drop(s, i)) for t in unique
        ]
        if free:
            self.slots[slot] = instance
        else:
            self.slots.append(instance)
        self._borrow(unique)
        return slot

    def _drop(self, slot: int, instance: Instance) -> None:
        """A static tensor of `instance` was freed: forget the instance and its graphs."""
        EVENTS.bump()  # its id may now name a new tensor
        if slot < len(self.slots) and self.slots[slot] is instance:
            self.slots[slot] = None
            for pair in [p for p, s in self.by_reps.items() if s == slot]:
                del self.by_reps[pair]
            self._on_drop(slot)


def _watch_storages(tensors: Iterable[torch.Tensor]) -> list[weakref.ref[Any]]:
    """Weak references whose callback counts a parameter event when a storage is freed. Torch
    keeps one Python object per storage for its whole life, so the callback runs when the
    storage itself goes: after `p.data = t` on any parameter, unless the old data is still
    held elsewhere."""
    if not _storages_keep_their_python_object():
        return []  # a weak reference would die with the wrapper, not with the storage
    storages = {}
    for t in tensors:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without a storage (sparse)
            continue
        storages[id(storage)] = storage
    return [weakref.ref(s, _storage_freed) for s in storages.values()]


def _storage_freed(_: Any) -> None:
    EVENTS.bump()


@functools.cache
def _storages_keep_their_python_object() -> bool:
    probe = torch.empty(1)
    return probe.untyped_storage() is probe.untyped_storage()


def weak_method(method: Callable[..., None]) -> Callable[..., None]:
    """`method` without a strong reference to its object (a callback `InstanceSlots` holds): a
    compiled graph must be freed as soon as Dynamo drops it, not when the collector finds a
    cycle."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call
