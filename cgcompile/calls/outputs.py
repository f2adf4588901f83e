"""What a call that ran graphs hands to its caller, and whether the caller still holds it.

A replay writes its outputs into graph memory that the previous replay of the same module
instance's graphs wrote (each instance has its own memory pool), so an output the caller still
holds at the next call would change under it, which an eager call never does. This happens when
a caller keeps outputs across calls (`outs.append(compiled(x))`) and when a model broken into
several graphs calls one graph twice in a step (keys, then values) and reads the first result
after the second. So each graphed call hands out its graph-memory outputs
(`plan.handed_outputs`) through tensors of their own (a padded call's real rows: a view of
them, detached), and remembers how many tensors used each one's memory then (torch's use count
of the storage, less the views ready calls keep, `our_views`). A ready full graph's steady
state hands out the same prebuilt tensor on every call (`Handed`), so it allocates nothing; it
counts the caller's references to that tensor (`sys.getrefcount`) instead of asking whether a
fresh one is alive. Before a replay the backend asks `still_held()`, then `release()`: the
caller still uses an output's memory if the tensor handed out is alive (it is no view, so a
view of it keeps it alive) or its memory has more users than then (a `detach()` of it, kept
after the output itself was dropped). An output held only through the tensor handed out
(`logits = compiled(x)` in a loop: the old `logits` is still bound during the next call) gets a
copy of its data moved under it (`Tensor.set_`), so the caller keeps its values and the replay
may write graph memory; one copy per held output, only when held. Anything else made from an
output (a view, a detached alias) cannot be moved: it pins graph memory, so calls run without
graphs until it is gone, and this instance's outputs are copied out of graph memory from then
on (`copies`), which is exact whatever the caller keeps. A caller that drops each call's
outputs before the next call, or keeps only what it derives from them (`logits.argmax(-1)`),
stays on the zero-copy path. Outputs that are views of a copied input (`plan.buffer_outputs`)
live in a static buffer the next call refills: they are always copied.

    outputs = Outputs(plan)                      # one per module instance
    if outputs.still_held() and not outputs.release():
        outputs.start_copying()                  # and run this call without graphs
    return outputs.hand_out(out, n, padded)
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from sys import getrefcount
from typing import Any

import torch

from cgcompile.calls.input_plan import InputPlan


def _storage_users(t: torch.Tensor) -> int:
    """Tensors sharing `t`'s storage, views of it included, plus the storage object this
    call makes."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


_OUR_VIEWS = "_cgcompile_row_views"
"""Attribute of a graph's output tensor: a one-element list, how many live views of its real
rows ready calls keep (`row_view`); they share its storage but are no user's."""


def our_views(graph_output: torch.Tensor) -> list[int]:
    """The count of `graph_output`'s views that ready calls keep (a list, read as `[0]`)."""
    return graph_output.__dict__.setdefault(_OUR_VIEWS, [0])


def row_view(graph_output: torch.Tensor, n: int) -> torch.Tensor:
    """A view of the first n rows of `graph_output` for a ready call to keep, counted in
    `our_views` while it lives, so that it is not taken for something the user made."""
    view = graph_output[:n]
    count = our_views(graph_output)
    count[0] += 1
    weakref.finalize(view, _forget_view, count)
    return view


def _forget_view(count: list[int]) -> None:
    count[0] -= 1


Held = tuple[weakref.ref[Any], Callable[[], Any], int, list[int]]
"""(the tensor handed out, the graph's output, tensors on its memory but ours when handed out,
`our_views` of the graph's output)."""


def _kept(held: Held) -> bool:
    """Whether something of the caller's still uses the memory of a handed-out output: more
    users than when it was handed out, or as many once the handed tensor itself is gone."""
    handed, graph_output, users = held[0](), held[1](), held[2]
    if graph_output is None:  # a warm-up's output, freed since: one user fewer
        if handed is None:
            return False  # eager memory: nothing of it is overwritten
        users -= 1
    if handed is None:
        handed, users = graph_output, users - 1
    return _storage_users(handed) - held[3][0] > users


class Handed:
    """One output of a ready full graph as handed out on every call: the same tensor each time
    (`tensor`, a detached alias of `source`, the graph's output or its real rows), so a steady
    call allocates nothing. The caller still holds it at the next call if the tensor has more
    references than ours (`refs`), or its memory more users than at the hand-out (`users`: an
    alias or a view the caller made). A held one gets its data moved under it (`fresh` then
    makes a new one), and so does one the caller changed in place and dropped (`handed`); the
    tensor is counted in `our_views` while it is ours."""

    __slots__ = (
        "position",
        "source",
        "tensor",
        "refs",
        "users",
        "version",
        "layout",
        "cdata",
        "ours",
        "__weakref__",
    )

    def __init__(self, position: int, source: torch.Tensor, graph_output: torch.Tensor) -> None:
        self.position = position
        self.source = source
        """Keeps the storage `cdata` points to alive."""
        self.cdata = source.untyped_storage()._cdata
        self.ours = our_views(graph_output)
        self.ours[0] += 1
        self.fresh()
        weakref.finalize(self, _forget_view, self.ours)

    def fresh(self) -> None:
        """A new tensor to hand out, after the last one was moved off graph memory."""
        self.tensor = self.source.detach()
        self.refs = getrefcount(self.tensor)  # the expression `held` and `still_held` compare
        self.users = _use_count(self.cdata)
        t = self.tensor
        # an inference tensor has no version counter: its layout is compared instead
        inference = t.is_inference()
        self.version = None if inference else t._version
        self.layout = (t.shape, t.stride(), t.storage_offset()) if inference else None

    def handed(self) -> torch.Tensor:
        """The tensor to hand out now; a fresh one if the caller changed the last in place
        before dropping it (its version counter moved: data, shape or strides; for an
        inference tensor its shape, strides or offset) or made it require grad, which the next
        call's output must not inherit."""
        t = self.tensor
        if self.version is None:
            changed = self.layout != (t.shape, t.stride(), t.storage_offset())
        else:
            changed = t._version != self.version
        if changed or t.requires_grad:
            self.fresh()
        self.users = _use_count(self.cdata)
        return self.tensor

    def held(self) -> bool:
        """Whether the caller keeps this tensor or something made from it (on its memory)."""
        return getrefcount(self.tensor) > self.refs or _use_count(self.cdata) > self.users


_use_count = torch._C._storage_Use_Count
"""Tensors (and storage objects) sharing the storage at a `cdata` address."""


class Outputs:
    """Hands out one module instance's outputs; remembers the last graphed call's."""

    def __init__(self, plan: InputPlan) -> None:
        self.handed = plan.handed_outputs
        self.batch = plan.batch_outputs
        self.buffers = plan.buffer_outputs
        self.copies = False
        """Graph-memory outputs are copied (a caller held them across a call)."""
        self.last_held: Sequence[Held] = ()
        """Per output of the last call (`hand_out`): more users of its memory at the next call,
        or as many with the handed tensor gone, means the caller keeps something on graph
        memory."""
        self.last_handed: tuple[Handed, ...] = ()
        """The last call's outputs, where a ready full graph handed them (`hand_out_prebuilt`)."""
        self.held_in_graph_memory = True
        """Whether the last call's outputs came from graphs (not from a warm-up run)."""
        self.pinned: list[Callable[[], bool]] = []
        """Whether each held output that could not be moved is still kept (`start_copying`)."""

    def still_held(self) -> bool:
        """Whether the caller still references an output of the last graphed call (the tensor
        handed out, or anything made from it), or something pinned (`start_copying`)."""
        for h in self.last_handed:  # `Handed.held`, inlined: the steady state asks on every call
            if getrefcount(h.tensor) > h.refs or _use_count(h.cdata) > h.users:
                return True
        for held in self.last_held:
            if held[0]() is not None or _kept(held):
                return True
        return bool(self.pinned) and self._still_pinned()

    def _still_pinned(self) -> bool:
        self.pinned = [kept for kept in self.pinned if kept()]
        return bool(self.pinned)

    def release(self) -> bool:
        """Move a copy of its data under each held output, so the next replay may write graph
        memory; False (nothing must replay) when the caller keeps something else made from one
        (a view, a detached alias), which cannot move, or a pinned one is still kept."""
        if self.pinned and self._still_pinned():
            return False
        if any(_kept(held) for held in self.last_held):
            return False
        if any(_use_count(handed.cdata) > handed.users for handed in self.last_handed):
            return False
        kept = [handed for handed in self.last_handed if handed.held()]  # by the caller alone
        movable = [t for t in (held[0]() for held in self.last_held) if t is not None]
        try:
            for t in movable + [handed.tensor for handed in kept]:
                copy = t.clone()
                t.set_(copy.untyped_storage(), copy.storage_offset(), copy.size(), copy.stride())
        except RuntimeError:  # an inference tensor, now outside inference mode
            return False
        for handed in kept:
            handed.fresh()
        self.last_held, self.last_handed = (), ()
        return True

    def start_copying(self) -> None:
        """Copy graph-memory outputs from now on; the held ones that could not be moved pin
        the instance's graph memory: no graph may replay until they are gone."""
        self.copies = True
        if self.held_in_graph_memory:
            self.pinned += [functools.partial(_kept, held) for held in self.last_held]
        self.pinned += [handed.held for handed in self.last_handed]  # ours: not moved, counted
        self.last_held, self.last_handed = (), ()

    def hand_out(
        self,
        out: Sequence[Any],
        n: int,
        padded: int,
        rows: dict[int, Any] | None = None,
        graphed: bool = True,
        kept_by_graph: bool = True,
    ) -> list[Any]:
        """The call's outputs for the caller: batch outputs sliced to the real rows n. `rows`:
        views of the real rows of handed batch outputs (`row_view`; a full graph's replays
        return the same tensors), detached instead of sliced anew.
        `graphed`: False when no graph ran (a warm-up), whose outputs pin no graph memory.
        `kept_by_graph`: False for a first call's outputs (a capture's), which the graph does
        not keep although their memory is the graph's: held here until the next call, so that
        their users can still be counted then."""
        self.held_in_graph_memory = graphed
        strong = graphed and not kept_by_graph
        out = list(out)
        held = []
        if not self.copies:
            for i in self.handed:
                graph_output = out[i]
                view = rows.get(i) if rows else None
                if view is None and padded != n and i in self.batch:
                    view = graph_output[:n]
                # a tensor of its own (no view: a view of it keeps it alive), the real rows
                handed = out[i] = (graph_output if view is None else view).detach()
                view = None  # a slice made here dies now: it is no user the caller keeps
                ours = our_views(graph_output)
                users = _storage_users(handed) - ours[0]
                ref = (lambda t=graph_output: t) if strong else weakref.ref(graph_output)
                held.append((weakref.ref(handed), ref, users, ours))
        if padded != n:
            for i in self.batch:
                if self.copies or i not in self.handed:  # handed ones hold their real rows
                    out[i] = out[i][:n]
        if self.copies:
            for i in self.handed:
                out[i] = out[i].clone()
        for i in self.buffers:
            out[i] = out[i].clone()
        self.last_held, self.last_handed = held, ()
        return out

    def prebuilt(
        self, graph_out: Sequence[Any], n: int, padded: int, rows: dict[int, Any] | None
    ) -> tuple[Handed, ...] | None:
        """What `hand_out_prebuilt` hands out for a full graph whose replays return the same
        tensors `graph_out`: a `Handed` per handed output, an alias of `rows`' view of its real
        rows or of the output. None where `hand_out` has more to do (buffer outputs, unhanded
        batch outputs to slice)."""
        if self.buffers or (padded != n and not set(self.batch) <= set(rows or ())):
            return None
        return tuple(
            Handed(i, rows[i] if rows and i in rows else graph_out[i], graph_out[i])
            for i in self.handed
        )

    def hand_out_prebuilt(self, out: Sequence[Any], handed: tuple[Handed, ...]) -> list[Any]:
        """`hand_out` of a ready full graph's replay: the prebuilt tensors, nothing allocated
        but the list."""
        out = list(out)
        for h in handed:
            out[h.position] = h.handed()
        self.last_held, self.last_handed = (), handed
        self.held_in_graph_memory = True
        return out
