"""`capture_all(background=True)`: record every graph on a thread of its own while calls go on.

Steps:
1. in the calling thread (the one that owns the graphs): plan each graph's keys and run the
   eager first run of any runtime mode that never ran (it writes state, so it cannot overlap
   a call); start the thread `cgcompile-capture` and wait while it creates its CUDA
   libraries' handles (`prepare_thread`: torch keeps them per thread, a capture cannot create
   them, and building them holds the interpreter lock for up to seconds, which would stall the
   first calls); then give each graph and its wrappers a `Turns` lock and return;
2. on the thread, on the caller's CUDA stream: for each key, write its
   padding rows into the static buffers and record its graphs, each under the lock. The owner's
   calls hold the same lock for their whole call, so a call waits for at most the one capture
   under way, and replays every key captured so far. A call whose own key is not captured yet
   replays the smallest captured key that fits it, padded further (`covering_key`: a FULL key
   of its kind, else a PIECEWISE one; keys go largest first, so after the first key nearly
   every call replays); only where none fits, or padding is refused, it runs as it would
   without the thread (warm-up, lazy capture);
3. at the end the graphs lose their lock (calls take the lock-free path again), the handle
   reports graphs captured, keys and seconds, and the thread runs `then` (what
   `live_graphs.after_capture_all` registered); an error of the thread is logged at once and
   raised again by `wait()`, never lost. A key whose capture fails is left to lazy capture,
   with one WARNING, as in `capture_all()`.

    job = cgcompile.capture_all(background=True)   # returns at once
    ...                                            # calls run meanwhile
    graphs = job.wait()
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from cgcompile.calls import bulk_capture
from cgcompile.config import CUDAGraphMode
from cgcompile.counters import counters

logger = logging.getLogger(__name__)


class Turns:
    """A re-entrant lock shared by a graph's calls and its background captures. After each
    capture the thread hands the interpreter over (`time.sleep(0)`), so a waiting call runs
    next instead of after the interpreter's switch interval (5 ms)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.capturer: int | None = None
        """`threading.get_ident()` of the capturing thread."""

    def __enter__(self) -> Turns:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        if threading.get_ident() == self.capturer:
            time.sleep(0)


class BackgroundCapture:
    """A running `capture_all(background=True)`: progress, the time it took, its error."""

    def __init__(self, graphs: list[Any], then: list[Callable[[], None]] | None = None) -> None:
        self.keys_done = 0
        self.graphs_captured = 0
        """Graphs recorded while the thread ran (calls' own lazy captures included)."""
        self.seconds: float | None = None
        """Wall time from the start to the last key; None while running."""
        self.error: BaseException | None = None
        self._plans = [(graph, bulk_capture.plan_captures(graph)) for graph in graphs]
        self.total_keys = sum(len(todo) for _, todo in self._plans)
        """Keys planned over every graph (module instances x keys)."""
        self._turns = Turns()
        self._stream = _current_stream(graphs)
        self._then = then or []
        self._inference = torch.is_inference_mode_enabled()
        """The caller's inference mode, thread-local in torch: the thread runs under it too,
        as the caller's tensors may be inference tensors."""
        self._started = time.perf_counter()
        self._prepared, self._go = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="cgcompile-capture", daemon=True)
        self._thread.start()
        self._prepared.wait()
        if self.error is None:
            for graph, _ in self._plans:
                graph.capture_turns = self._turns
                for wrapper in graph.wrappers:
                    wrapper.turn = self._turns
        self._go.set()

    @property
    def done(self) -> bool:
        """Whether the thread has finished: every key captured, or it failed (`wait` says)."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> int:
        """Block until every key is captured (or `timeout` seconds); return graphs captured.
        Raises the thread's error, if it had one, or `TimeoutError`."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(
                f"background capture still running after {timeout} s: "
                f"{self.keys_done}/{self.total_keys} keys"
            )
        if self.error is not None:
            raise self.error
        return self.graphs_captured

    def _run(self) -> None:
        self._turns.capturer = threading.get_ident()
        grad_off = torch.inference_mode() if self._inference else torch.no_grad()
        with grad_off, _on_stream(self._stream):
            try:
                for runtime in {id(g.runtime): g.runtime for g, _ in self._plans}.values():
                    if runtime is not None:
                        runtime.prepare_thread()
            except BaseException as exc:  # noqa: BLE001 - kept for wait(), and logged now
                self._failed(exc)
            finally:
                self._prepared.set()  # after `error` is set: the caller reads it next
            if self.error is None:
                self._go.wait()
                self._capture_keys()
        self.seconds = time.perf_counter() - self._started
        logger.info(
            "background capture: %d graphs for %d/%d keys in %.2f s",
            self.graphs_captured,
            self.keys_done,
            self.total_keys,
            self.seconds,
        )
        if self.error is None:
            for callback in self._then:
                callback()

    def _capture_keys(self) -> None:
        """Every planned key, each under the turns; then the graphs lose their lock."""
        before = counters.num_cudagraph_captured
        try:
            for graph, todo in self._plans:
                failed = []
                for item in todo:
                    if why := bulk_capture.capture_key(graph, *item, turn=self._turns):
                        failed.append(why)
                    self.keys_done += 1
                bulk_capture.warn_failed(graph.report_id, failed, len(todo))
        except BaseException as exc:  # noqa: BLE001 - kept for wait(), and logged now
            self._failed(exc)
        finally:
            with self._turns:
                for graph, _ in self._plans:
                    graph.capture_turns = None
                    for wrapper in graph.wrappers:
                        wrapper.turn = contextlib.nullcontext()  # reusable: no state
                self.graphs_captured = counters.num_cudagraph_captured - before

    def _failed(self, exc: BaseException) -> None:
        self.error = exc
        logger.error("background capture failed after %d keys: %r", self.keys_done, exc)

    def __repr__(self) -> str:
        state = "running" if not self.done else f"done in {self.seconds:.2f} s"
        return (
            f"BackgroundCapture({state}, {self.keys_done}/{self.total_keys} keys, "
            f"{self.graphs_captured} graphs)"
        )


def covering_key(
    graph: Any, args: Any, slot: int, mode: CUDAGraphMode, desc: Any, kind: tuple[bool, bool]
) -> tuple[CUDAGraphMode, Any] | None:
    """While the thread captures `graph`'s keys: the (mode, key) captured so far that serves
    a call dispatched to (`mode`, `desc`) whose graphs are not captured yet: the smallest of
    `mode` (same kind of batch) at `desc`'s size or above, else the smallest PIECEWISE one;
    None when `desc` itself is captured or nothing fits. The caller holds the turns."""
    if _captured(graph, args, slot, mode, desc):
        return None
    plan = graph.plan  # state sized by the batch (a cache per size): only its own size fits
    sizes = [
        m
        for m in graph.dispatcher.capture_sizes
        if m >= desc.num_tokens and plan.fits_state(args, m)
    ]
    tries = [(mode, kind)]
    if mode is not CUDAGraphMode.PIECEWISE:
        tries.append((CUDAGraphMode.PIECEWISE, (False, kind[1])))  # a mixed batch's key
    for wanted, wanted_kind in tries:
        for size in sizes:
            found = graph.dispatcher.dispatch(size, *wanted_kind)
            if found[0] is wanted and found[1] != desc and _captured(graph, args, slot, *found):
                return found
    return None


def _captured(graph: Any, args: Any, slot: int, mode: CUDAGraphMode, desc: Any) -> bool:
    """Whether every wrapper of `mode` holds a graph of this key (instance `slot`, the call's
    other sizes) for a call padded to `desc`."""
    sized = list(args)
    for i in graph.plan.size_indices:
        sized[i] = desc.num_tokens
    key = (desc, graph.plan.shape_key(sized), slot)
    wrappers = [w for w in graph.wrappers if w.runtime_mode is mode]
    return bool(wrappers) and all(key in w.entries for w in wrappers)


def _current_stream(graphs: list[Any]) -> Any:
    """The caller's current CUDA stream where a graph captures CUDA graphs, else None: the
    thread issues its work there, ordered with the caller's calls."""
    devices = {getattr(g.runtime, "device", None) for g in graphs} - {None}
    if not devices:
        return None
    return torch.cuda.current_stream(next(iter(devices)))


@contextlib.contextmanager
def _on_stream(stream: Any) -> Iterator[None]:
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield
