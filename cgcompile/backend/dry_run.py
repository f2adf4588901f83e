"""Shape-only stand-ins for the eager splitting ops, so PIECEWISE graphs can be recorded
without running anything.

Capturing the pieces of a split graph one after the other needs, between two pieces, the
tensors the splitting op (attention) hands to the next piece: their shapes, dtypes and
devices, not their values (capture records kernels; it reads no data). Running the op for
real would write what it writes, e.g. a KV cache. Inside `shapes_only(split)` each splitting
piece of `split.split_gm` computes its outputs' metadata on fake tensors and returns zeros
of those shapes and strides, for the thread that entered the block only (other threads' calls,
e.g. the owner's calls beside a background `capture_all`, run the real op); on exit the real
pieces are back. The metadata is computed once
per structure of the piece and metadata of its inputs within a block: the N identical attention
pieces of one key cost one fake run (a fake run costs milliseconds of host time, which made it
most of `capture_all`'s time).

    with shapes_only(split):
        split.split_gm.forward(*args)      # captured pieces record, attention never runs
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Hashable, Iterator
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only

from cgcompile.passes.split import SplitResult, graph_signature


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What a zero stand-in for one output tensor needs."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def zeros(self) -> torch.Tensor:
        """Zeros with these strides: the next piece was compiled for the strides the op's real
        kernel gives (e.g. SDPA's output is not contiguous on CUDA)."""
        return torch.empty_strided(
            self.shape, self.stride, dtype=self.dtype, device=self.device
        ).zero_()


class _ShapesOnly:
    """Runs a splitting piece on fake tensors (once per input metadata among the pieces of the
    same structure sharing `specs`); returns zero tensors shaped like its outputs. Calls from
    any thread but `thread` run `real`."""

    def __init__(
        self, graph: fx.GraphModule, specs: dict[Hashable, Any], real: Any, thread: int
    ) -> None:
        self.graph = graph
        self.signature = _signature(graph)
        self.specs = specs
        self.real = real
        self.thread = thread

    def __call__(self, *args: Any) -> Any:
        if threading.get_ident() != self.thread:
            return self.real(*args)
        key = (self.signature, tuple(_describe(a) for a in args))
        specs = self.specs.get(key)
        if specs is None:
            with FakeTensorMode() as mode:
                fake = tree_map_only(torch.Tensor, mode.from_tensor, args)
                out = self.graph.forward(*fake)
            specs = self.specs[key] = tree_map_only(torch.Tensor, _spec, out)
        return tree_map_only(_Spec, _Spec.zeros, specs)


def _spec(t: torch.Tensor) -> _Spec:
    return _Spec(tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def _describe(arg: Any) -> Hashable:
    """What of an input can change a splitting op's output metadata: a tensor's layout, dtype,
    device and grad flag; a list or tuple element by element; a plain constant itself. Anything
    else gives a key of its own (a new object), so that call is worked out afresh."""
    if isinstance(arg, torch.Tensor):
        layout = (tuple(arg.shape), arg.stride(), arg.storage_offset())
        return (*layout, arg.dtype, arg.device, arg.requires_grad)
    if isinstance(arg, (list, tuple)):
        return (type(arg), tuple(_describe(a) for a in arg))
    if arg is None or isinstance(arg, (bool, int, float, str, torch.dtype, torch.device)):
        return (type(arg), arg)
    return object()


_signatures: weakref.WeakKeyDictionary[fx.GraphModule, Hashable] = weakref.WeakKeyDictionary()


def _signature(graph: fx.GraphModule) -> Hashable:
    """The piece's structure (`graph_signature`), computed once per piece."""
    signature = _signatures.get(graph)
    if signature is None:
        signature = _signatures[graph] = graph_signature(graph)
    return signature


@contextlib.contextmanager
def shapes_only(split: SplitResult) -> Iterator[None]:
    """Within the block, every splitting piece of `split` is a `_ShapesOnly` stand-in for the
    calling thread."""
    installed = split.split_gm.__dict__
    saved = {item.name: installed[item.name] for item in split.splitting}
    specs: dict[Hashable, Any] = {}
    thread = threading.get_ident()
    try:
        for item in split.splitting:
            installed[item.name] = _ShapesOnly(item.graph, specs, saved[item.name], thread)
        yield
    finally:
        installed.update(saved)
