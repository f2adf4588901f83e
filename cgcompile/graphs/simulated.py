"""A CPU stand-in for CUDA graphs with their memory semantics, for tests without a GPU.

`SimulatedGraphRuntime.capture(fn, args)` runs `fn(*args)` once, keeps the `args` objects (the
captured inputs) and the output tensors, undoes any in-place writes the call made to tensor
args, and poisons the outputs, because a real capture computes nothing (an exception `fn`
raises comes out as a `CaptureError`, as from a failed capture on a GPU). `SimulatedGraph.replay`
re-runs `fn` on the *captured* args and copies the results into the captured output tensors in
place, returning the captured output object. Hence, as on a GPU:

- feeding a wrapper a new tensor that is not copied into the captured one gives stale results;
- outputs alias across replays: replay 2 overwrites the tensors replay 1 returned;
- the capture call's outputs hold poison (`poison_value`), never results.

What it cannot imitate: replay runs Python, and capture runs `fn` for real before undoing its
writes to the args, so another thread reading those args meanwhile sees the writes. Side
effects outside tensor math happen on every replay (a counter inside an eager op of a simulated
FULL graph moves; on a GPU it would not), and writes to state not passed as an arg (closures,
globals) also happen at capture. Outputs that share storage with a tensor arg are not
poisoned: on a GPU they show that arg's real data.
Outputs whose elements share memory (expanded or overlapping views) are written storage-wide,
as a graph's kernels wrote them. Args `borrow`ed from a model (its parameters and buffers) are
held weakly, as a CUDA graph holds only their addresses, so a deleted model is freed.

    runtime = SimulatedGraphRuntime()
    graph, out = runtime.capture(torch.sin, (x,), weak_output=False)  # NaN until replay
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from cgcompile.errors import CaptureError, capture_failed


def poison_value(dtype: torch.dtype) -> float | int | bool | None:
    """The fill that marks "not computed": NaN for floating and complex, the integer extreme
    farthest from 0 (`iinfo.min` signed, `iinfo.max` unsigned), True for bool (an all-False
    mask, the usual default, must not pass for a result). None for dtypes without a fill."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    try:
        info = torch.iinfo(dtype)
    except TypeError:
        return None
    return info.min if dtype.is_signed else info.max


class SimulatedGraph:
    """A recorded callable: replay re-runs it on the captured args, writes into the outputs.

    Borrowed args (a model's parameters) are held weakly, as a CUDA graph holds only their
    addresses; replaying after one was freed raises, where a GPU would read freed memory."""

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], output: Any, borrowed: Any = ()
    ) -> None:
        self.fn = fn
        self._args = [weakref.ref(a) if _is_in(a, borrowed) else a for a in args]
        self.output = output
        self._targets = _tensor_leaves(output)

    @property
    def args(self) -> tuple[Any, ...]:
        """The captured args; `CaptureError` if a borrowed one was freed."""
        args = tuple(a() if isinstance(a, weakref.ref) else a for a in self._args)
        if any(a is None for a, held in zip(args, self._args, strict=True) if held is not a):
            raise CaptureError(
                "a simulated graph replayed after a parameter or buffer it reads was freed; "
                "on a GPU it would read freed memory"
            )
        return args

    @property
    def launch(self) -> Callable[[], Any]:
        return self.replay

    def replay(self) -> Any:
        fresh = _tensor_leaves(self.fn(*self.args))
        written: set[int] = set()
        with torch.no_grad():
            for target, result in zip(self._targets, fresh, strict=True):
                _write_into(target, result, written)
        return self.output


class SimulatedGraphRuntime:
    """The "simulated" `GraphRuntime`: CUDA-graph memory semantics on any device.

    Capture steps: snapshot the tensor args; run fn(*args); restore the args it wrote in place;
    poison the outputs that do not share storage with an arg (not in a dry run, whose outputs
    feed only later captures: those run fn too, and need valid values, e.g. indices).
    `weak_output` and `instance` change nothing here (there is no pool: every graph writes
    outputs of its own); outputs are always held strongly.
    """

    name = "simulated"

    def __init__(self) -> None:
        self._borrowed: weakref.WeakValueDictionary[int, torch.Tensor] = (
            weakref.WeakValueDictionary()
        )

    def borrow(self, tensors: Iterable[torch.Tensor]) -> None:
        """Graphs captured from now on hold these weakly."""
        for t in tensors:
            self._borrowed[id(t)] = t

    def capture(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        *,
        weak_output: bool,
        dry_run: bool = False,
        instance: int = 0,
    ) -> tuple[SimulatedGraph, Any]:
        output = _run_without_arg_writes(fn, args)
        if not dry_run:
            _poison(output, {_storage_ptr(a) for a in args if isinstance(a, torch.Tensor)})
        return SimulatedGraph(fn, args, output, self._borrowed), output

    def memory_bytes(self) -> int:
        """Always 0: simulated graphs own no device memory beyond their output tensors."""
        return 0

    def prepare_thread(self) -> None:
        """Nothing: a simulated capture runs on the CPU."""


def _is_in(arg: Any, borrowed: Any) -> bool:
    return isinstance(arg, torch.Tensor) and borrowed.get(id(arg)) is arg


def _poison(output: Any, arg_storages: set[int]) -> None:
    """Fill each output storage that is not an arg's with `poison_value`: whole storages, so
    outputs whose elements overlap (expanded views) are poisoned as well."""
    done = set(arg_storages)
    with torch.no_grad():
        for t in _tensor_leaves(output):
            value = poison_value(t.dtype)
            if value is not None and _storage_ptr(t) not in done:
                done.add(_storage_ptr(t))
                _whole_storage(t).fill_(value)


def _write_into(target: torch.Tensor, result: torch.Tensor, written: set[int]) -> None:
    """What a replay leaves in `target`: `result`'s values, written as a graph would write them.

    Outputs that share memory (views of one buffer, expanded or overlapping views) are written
    storage by storage when both sides have the same layout; a storage is written once."""
    if _storage_ptr(target) == _storage_ptr(result):
        return  # the same memory: fn wrote the captured output itself (e.g. a view of an arg)
    if _same_layout(target, result):
        if _storage_ptr(target) not in written:
            written.add(_storage_ptr(target))
            _whole_storage(target).copy_(_whole_storage(result))
        return
    target.copy_(result)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
        and a.untyped_storage().nbytes() == b.untyped_storage().nbytes()
    )


def _whole_storage(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor of `t`'s dtype over all of `t`'s storage."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return t.new_empty(0).set_(t.untyped_storage(), 0, (n,), (1,))


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _run_without_arg_writes(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """fn(*args), then the tensor args it wrote in place get their old contents back.

    A real capture records kernels without running them, so it writes nothing; without this an
    in-place update of an arg would happen once more in simulation than on a GPU. Contents are
    compared, not only version counters: some ops write args their schema does not mark as
    written (train-mode batch norm's running statistics) and inference tensors have none.
    """
    saved = [(a, a.clone()) for a in args if isinstance(a, torch.Tensor)]
    try:
        return fn(*args)
    except Exception as exc:  # a real capture fails the same way (`graphs.cuda`)
        raise capture_failed(fn, exc) from exc
    finally:
        with torch.no_grad():
            for arg, before in saved:
                if not _same_contents(arg, before):
                    arg.copy_(before)


def _same_contents(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN in the same places (poisoned outputs hold NaN)."""
    if a.equal(b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    return a.isnan().equal(b.isnan()) and a.nan_to_num(0.0).equal(b.nan_to_num(0.0))


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in a tensor / tuple / list / dict output, in a fixed order; others skipped."""
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]
