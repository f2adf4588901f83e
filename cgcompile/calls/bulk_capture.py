"""`capture_all`: record every graph a compiled graph's dispatcher lists, running nothing.

For each live module instance that has had a call with graphs: FULL graphs are recorded whole,
and PIECEWISE pieces are recorded one after the other with each eager splitting op replaced by
a shape-only stand-in (`dry_run.shapes_only`), on batches made of padding rows, so parameters,
buffers and inputs keep their values. Inductor's partitioned code has no stand-ins: its
PIECEWISE keys are recorded only when the graph writes no state, else left to lazy capture.
PIECEWISE keys first, then FULL, each largest first so smaller graphs reuse the pool blocks of
larger ones; the heap is collected once per `capture_all` and frozen meanwhile (`frozen_heap`).
A key whose capture fails is left to lazy capture (which warms up first).

A runtime mode whose compiled code has never run (FULL_AND_PIECEWISE's full graphs after mixed
calls only, with `full_graph_compile="whole"`: that compile is made on first use) is first run
once, eagerly, on a batch of padding rows at its smallest key, since a compiled kernel's first
run cannot be a capture; every buffer and every input it writes in place gets its value back (a
transient copy of them, KV caches included). If that run fails, the mode's keys are left to lazy
capture with one WARNING. So one call of any kind is enough before `capture_all`.

    captured = capture_graphs(graph, progress=False)
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch

from cgcompile.calls.cuda_graph_wrapper import CUDAGraphWrapper
from cgcompile.calls.dispatcher import CudagraphDispatcher
from cgcompile.calls.forward_context import set_forward_context
from cgcompile.calls.input_buffers import InputBuffers
from cgcompile.calls.input_plan import InputPlan
from cgcompile.calls.instances import InstanceSlots
from cgcompile.calls.ownership import ThreadOwner
from cgcompile.calls.report import describe_key
from cgcompile.config import CUDAGraphMode
from cgcompile.counters import counters
from cgcompile.errors import CaptureError, CGCompileError


class Capturable(Protocol):
    """What capture needs of a `cgcompile.calls.CompiledGraph`."""

    report_id: int
    owner: ThreadOwner
    instances: InstanceSlots
    dispatcher: CudagraphDispatcher
    wrappers: list[CUDAGraphWrapper]
    input_buffers: InputBuffers
    plan: InputPlan
    runnable: Callable[..., Any]
    shapes_only: Callable[[], contextlib.AbstractContextManager[None]] | None


logger = logging.getLogger(__name__)
_ALONE = contextlib.nullcontext()


def capture_graphs(graph: Capturable, progress: bool) -> int:
    """Capture every listed key for every live instance of `graph`; returns graphs recorded."""
    todo = plan_captures(graph)
    before = counters.num_cudagraph_captured
    failed = []
    with frozen_heap(), torch.no_grad():  # graphs are for inference: no autograd records
        for item in _progress(todo, progress, f"graph {graph.report_id}"):
            if (why := capture_key(graph, *item)) is not None:
                failed.append(why)
    warn_failed(graph.report_id, failed, len(todo))
    captured = counters.num_cudagraph_captured - before
    logger.info("graph %d: captured %d graphs for %d keys", graph.report_id, captured, len(todo))
    return captured


CaptureItem = tuple[int, list[Any], CUDAGraphMode, Any]
"""(module instance slot, an example call's args, runtime mode, batch descriptor)."""


def plan_captures(graph: Capturable) -> list[CaptureItem]:
    """Every (instance, key) of `graph` to capture, after the eager first run of each runtime
    mode that never ran (`_unready_modes`); empty for a graph the calling thread may not own
    or whose instances are gone (said why)."""
    graph_id = graph.report_id
    if not graph.owner.claim():
        logger.warning(
            "graph %d: capture_all skips it: its graphs belong to thread %r, and this is %r",
            graph_id,
            graph.owner.name,
            threading.current_thread().name,
        )
        return []
    instances = graph.instances
    examples = [(slot, args) for slot in instances.live() for args in instances.examples(slot)]
    if not examples and graph.instances.remembered:
        logger.debug("graph %d: capture_all skips it: its module instances were freed", graph_id)
        return []
    if not examples:
        raise CGCompileError(
            f"graph {graph_id}: capture_all needs one call of the compiled model first; it "
            f"reuses that call's parameters and input layout"
        )
    keys = [(m, d) for m, descs in graph.dispatcher.get_capture_descs() for d in descs]
    with torch.no_grad():
        unready = _unready_modes(graph, examples)
    keys = [(m, d) for m, d in keys if m not in unready]
    plan = graph.plan  # state sized by the batch: only its own size can be captured
    return [
        (slot, args, mode, desc)
        for slot, args in examples
        for mode, desc in keys
        if plan.fits_state(args, desc.num_tokens)
    ]


def to_capture(graphs: list[Capturable]) -> list[Capturable]:
    """The graphs that were called, the others skipped with a warning (they capture on first
    use); all of them when none was (each then says it needs a call)."""
    called = [graph for graph in graphs if graph.instances.remembered]
    for graph in graphs if called else ():
        if not graph.instances.remembered:
            logger.warning(
                "graph %d: capture_all skips it: it was never called (its graphs capture on "
                "first use)",
                graph.report_id,
            )
    return called or graphs


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect garbage once (freeing what the graphs' memory could reuse), then freeze the heap
    while graphs are recorded, so collections only look at new objects. A heap already frozen,
    by an enclosing `capture_all` or by the user, is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _unready_modes(graph: Capturable, examples: list[tuple[int, list[Any]]]) -> set[CUDAGraphMode]:
    """Runtime modes with a wrapper whose callable never ran, after one eager run of each on
    padding rows (`_warm_up`); those whose run failed are returned, with one WARNING each."""
    unready: dict[CUDAGraphMode, str] = {}
    for wrapper in graph.wrappers:
        if not wrapper.ran and wrapper.runtime_mode not in unready:
            unready[wrapper.runtime_mode] = wrapper.name
    descs = dict(graph.dispatcher.get_capture_descs())
    failed: set[CUDAGraphMode] = set()
    for mode, name in unready.items():
        slot, example = examples[0]
        fitting = [d for d in descs[mode] if graph.plan.fits_state(example, d.num_tokens)]
        if not fitting:  # no key of this instance's size: nothing to capture ahead
            continue
        try:
            _warm_up(graph, slot, example, mode, fitting[-1])
        except Exception as exc:  # noqa: BLE001 - any failure leaves the mode to lazy capture
            failed.add(mode)
            logger.warning(
                "graph %d: capture_all leaves its %s graphs to lazy capture: %s had not run, "
                "and its first run on padding rows failed (%s: %s); a first call of the model "
                "that uses them captures them",
                graph.report_id,
                mode,
                name,
                type(exc).__name__,
                exc,
            )
    return failed


def _warm_up(
    graph: Capturable, slot: int, example: list[Any], mode: CUDAGraphMode, desc: Any
) -> None:
    """Run `mode`'s compiled code once, eagerly, at `desc`'s size on padding rows; restore
    every buffer and in-place input it may write (a schema need not say so: batch norm)."""
    args = graph.input_buffers.at_size(example, desc.num_tokens)
    written = {*graph.plan.static_tensors, *graph.plan.mutated, *graph.plan.in_place}
    saved = [
        (args[i], args[i].clone())
        for i in sorted(written)
        if isinstance(args[i], torch.Tensor) and not isinstance(args[i], torch.nn.Parameter)
    ]
    logger.info("graph %d: capture_all runs its %s code once first", graph.report_id, mode)
    try:
        with set_forward_context(mode, desc, shape_key=graph.plan.shape_key(args), instance=slot):
            graph.runnable(*args)
    finally:
        for tensor, value in saved:
            tensor.copy_(value)


def capture_key(
    graph: Capturable,
    slot: int,
    example: list[Any],
    mode: CUDAGraphMode,
    desc: Any,
    turn: contextlib.AbstractContextManager[Any] = _ALONE,
) -> str | None:
    """Record the graphs of one key on padding rows (each capture under `turn`); a
    `CaptureError` leaves the key to lazy capture: returned as "key: error" (logged at INFO),
    for `warn_failed`, else None."""
    with turn:  # padding rows go into the static buffers the owner's calls also fill
        args = graph.input_buffers.at_size(example, desc.num_tokens)
    shape_key = graph.plan.shape_key(args)
    pieces = contextlib.nullcontext()
    if mode == CUDAGraphMode.PIECEWISE and graph.shapes_only is not None:
        pieces = graph.shapes_only()
    elif mode == CUDAGraphMode.PIECEWISE and graph.plan.mutated:
        logger.info(
            "graph %d: PIECEWISE key %s left to lazy capture: its splitting ops run inside "
            "Inductor's partitioned code and the graph writes %s",
            graph.report_id,
            describe_key((desc, shape_key, slot)),
            [graph.plan.names[i] for i in graph.plan.mutated],
        )
        return None
    try:
        with set_forward_context(mode, desc, shape_key=shape_key, capture_only=True, instance=slot):
            with pieces:
                graph.runnable(*args)
    except CaptureError as exc:
        why = f"{mode.name} key {describe_key((desc, shape_key, slot))}: {exc}"
        logger.info("graph %d: not captured ahead: %s", graph.report_id, why)
        return why
    return None


def warn_failed(graph_id: int, failed: list[str], total: int) -> None:
    """One WARNING for the keys of a graph that `capture_key` left to lazy capture."""
    if failed:
        logger.warning(
            "graph %d: %d of %d keys not captured ahead, captured on first use instead "
            "(each at INFO); the first: %s",
            graph_id,
            len(failed),
            total,
            failed[0],
        )


def _progress(items: list[Any], enabled: bool, name: str) -> Iterable[Any]:
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=f"cgcompile {name}: capturing CUDA graphs", unit="graph")
