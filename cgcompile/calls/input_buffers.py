"""Persistent buffers for a graph's user inputs, in the layout the graph was compiled for.

A replayed graph reads its inputs at the addresses it was captured with, so every call copies
the user's tensors into buffers owned here (`fill`). Each buffer keeps the caller's layout:
Inductor compiled the graph for the traced strides (a transposed, sliced, expanded or
channels-last input) and checks them at run time, so a contiguous buffer would be rejected.
A batch tensor gets one zeroed storage sized for the largest batch; each padded size m is a
view of it with the strides the graph expects at m rows: the caller's strides, or, for a batch
tensor whose strides depend on the batch size (`x.t()`), the caller's dim order recomputed
for m rows. Rows n..m-1 hold the tensor's pad value (zero unless declared). `copy_back` writes
the real rows of the batch tensors the graph mutated back into the caller's tensors.

Pad rows are written only where a call may have left other data: each storage of batch rows
keeps `Rows.dirty`, the number of leading rows that may hold data, so a decode loop at one size
copies its n rows and pads nothing (batch tensors whose layout depends on the batch size, or
expanded ones, are padded on every call).

    buffers = InputBuffers(plan, max_batch=512)
    args = buffers.fill(user_args, n=5, padded=8)    # batch tensors: views of 8 rows
    out = graph(*args); buffers.copy_back(user_args, args, n=5)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from cgcompile.calls.input_plan import InputPlan


class Rows:
    """The batch rows of one static storage: how many leading ones may hold data."""

    __slots__ = ("dirty", "pad", "every_row")

    def __init__(self, pad: Any, every_row: torch.Tensor) -> None:
        self.dirty = 0
        """Rows from here on hold the pad value (a new storage is filled with it)."""
        self.pad = pad
        self.every_row = every_row
        """The storage viewed with all its rows, so stale rows past a view's end are reached."""

    def written(self, n: int) -> None:
        """Rows 0..n-1 now hold data: every row past them that may not hold the pad value gets
        it, also rows past the padded view (a steady loop at one size then pads nothing)."""
        if self.dirty > n:
            self.every_row[n : self.dirty].fill_(self.pad)
        self.dirty = n


class InputBuffers:
    """Buffers per input position, allocated on first use; views cached per size."""

    def __init__(self, plan: InputPlan, max_batch: int) -> None:
        self.plan = plan
        self.max_batch = max_batch
        self.storages: dict[tuple[Any, ...], torch.Tensor] = {}
        self._views: dict[tuple[Any, ...], tuple[torch.Tensor, Rows | None]] = {}
        self._rows: dict[tuple[Any, ...], Rows] = {}
        self._pads = dict(plan.pad_values)

    def fill(self, args: Sequence[Any], n: int, padded: int) -> list[Any]:
        """Copy user tensors into the static buffers; batch tensors padded to `padded` rows."""
        out = list(args)
        for i in self.plan.batch_tensors:
            view, rows = self.batch_view(i, args[i], padded)
            copy_into(view[:n] if padded != n else view, args[i])
            if rows is not None:
                rows.written(n)
            elif padded != n:
                self.pad(i, view[n:])
            out[i] = view
        for i in self.plan.copied_tensors:
            view = self._view(i, args[i], None)
            copy_into(view, args[i])
            out[i] = view
        for i in self.plan.size_indices:
            out[i] = padded
        return out

    def copy_back(
        self, user_args: Sequence[Any], static_args: Sequence[Any], n: int, padded: int
    ) -> None:
        """The graph wrote these batch tensors in place: give the caller its real rows (the
        graph may have written the padded rows too)."""
        for i in self.plan.copied_back:
            copy_into(user_args[i], static_args[i][:n])
            rows = self._views[self._view_key(i, static_args[i], padded)][1]
            if rows is not None:
                rows.dirty = max(rows.dirty, padded)

    def at_size(self, args: Sequence[Any], rows: int) -> list[Any]:
        """Arguments for a run at `rows` rows made only of padding rows (pad values, or zeros);
        `args` (any earlier call's) supply the layout, parameters and buffers."""
        out = list(args)
        for i in self.plan.batch_tensors:
            out[i], written = self.batch_view(i, args[i], rows)
            self.pad(i, out[i])
            if written is not None and rows >= written.dirty:
                written.dirty = 0  # every row that may have held data is pad now
        for i in self.plan.copied_tensors:
            out[i] = self._view(i, args[i], None)
        for i in self.plan.size_indices:
            out[i] = rows
        return out

    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.storages.values())

    def pad(self, i: int, rows: torch.Tensor) -> None:
        if rows.numel() and rows.stride(0) != 0:  # an expanded batch has no rows of its own
            rows.fill_(self._pads.get(i, 0))

    def batch_view(self, i: int, like: torch.Tensor, rows: int) -> tuple[torch.Tensor, Rows | None]:
        """The static view of batch input i at `rows` rows and its storage's `Rows` (None
        where pad rows are written on every call: the layout depends on the batch size, or
        the view is expanded)."""
        found = self._views.get(self._view_key(i, like, rows))
        return found if found is not None else self._add_view(i, like, rows)

    def _view(self, i: int, like: torch.Tensor, rows: int | None) -> torch.Tensor:
        found = self._views.get(self._view_key(i, like, rows))
        return (found if found is not None else self._add_view(i, like, rows))[0]

    @staticmethod
    def _view_key(i: int, like: torch.Tensor, rows: int | None) -> tuple[Any, ...]:
        return (i, rows, like.shape if rows is None else like.shape[1:], like.dtype, like.device)

    def _add_view(
        self, i: int, like: torch.Tensor, rows: int | None
    ) -> tuple[torch.Tensor, Rows | None]:
        view = self._make_view(i, like, rows)
        tracked = None
        if rows is not None and i not in self.plan.batch_strided and view.stride(0) != 0:
            storage_key = (i, like.shape[1:], like.dtype, view.untyped_storage().data_ptr())
            tracked = self._rows.get(storage_key)
            if tracked is None:  # the storage holds max(rows, max_batch) rows (`_make_view`)
                every_row = self._make_view(i, like, max(rows, self.max_batch))
                tracked = self._rows[storage_key] = Rows(self._pads.get(i, 0), every_row)
            elif rows > tracked.every_row.shape[0]:  # a storage an untracked view made larger
                tracked.every_row = view
        self._views[self._view_key(i, like, rows)] = (view, tracked)
        return view, tracked

    def _make_view(self, i: int, like: torch.Tensor, rows: int | None) -> torch.Tensor:
        if rows is None:
            shape, stride = tuple(like.shape), like.stride()
            most = shape, stride
        else:
            shape = (rows, *like.shape[1:])
            stride = self._strides(i, like, rows)
            biggest = max(rows, self.max_batch)
            most = (biggest, *like.shape[1:]), self._strides(i, like, biggest)
        pad = 0 if rows is None else self._pads.get(i, 0)
        storage = self._storage(
            (i, rows is None, like.shape[1:], like.dtype), like, _extent(*most), pad
        )
        return storage.as_strided(shape, stride)

    def _strides(self, i: int, like: torch.Tensor, rows: int) -> tuple[int, ...]:
        if i not in self.plan.batch_strided or rows == like.shape[0]:
            return like.stride()
        return dense_strides((rows, *like.shape[1:]), like)

    def _storage(
        self, key: tuple[Any, ...], like: torch.Tensor, numel: int, pad: Any
    ) -> torch.Tensor:
        storage = self.storages.get(key)
        if storage is None or storage.numel() < numel:
            # views made before keep the old storage alive: graphs captured on them stay valid
            storage = torch.full((numel,), pad, dtype=like.dtype, device=like.device)
            self.storages[key] = storage
        return storage


def dense_strides(shape: Sequence[int], like: torch.Tensor) -> tuple[int, ...]:
    """Dense strides for `shape` with `like`'s dim order (innermost = smallest stride)."""
    order = sorted(range(like.dim()), key=lambda d: (like.stride(d), -d))
    strides = [0] * like.dim()
    step = 1
    for d in order:
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), also when dst is expanded (stride 0): such a dim is written once."""
    if 0 in dst.stride():
        for d in range(dst.dim()):
            if dst.stride(d) == 0 and dst.shape[d] > 1:
                dst, src = dst.narrow(d, 0, 1), src.narrow(d, 0, 1)
    dst.copy_(src)


def _extent(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements a tensor of this shape and stride spans from its first element."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
