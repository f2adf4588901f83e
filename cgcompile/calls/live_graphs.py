"""Every live compiled graph of the process, and `capture_all` over them.

The backend registers each `CompiledGraph` it builds (`backend.pipeline`), held weakly: a graph
goes with its compiled model. `compiled_graphs()` lists them for inspection and reports;
`capture_all()` captures every graph their dispatchers list, in the foreground or on a
background thread (`background`), then runs once what `after_capture_all` registered (the
precompiled file takes its kernels' tuning, `restart.saved_file.add_tuning`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Literal, overload

from cgcompile.calls import bulk_capture
from cgcompile.calls.background import BackgroundCapture
from cgcompile.calls.compiled_graph import CompiledGraph
from cgcompile.errors import CGCompileError

_live: weakref.WeakSet[CompiledGraph] = weakref.WeakSet()
_after_capture: list[Callable[[], None]] = []


def register(graph: CompiledGraph) -> None:
    """Count `graph` among the live ones until it is freed."""
    _live.add(graph)


def forget_all() -> None:
    """Forget every graph (tests: graphs of earlier tests live until the collector frees their
    cycles) and every callback `after_capture_all` holds."""
    _live.clear()
    _after_capture.clear()


def after_capture_all(callback: Callable[[], None]) -> None:
    """Run `callback` once, when the next `capture_all` has captured every key (in the
    background: on its thread, after the last key; not if it failed)."""
    _after_capture.append(callback)


def _take_callbacks() -> list[Callable[[], None]]:
    taken = list(_after_capture)
    _after_capture.clear()
    return taken


def compiled_graphs() -> list[CompiledGraph]:
    """Every live graph compiled by the backend, for inspection and reports: graphs with a
    dynamic batch first, then those specialised to one batch size (Dynamo traces batch 1
    apart), each oldest first, so `[0]` is a model's main graph whatever its first call."""
    return sorted(_live, key=lambda g: (g.plan.static_batch is not None, g.report_id))


@overload
def capture_all(progress: bool = ..., background: Literal[False] = ...) -> int: ...
@overload
def capture_all(progress: bool = ..., *, background: Literal[True]) -> BackgroundCapture: ...


def capture_all(progress: bool = True, background: bool = False) -> int | BackgroundCapture:
    """Capture now every graph that every live compiled graph's dispatcher lists.

    A compiled graph must have been called once at a size with graphs (it reuses that call's
    parameters and input layout); graphs never called are skipped with a warning (they capture
    on first use) when some other graph was called, else `CGCompileError`. Graphs owned by
    another live thread are skipped with a warning. Returns how many CUDA graphs this call
    recorded: one per piece for each PIECEWISE key plus one per FULL key, for each live module
    instance; keys captured before are not counted, so a second call returns 0. `progress`: a
    tqdm bar.

    `background=True`: returns a `BackgroundCapture` once its thread is set up and records the
    graphs on that thread while this thread's calls go on (`calls.background`): each call
    replays what is captured so far and waits for at most one capture; `.wait()` returns the
    graphs recorded meanwhile.
    """
    graphs = bulk_capture.to_capture([g for g in compiled_graphs() if g.uses_graphs])
    if background:
        busy = [g for g in graphs if g.capture_turns is not None]
        if busy:
            raise CGCompileError(
                f"graph {busy[0].report_id} is being captured in the background already; "
                f"wait() for that capture_all first"
            )
        return BackgroundCapture(graphs, then=_take_callbacks())
    with bulk_capture.frozen_heap():  # one collection for every graph
        captured = sum(graph.capture_all(progress) for graph in graphs)
    for callback in _take_callbacks():
        callback()
    return captured
