"""The callable the backend hands to Dynamo: dispatch, pad, run the graphs, unpad.

Per call (automatic mode, the default):
1. read the batch size n from the user's batch tensors and the hints of `batch_hint(...)`;
2. ask the dispatcher for (runtime mode, descriptor), padding n to a capture size;
3. copy user tensors into static buffers (`StaticInputs`: padded rows hold pad values;
   parameters, buffers and tensors the graph writes in place are never copied);
4. run the FULL wrapper (which holds the PIECEWISE-wrapped pieces) under that forward context;
5. copy the real rows of mutated batch tensors back to the caller's; slice batch outputs to n.
Batches no graph fits run eagerly, unpadded, on the caller's tensors. If the caller already set
a forward context (manual, vLLM-style), it is honoured as is: no dispatch, padding or copies.
Every call runs the model's work once, as one eager call would (the wrappers' warm-up calls
return their own results), so state written inside the graph (KV caches, counters) advances
exactly once per call.

`capture_all` records graphs without running the model: FULL graphs are recorded whole, and
PIECEWISE pieces are recorded one after the other with each eager splitting op replaced by a
shape-only stand-in (`dry_run.shapes_only`), so no user-visible tensor changes.

Outputs of a graph replay live in graph memory and are overwritten by the next call; clone
what you keep.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import operator
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from cgcompile.backend.inputs import InputPlan
from cgcompile.backend.report import GraphReport
from cgcompile.backend.static_inputs import StaticInputs
from cgcompile.config import CUDAGraphMode
from cgcompile.counters import counters
from cgcompile.dispatcher import CudagraphDispatcher
from cgcompile.errors import CaptureError, CGCompileError
from cgcompile.forward_context import (
    current_batch_hint,
    is_forward_context_available,
    set_forward_context,
)
from cgcompile.wrappers import CUDAGraphWrapper, GraphRuntime

logger = logging.getLogger(__name__)
NONE, PIECEWISE = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE

_live_graphs: weakref.WeakSet[CompiledGraph] = weakref.WeakSet()


def compiled_graphs() -> list[CompiledGraph]:
    """Every live graph compiled by the backend, oldest first, for inspection and reports."""
    return sorted(_live_graphs, key=lambda g: g._report.graph_id)


class CompiledGraph:
    """Runs one Dynamo graph with the CUDA-graph mode it resolved to."""

    def __init__(
        self,
        runnable: Callable[..., Any],
        dispatcher: CudagraphDispatcher,
        plan: InputPlan,
        report: GraphReport,
        wrappers: list[CUDAGraphWrapper],
        runtime: GraphRuntime | None,
        shapes_only: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
    ) -> None:
        self.runnable = runnable
        self.dispatcher = dispatcher
        self.plan = plan
        self._report = report
        self.wrappers = wrappers
        self.runtime = runtime
        self._shapes_only = shapes_only
        """Context in which the eager splitting ops compute shapes only (capture_all); None:
        they run for real (inside Inductor's partitioned code)."""
        self.static_inputs = StaticInputs(plan, dispatcher.max_capture_size)
        self._warn_padding = bool(plan.state_names()) and not plan.pad_values
        self._in_place_ptrs: tuple[tuple[int, int], ...] | None = None
        self.uses_graphs = dispatcher.cudagraph_mode != NONE
        self._warned: set[str] = set()
        self._first_statics: tuple[Any, ...] | None = None
        self._example: tuple[Any, ...] | None = None
        """The first automatic call's arguments: the layout `capture_all` runs with."""
        static = plan.static_tensors
        self._get_statics = operator.itemgetter(*static, *static[:1]) if static else None
        _live_graphs.add(self)

    def __call__(self, *args: Any) -> Any:
        if is_forward_context_available() or not self.uses_graphs:
            return self.runnable(*args)
        if not self._same_statics(args):
            return self._run_eager(args, None, "shared")
        if self.plan.in_place and not self._same_in_place(args):
            return self._run_eager(args, None, "moved")
        if self._example is None:
            self._example = args
        n = self.plan.batch_size(args)
        mode, desc = self._dispatch(n)
        if mode == NONE:
            return self._run_eager(args, n)
        padded = desc.num_tokens
        if padded != n and self._warn_padding:
            self._warn_once(n, "padding")
        static_args = self.static_inputs.fill(args, n, padded)
        shape_key = tuple([static_args[i] for i in self.plan.int_args])
        with set_forward_context(mode, desc, shape_key=shape_key):
            out = self.runnable(*static_args)
        if self.plan.copied_back:
            self.static_inputs.copy_back(args, static_args, n)
        if padded != n and self.plan.batch_outputs:
            out = list(out)
            for i in self.plan.batch_outputs:
                out[i] = out[i][:n]
        return out

    def capture_all(self, progress: bool = True) -> int:
        """Capture every graph the dispatcher lists now, instead of on first use.

        Runs nothing: graphs are recorded on batches made of padding rows, the eager ops
        between PIECEWISE pieces are replaced by shape-only stand-ins, so parameters, buffers
        and inputs keep their values. A key whose capture fails is left to lazy capture (which
        warms up first). PIECEWISE keys first, then FULL, each largest first so smaller graphs
        reuse the pool blocks of larger ones; the garbage collector is frozen meanwhile. Needs
        one call of the compiled model first (its parameters, layout and warmed-up kernels).
        Returns graphs captured.
        """
        if not self.uses_graphs:
            return 0
        if self._example is None:
            raise CGCompileError(
                f"graph {self._report.graph_id}: capture_all needs one call of the compiled "
                f"model first; it reuses that call's parameters and input layout"
            )
        todo = [(m, d) for m, descs in self.dispatcher.get_capture_descs() for d in descs]
        before = counters.num_cudagraph_captured
        gc.collect()
        gc.freeze()
        try:
            for mode, desc in _progress(todo, progress, f"graph {self._report.graph_id}"):
                self._capture_key(mode, desc)
        finally:
            gc.unfreeze()
        captured = counters.num_cudagraph_captured - before
        logger.info(
            "graph %d: captured %d graphs for %d keys", self._report.graph_id, captured, len(todo)
        )
        return captured

    def _capture_key(self, mode: CUDAGraphMode, desc: Any) -> None:
        args = self.static_inputs.at_size(self._example, desc.num_tokens)
        shape_key = tuple([args[i] for i in self.plan.int_args])
        stand_ins = contextlib.nullcontext()
        if mode == PIECEWISE and self._shapes_only is not None:
            stand_ins = self._shapes_only()
        elif mode == PIECEWISE and self.plan.mutated:
            logger.info(
                "graph %d: PIECEWISE key %s left to lazy capture: its splitting ops run inside "
                "Inductor's partitioned code and the graph writes %s",
                self._report.graph_id,
                _describe_key((desc, shape_key)),
                [self.plan.names[i] for i in self.plan.mutated],
            )
            return
        try:
            with set_forward_context(mode, desc, shape_key=shape_key, capture_only=True):
                with stand_ins:
                    self.runnable(*args)
        except CaptureError as exc:
            logger.warning(
                "graph %d: %s key %s not captured ahead (%s); it is captured on first use",
                self._report.graph_id,
                mode,
                _describe_key((desc, shape_key)),
                exc,
            )

    def _dispatch(self, n: int | None) -> tuple[CUDAGraphMode, Any]:
        if n is None:
            return NONE, None
        hint = current_batch_hint()
        if hint is None:
            return self.dispatcher.dispatch(n)
        uniform = hint.uniform_decode
        if uniform is None and hint.num_reqs is not None:
            uniform = n == hint.num_reqs * self.dispatcher.uniform_decode_query_len
        return self.dispatcher.dispatch(
            n, bool(uniform), hint.has_lora, invalid_modes=hint.invalid_modes
        )

    def _same_statics(self, args: tuple[Any, ...]) -> bool:
        """Whether the parameters and buffers are the objects of the first call.

        One compiled graph can serve several module instances (identical layers compiled as
        separate frames after a graph break). Graphs bake in parameter addresses and share one
        pool, so only the first instance's calls may use them.
        """
        if self._get_statics is None:
            return True
        current = self._get_statics(args)  # a tuple even for one index: that one is repeated
        if self._first_statics is None:
            self._first_statics = current
            return True
        return all(map(operator.is_, current, self._first_statics))

    def _same_in_place(self, args: tuple[Any, ...]) -> bool:
        """Whether the inputs the graph writes in place are at their first call's addresses:
        graphs read and write them there."""
        ptrs = tuple((i, args[i].data_ptr()) for i in self.plan.in_place)
        if self._in_place_ptrs is None:
            self._in_place_ptrs = ptrs
        return ptrs == self._in_place_ptrs

    def _run_eager(self, args: tuple[Any, ...], n: int | None, kind: str | None = None) -> Any:
        counters.num_eager_fallbacks += 1
        self._report.num_eager_fallbacks += 1
        self._warn_once(n, kind)
        return self.runnable(*args)

    def _warn_once(self, n: int | None, kind: str | None = None) -> None:
        """One warning per kind of miss, so missing sizes are never silent nor noisy."""
        kind, why = self._why(n, kind)
        if kind in self._warned:
            return
        self._warned.add(kind)
        if kind == "padding":
            logger.warning("graph %d pads a batch: %s", self._report.graph_id, why)
            return
        logger.warning(
            "graph %d runs a batch without CUDA graphs (%s); counted in num_eager_fallbacks, "
            "warned once",
            self._report.graph_id,
            why,
        )

    def _why(self, n: int | None, kind: str | None) -> tuple[str, str]:
        plan = self.plan
        if kind == "shared":
            return kind, (
                "it is called with other parameters than its first call: the same code is "
                "shared by several module instances, e.g. identical layers compiled as separate "
                "frames after a graph break; compile with fullgraph=True to find the break"
            )
        if kind == "moved":
            names = [plan.names[i] for i in plan.in_place]
            return kind, (
                f"it writes {names} in place and one of them is not the tensor of the first "
                f"call; graphs read and write those tensors where they were, so keep them at "
                f"fixed addresses (e.g. allocate a cache once)"
            )
        if kind == "padding":
            batch = [plan.names[i] for i in plan.batch_tensors]
            return kind, (
                f"{n} rows padded with zeros; the graph writes {plan.state_names()} in place "
                f"and padded rows may write there where an eager call would not. Declare what "
                f"padded rows hold with cgcompile.mark_dynamic_batch(t, pad_value=...) for the "
                f"batch input that says where rows write ({batch}), e.g. a reserved trash slot"
            )
        if n is None:
            return "shape", "the batch tensors disagree on dim 0, or there are none"
        if n > self.dispatcher.max_capture_size:
            return "large", (
                f"{n} tokens exceed the largest capture size {self.dispatcher.max_capture_size}"
            )
        return "key", f"no graph serves {n} tokens with the current batch_hint"

    @property
    def report(self) -> GraphReport:
        """The compile-time report with live capture figures filled in."""
        captured: dict[str, set[Any]] = {}
        for wrapper in self.wrappers:
            captured.setdefault(str(wrapper.runtime_mode), set()).update(wrapper.captured_keys())
        self._report.captured = {
            mode: [_describe_key(k) for k in sorted(keys, key=lambda k: (k[0].num_tokens, k[1]))]
            for mode, keys in captured.items()
        }
        self._report.capture_seconds = sum(w.capture_seconds for w in self.wrappers)
        self._report.graph_memory_bytes = self.runtime.memory_bytes() if self.runtime else 0
        self._report.static_input_bytes = self.static_inputs.nbytes()
        return self._report

    def format_report(self) -> str:
        """`report` as text: pieces, mode and why, captured keys, times, memory, fallbacks."""
        return self.report.format()


def capture_all(progress: bool = True) -> int:
    """Capture now every graph that every live compiled graph's dispatcher lists.

    Each compiled graph must have been called once (it reuses that call's parameters and
    input layout), else `CGCompileError`. Returns how many CUDA graphs this call recorded: one
    per piece for each PIECEWISE key plus one per FULL key; keys captured before are replayed
    and not counted, so a second call returns 0. `progress`: a tqdm bar if tqdm is installed.
    """
    return sum(graph.capture_all(progress) for graph in compiled_graphs())


def _progress(items: list[Any], enabled: bool, name: str) -> Iterable[Any]:
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=f"cgcompile {name}: capturing CUDA graphs", unit="graph")


def _describe_key(key: Any) -> str:
    desc, sizes = key
    text = f"{desc.num_tokens}"
    if desc.uniform:
        text += f"u{desc.num_reqs}"
    return text + (f"{list(sizes)}" if len(sizes) > 1 else "")
