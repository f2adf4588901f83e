"""Inductor's partition calling convention adapted to `CUDAGraphWrapper`.

Inductor's partition wrapper hook wraps each partition function, which takes ONE list of
tensors and ints and clears it. `PartitionAdapter` unpacks that list so the PIECEWISE
`CUDAGraphWrapper` keys on the int args and checks every tensor's address on its first replay,
exactly as for an FX piece. Which tensors it must copy in is learnt in the artifact's first
forward (`FirstForward`), driven by `PartitionedGraph`, which the backend calls. An eager op's
whole output tuple is handed to the next partition (SDPA's kernels return the output with its
logsumexp, RNG state and more), which reads only some of it (`buf[0]`): the partition's first
run records which elements it reads, and the others are passed as None from then on, so the
graph neither copies nor checks them (on the H200 a 16-layer decode step's copies fell from
82 to 18, as many as on the FX split).

    adapter = PartitionAdapter(partition, 0, 3, first_forward, make_wrapper, "partition_0")
    outs = adapter([x, 8])          # what Inductor's generated `call` does
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_unflatten

from cgcompile.calls.cuda_graph_wrapper import CUDAGraphWrapper, WrapperFactory


class FirstForward:
    """What a partition may read in place, learnt in the first forward of one artifact.

    Graph inputs (parameters, the backend's static buffers) and earlier partitions' outputs
    (graph memory once captured) keep their addresses from call to call. Any other tensor a
    partition receives was allocated in Inductor's `call` by an eager op (an attention kernel
    returning its output), so its address may change: the partition's graph copies it in.
    References are held during that forward so no freed block is mistaken for a kept one.
    """

    def __init__(self) -> None:
        self.unclassified = 0
        """Adapters that have not yet seen a call: tracking stops at 0."""
        self.active = False
        self._kept: dict[int, torch.Tensor] = {}

    def begin(self, args: Sequence[Any]) -> None:
        self.active = True
        self.add(args)

    def end(self) -> None:
        self.active = False
        self._kept = {}

    def add(self, values: Any) -> None:
        for t in tree_leaves(values):
            if isinstance(t, torch.Tensor):
                self._kept[t.untyped_storage().data_ptr()] = t

    def fresh_positions(self, args: Sequence[Any]) -> tuple[int, ...]:
        """Positions of tensors in `args` whose storage is neither input nor partition output."""
        return tuple(
            i
            for i, a in enumerate(args)
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() not in self._kept
        )


class ArgLayout:
    """Flattens the list Inductor passes a partition into tensors and ints, and back.

    An element can be a tuple or list: the whole output of an eager op between partitions (e.g.
    SDPA's (out, logsumexp)), which the partition indexes itself. Its tensors must be seen
    one by one, to be keyed, copied in and address-checked. One level of nesting is unpacked
    inline (the hot path pays a loop); deeper nesting goes through pytree (slower).
    """

    def __init__(self, args: Sequence[Any]) -> None:
        nested = [a for a in args if isinstance(a, (tuple, list))]
        self.spec: TreeSpec | None = None
        self.shape: tuple[tuple[type, int] | None, ...] | None = None
        """Per element: None for a leaf, (tuple or list, length) for a container."""
        self.sources: tuple[tuple[int, int], ...] | None = None
        """Per flat position: (list index, index in that element or -1 for a leaf); None
        with deeper nesting."""
        if any(isinstance(x, (tuple, list)) for a in nested for x in a):
            self.spec = tree_flatten(list(args))[1]
            return
        if nested:
            self.shape = tuple(
                ((list if isinstance(a, list) else tuple), len(a))
                if isinstance(a, (tuple, list))
                else None
                for a in args
            )
        self.sources = tuple(
            (i, j)
            for i, a in enumerate(args)
            for j in (range(len(a)) if isinstance(a, (tuple, list)) else (-1,))
        )

    def flatten(self, args: list[Any], unread: tuple[int, ...] = ()) -> tuple[Any, ...]:
        """The flat args; tuple elements at `unread` positions become None."""
        if self.shape is None:
            return tuple(args) if self.spec is None else tuple(tree_flatten(args)[0])
        flat: list[Any] = []
        for arg, shape in zip(args, self.shape, strict=True):
            if shape is None:
                flat.append(arg)
            else:
                flat.extend(arg)
        for i in unread:
            flat[i] = None
        return tuple(flat)

    def rebuild(self, flat: tuple[Any, ...], reads: set[int] | None = None) -> list[Any]:
        """The list the partition takes; with `reads`, its tuples add to it the flat position
        of each element the partition reads (one level of nesting; others count as read)."""
        if self.shape is None:
            return list(flat) if self.spec is None else tree_unflatten(list(flat), self.spec)
        out: list[Any] = []
        i = 0
        for shape in self.shape:
            if shape is None:
                out.append(flat[i])
                i += 1
            else:
                kind, n = shape
                items = flat[i : i + n]
                if reads is None:
                    out.append(kind(items))
                elif kind is tuple:
                    out.append(_ReadTuple(items, i, reads))
                else:
                    reads.update(range(i, i + n))
                    out.append(kind(items))
                i += n
        return out

    def nested_positions(self) -> frozenset[int]:
        """Flat positions of the elements of containers (one level of nesting)."""
        return frozenset(i for i, (_, j) in enumerate(self.sources or ()) if j >= 0)


class _ReadTuple(tuple):
    """A tuple that notes the flat position of each element read from it."""

    def __new__(cls, items: tuple[Any, ...], start: int, reads: set[int]) -> _ReadTuple:
        obj = super().__new__(cls, items)
        obj._start, obj._reads = start, reads
        return obj

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int):
            if -len(self) <= index < len(self):
                self._reads.add(self._start + index % len(self))
        else:
            self._reads.update(range(self._start, self._start + len(self)))
        return super().__getitem__(index)

    def __iter__(self) -> Any:
        self._reads.update(range(self._start, self._start + len(self)))
        return super().__iter__()


class PartitionAdapter:
    """Stands in for one partition: Inductor calls it with ONE list, which it must clear.

    Per call:
    1. flatten the list (`ArgLayout`) and clear it, as the partition would (the caller's list
       must not keep inputs alive); elements of tuples the partition never read become None;
    2. first call only: build the PIECEWISE wrapper, copying in the tensors `FirstForward`
       finds fresh; it keys on the int args and checks the others' addresses on first replay;
    3. call the wrapper with the flat args; its runnable rebuilds a new list for each run of
       the partition, as a capture or replay may run it again. The first run (always a
       warm-up or a run without graphs, never a capture) records which tuple elements the
       partition reads; the wrapper stops copying the others before its first capture.
    Steady state (automatic dispatch, a key replayed before: `CUDAGraphWrapper.ready_entry`):
    copy the graph's copied-in args straight from the list and replay; no flat tuple is
    built, no second call made (on the H200, PIECEWISE mixed steps of 64 and 256 tokens on
    the partition path went from 1.23x and 1.17x the FX split's time to 0.98-1.03x over three
    runs).
    """

    def __init__(
        self,
        partition: Callable[[list[Any]], Any],
        index: int,
        count: int,
        first_forward: FirstForward,
        make_wrapper: WrapperFactory,
        name: str,
    ) -> None:
        self.partition = partition
        self.index = index
        self.count = count
        self.first_forward = first_forward
        self.make_wrapper = make_wrapper
        self.name = name
        self.wrapper: CUDAGraphWrapper | None = None
        self.layout: ArgLayout | None = None
        self.reads: set[int] | None = None
        """Flat positions the partition read, while its first run records them."""
        self.unread: tuple[int, ...] = ()
        """Flat positions of tuple elements the partition never reads: passed as None."""

    def __call__(self, args: list[Any]) -> Any:
        if self.wrapper is None:
            self._wrap(args)
        elif self.layout.sources is not None and not self.first_forward.active:
            entry = self.wrapper.ready_entry()
            if entry is not None:  # the steady state, without flattening the list
                sources = self.layout.sources
                for i, buffer in entry.static_inputs:
                    k, j = sources[i]
                    arg = args[k] if j < 0 else args[k][j]
                    if arg is not buffer:
                        buffer.copy_(arg)
                args.clear()
                return entry.graph.replay()
        flat = self.layout.flatten(args, self.unread)
        args.clear()
        out = self.wrapper(*flat)
        if self.reads is not None:
            self._stop_recording()
        if self.first_forward.active:
            self.first_forward.add(out)
        return out

    def _wrap(self, args: list[Any]) -> None:
        self.layout = ArgLayout(args)
        flat = self.layout.flatten(args)
        self.wrapper = self.make_wrapper(
            self._run,
            name=self.name,
            copy_arg_indices=self.first_forward.fresh_positions(flat),
            weak_output=self.index == self.count - 1,
        )
        self.first_forward.unclassified -= 1
        if self.layout.nested_positions():
            self.reads = set()

    def _run(self, *flat: Any) -> Any:
        return self.partition(self.layout.rebuild(flat, self.reads))

    def _stop_recording(self) -> None:
        """After the first run: never copy, check or pass what the partition did not read."""
        assert not self.wrapper.entries, "the first run of a partition is never a capture"
        self.unread = tuple(sorted(self.layout.nested_positions() - self.reads))
        self.reads = None
        self.wrapper.copy_arg_indices = tuple(
            i for i in self.wrapper.copy_arg_indices if i not in self.unread
        )


class PartitionedGraph:
    """One Inductor artifact of the whole graph; tracks forwards until every adapter is built."""

    def __init__(self, compiled: Callable[..., Any], first_forward: FirstForward) -> None:
        self.compiled = compiled
        self.first_forward = first_forward

    def __call__(self, *args: Any) -> Any:
        if not self.first_forward.unclassified:
            return self.compiled(*args)
        self.first_forward.begin(args)
        try:
            return self.compiled(*args)
        finally:
            self.first_forward.end()
