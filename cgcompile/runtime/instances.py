"""Which module instance a call runs with; each instance's graphs, referenced weakly.

Dynamo compiles a module class's forward once and passes each instance's parameters and
buffers as graph inputs, so one compiled graph serves every instance of the class (identical
layers split into frames by a graph break, too). Graphs bake in parameter addresses, so each
instance gets graphs of its own: `slot_of(args)` names the instance by the identity of its
static tensors (0 for the first; at most `MAX_INSTANCES` live ones), and the slot goes into
every graph key. A slot holds its tensors only through weak references: when one of them is
freed (the model was deleted), the slot is dropped, `on_drop(slot)` frees its graphs and a
later instance reuses the number. Per slot it also keeps the addresses of the inputs the graph
writes in place and the example call `capture_all` records with.

    slots = InstanceSlots(plan.static_tensors, plan.in_place, on_drop=forget, borrow=borrow)
    slot = slots.slot_of(args)          # None: more live instances than MAX_INSTANCES
"""

from __future__ import annotations

import dataclasses
import operator
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

MAX_INSTANCES = 16
"""Live module instances that get graphs of their own; calls of further ones run eagerly."""


@dataclasses.dataclass(eq=False)
class Instance:
    """One module instance seen by a compiled graph."""

    ids: tuple[int, ...]
    """`id` of each static tensor, in input order: the instance's identity while all live."""
    refs: list[weakref.ref[torch.Tensor]]
    in_place_ptrs: tuple[int, ...] | None = None
    """Addresses of the inputs written in place, at this instance's first call."""
    example: list[Any] | None = None
    """Arguments of its first call (then of its first call with graphs, whose batch tensors
    are static buffers, not the caller's); tensors it does not own held weakly."""
    example_has_graphs: bool = False


class InstanceSlots:
    """Slot numbers of the live module instances of one compiled graph."""

    def __init__(
        self,
        static: Sequence[int],
        in_place: Sequence[int],
        on_drop: Callable[[int], None],
        borrow: Callable[[Iterable[torch.Tensor]], None],
    ) -> None:
        self._static = tuple(static)
        self._in_place = tuple(in_place)
        # a tuple even for one index: that one is repeated
        self._get = operator.itemgetter(*static, *static[:1]) if static else lambda args: ()
        self._slots: list[Instance | None] = []
        self._on_drop = on_drop
        self._borrow = borrow
        self._remembered = False

    def slot_of(self, args: Sequence[Any]) -> int | None:
        """The slot of the instance whose static tensors `args` carries, new if unseen."""
        statics = self._get(args)
        ids = tuple(map(id, statics))
        for slot, instance in enumerate(self._slots):
            if instance is not None and instance.ids == ids:
                return slot
        return self._add(ids, statics)

    def live(self) -> list[int]:
        return [slot for slot, instance in enumerate(self._slots) if instance is not None]

    def same_in_place(self, slot: int, args: Sequence[Any]) -> bool:
        """Whether the inputs written in place are where this instance's first call had them:
        its graphs read and write them there."""
        instance = self._slots[slot]
        ptrs = tuple(args[i].data_ptr() for i in self._in_place)
        if instance.in_place_ptrs is None:
            instance.in_place_ptrs = ptrs
            self._borrow(args[i] for i in self._in_place)
        return ptrs == instance.in_place_ptrs

    def remember(self, slot: int, args: Sequence[Any], with_graphs: bool) -> None:
        """Keep arguments for `capture_all`: the first call's, replaced once by the first
        call's with graphs; the model's and in-place tensors weakly."""
        instance = self._slots[slot]
        if instance is None or instance.example_has_graphs:
            return
        if instance.example is None or with_graphs:
            weak = set(self._static) | set(self._in_place)
            instance.example = [weakref.ref(a) if i in weak else a for i, a in enumerate(args)]
            instance.example_has_graphs = with_graphs
            self._remembered = True

    @property
    def remembered(self) -> bool:
        """Whether an example call was ever kept (its instance may since have been freed)."""
        return self._remembered

    def example(self, slot: int) -> list[Any] | None:
        """The remembered arguments, or None if there are none or one was freed."""
        instance = self._slots[slot]
        if instance is None or instance.example is None:
            return None
        args = [a() if isinstance(a, weakref.ref) else a for a in instance.example]
        return None if any(a is None for a in args) else args

    def _add(self, ids: tuple[int, ...], statics: tuple[Any, ...]) -> int | None:
        free = [slot for slot, instance in enumerate(self._slots) if instance is None]
        if not free and len(self._slots) >= MAX_INSTANCES:
            return None
        slot = free[0] if free else len(self._slots)
        instance = Instance(ids, [])
        unique = {id(t): t for t in statics}.values()
        instance.refs = [
            weakref.ref(t, lambda _, s=slot, i=instance: self._drop(s, i)) for t in unique
        ]
        if free:
            self._slots[slot] = instance
        else:
            self._slots.append(instance)
        self._borrow(unique)
        return slot

    def _drop(self, slot: int, instance: Instance) -> None:
        """A static tensor of `instance` was freed: forget the instance and its graphs."""
        if slot < len(self._slots) and self._slots[slot] is instance:
            self._slots[slot] = None
            self._on_drop(slot)
