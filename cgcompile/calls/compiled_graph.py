"""The callable the backend hands to Dynamo: dispatch, pad, run the graphs, unpad.

Per call (automatic mode, the default):
1. a call from a thread that does not own the graphs runs the traced graph eagerly
   (`ownership`); one from a module instance beyond the limit, or whose in-place inputs moved,
   runs without graphs (`instances`);
2. read the batch size n from the user's batch tensors and the hints of `batch_hint(...)`;
3. ask the dispatcher for (runtime mode, descriptor), padding n to a capture size (beside a
   background `capture_all`, to a captured one: `background.covering_key`); a graph that
   padding could change (`plan.pad_unsafe`) runs sizes it would pad without graphs;
4. copy user tensors into input buffers (`InputBuffers`: padded rows hold pad values;
   parameters, buffers and tensors the graph writes in place are never copied);
5. run the FULL wrapper (which holds the PIECEWISE-wrapped pieces) under that forward context,
   whose key names the module instance, so each instance replays graphs of its own;
6. copy the real rows of mutated batch tensors back to the caller's; hand out the outputs
   (`outputs`: batch outputs sliced to n; a held output is moved before the next replay, a
   held view or detached alias pins graph memory: calls run without graphs until dropped).
A call of a captured key whose instance is known and whose last outputs are free is the steady
state (`steady_state`): it runs the key's prebuilt `ReadyCall`, skipping 3 and the wrappers.
Batches no graph fits run eagerly, unpadded, on the caller's tensors (`fallbacks` says why,
once per kind). If the caller already set a forward context (manual, vLLM-style), it is
honoured: no dispatch, padding or copies; the module instance is checked by the identity of
its parameters, and the wrappers check the other inputs' addresses on every replay. Every
call runs the model's work once, as one eager call would (the wrappers' warm-up calls return
their own results), so state written inside the graph (KV caches, counters) advances exactly
once per call.

`capture_all` records graphs without running the model (`bulk_capture`; every live graph's:
`live_graphs`). Parameters are held weakly: a deleted model's instance and its graphs are
dropped (`instances`). A graph whose batch admits one row and that squeezes it raises at one
row (`passes.one_row`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from cgcompile.calls import bulk_capture
from cgcompile.calls.background import Turns, covering_key
from cgcompile.calls.cuda_graph_wrapper import CUDAGraphWrapper
from cgcompile.calls.dispatcher import CudagraphDispatcher
from cgcompile.calls.fallbacks import FallbackLog
from cgcompile.calls.forward_context import (
    FORWARD_CONTEXT,
    ForwardContext,
    current_batch_hint,
    set_forward_context,
)
from cgcompile.calls.input_buffers import InputBuffers
from cgcompile.calls.input_plan import InputPlan
from cgcompile.calls.instances import InstanceSlots, weak_method
from cgcompile.calls.outputs import Outputs
from cgcompile.calls.ownership import ThreadOwner
from cgcompile.calls.ready import ReadyCall, ready_call
from cgcompile.calls.report import GraphReport, live_report
from cgcompile.calls.steady_state import MISS, RETURNED, SteadyState
from cgcompile.calls.variants import SizeVariants
from cgcompile.config import CUDAGraphMode
from cgcompile.counters import counters
from cgcompile.errors import CGCompileError
from cgcompile.graphs import GraphRuntime

logger = logging.getLogger(__name__)
NONE = CUDAGraphMode.NONE


class CompiledGraph(SteadyState):
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
        traced: Callable[..., Any] | None = None,
    ) -> None:
        self.runnable = runnable
        self.dispatcher = dispatcher
        self.plan = plan
        self.analyses: Any = None
        """What the backend's fake runs found (`backend.analyses.Analyses`), kept for saving."""
        self._report = report
        self.wrappers = wrappers
        self.runtime = runtime
        self.shapes_only = shapes_only
        """Context in which the eager splitting ops compute shapes only (capture_all); None:
        they run for real (inside Inductor's partitioned code)."""
        self.traced = traced or runnable
        """The traced graph run eagerly: what calls from threads not owning the graphs run."""
        self.input_buffers = InputBuffers(plan, dispatcher.max_capture_size)
        self.uses_graphs = dispatcher.cudagraph_mode != NONE
        self.owner = ThreadOwner()
        self.instances = InstanceSlots(
            plan.static_tensors,
            plan.kept_in_place,
            weak_method(self._drop_instance),
            weak_method(self._borrow),
            plan.batch_state,
        )
        self._fallbacks = FallbackLog(report.graph_id, plan, dispatcher, self.owner)
        self._variants = SizeVariants(
            [i for i in plan.int_args if i not in plan.size_indices],
            plan.host_scalars,
            plan.batch_state,
        )
        self._outputs: dict[int, Outputs] = {}
        """Per module instance (slot): its graphs have a memory pool of their own."""
        variants = self._variants
        self._sized = bool(variants.positions or variants.host or variants.state)
        """Whether non-batch ints, host scalars or state addresses are part of the key."""
        self._kind_by_shape = (plan.decode_by_shape, False)
        """`_batch_kind` without a hint."""
        self._ready: dict[tuple[Any, ...], ReadyCall] = {}
        """(slot, n, batch kind, sizes) -> the prebuilt steady state of a verified key."""
        self.capture_turns: Turns | None = None
        """While a background `capture_all` records this graph's keys: the lock its captures
        and this graph's calls take turns on (`background`); calls then skip `steady`."""

    @property
    def report_id(self) -> int:
        """The graph's number in logs and reports."""
        return self._report.graph_id

    def __call__(self, *args: Any) -> Any:
        out = self.steady(args)
        if out is MISS:
            turns = self.capture_turns
            if turns is None:
                out = self._call(args)
            else:
                with turns:  # beside a background capture_all: one of its captures at a time
                    out = self._call(args)
        returned = RETURNED.get()
        if returned is not None:  # `trusted` watches this model call (`calls.trusted`)
            returned.append((self, out))
        return out

    def _call(self, args: tuple[Any, ...]) -> Any:
        """Every call but the steady state: the checks that may run it without graphs, then
        `_first_calls`, or the steady state after an instance's full check."""
        if self.plan.one_row is not None and self.plan.batch_size(args) == 1:
            raise CGCompileError(
                f"graph {self.report_id} cannot run a batch of one row as eager would: "
                f"{self.plan.one_row}. Mark the batch backed (mark_dynamic_batch without "
                f"unbacked=True, torch's backed_size_oblivious off: Dynamo traces batch 1 "
                f"apart), or squeeze a dim that is not the batch (x.squeeze(-1))"
            )
        if not self.uses_graphs:
            return self.runnable(*args)
        if self.owner.ident != threading.get_ident() and not self.owner.claim():
            return self._run_eager(args, None, "thread", self.traced)
        ctx = FORWARD_CONTEXT.get()
        if ctx is not None:
            return self._run_manual(ctx, args)
        slot = self.instances.slot_of(args)
        if slot is None:
            return self._run_eager(args, None, "instances")
        if self.instances.has_in_place and not self.instances.same_in_place(slot, args):
            return self._run_eager(args, None, "moved")
        n = self.plan.batch_size(args)
        if n is None:
            return self._run_eager(args, None, "shape")
        kind = self._batch_kind(n)
        key = (slot, n, kind, self._variants.key(args) if self._sized else ())
        ready = self._ready.get(key)
        if ready is not None and (not ready.outputs.still_held() or ready.outputs.release()):
            return ready(args)  # the steady state, after a full check of the instance
        return self._first_calls(args, slot, n, kind, key)

    def _first_calls(
        self, args: tuple[Any, ...], slot: int, n: int, kind: Any, key: tuple[Any, ...]
    ) -> Any:
        """Every call but the steady state: dispatch, the checks that may run it without
        graphs, the wrappers (warm-up, capture, first replay), then a `ReadyCall` if the key's
        graphs are all verified."""
        self.instances.remember(slot, args, with_graphs=False)
        mode, desc = self._dispatch(n, kind)
        cover = None
        turns, unsafe = self.capture_turns, self.plan.pad_unsafe
        if turns is not None and mode != NONE and kind is not None and unsafe is None:
            cover = covering_key(self, args, slot, mode, desc, kind)  # beside capture_all
            if cover is not None:
                mode, desc = cover
        if mode == NONE:
            return self._run_eager(args, n)
        if not self._variants.admits(key[3]):
            return self._run_eager(args, n, "variants")
        if desc.num_tokens != n and self.plan.pad_unsafe is not None:
            return self._run_eager(args, n, "unpadded")
        outputs = self._outputs.get(slot)
        if outputs is None:
            outputs = self._outputs[slot] = Outputs(self.plan)
        if outputs.still_held() and not outputs.release():
            outputs.start_copying()
            return self._run_eager(args, n, "held")
        padded = desc.num_tokens
        static_args = self.input_buffers.fill(args, n, padded)
        self.instances.remember(slot, static_args, with_graphs=True)
        shape_key = self.plan.shape_key(static_args)
        with set_forward_context(mode, desc, shape_key=shape_key, instance=slot) as ctx:
            out = self.runnable(*static_args)
        if self.plan.copied_back:
            self.input_buffers.copy_back(args, static_args, n, padded)
        if kind is not None and cover is None:  # a covered call pads more than its own key
            ready = ready_call(
                self.wrappers,
                self.runnable,
                self.plan,
                self.input_buffers,
                ctx,
                static_args,
                n,
                outputs,
            )
            if ready is not None:
                self._ready[key] = ready
        # a warm-up's outputs (no graph has the key yet) are eager memory: they pin nothing
        graphed = ctx.graph_key is None or any(ctx.graph_key in w.entries for w in self.wrappers)
        return outputs.hand_out(out, n, padded, graphed=graphed, kept_by_graph=False)

    @property
    def copies_outputs(self) -> bool:
        """Whether some instance's outputs are copied out of graph memory (a caller held them
        across calls)."""
        return any(outputs.copies for outputs in self._outputs.values())

    def _run_manual(self, ctx: ForwardContext, args: tuple[Any, ...]) -> Any:
        """The caller set the context: no dispatch, padding or copies. Parameters are checked
        by identity (each module instance replays graphs of its own); the wrappers check the
        other inputs' addresses on every replay."""
        slot = self.instances.slot_of(args)
        if slot == ctx.instance:
            return self.runnable(*args)
        if slot is None:
            return self._run_eager(args, None, "instances", self.traced)
        with set_forward_context(
            ctx.cudagraph_runtime_mode, ctx.batch_descriptor, shape_key=ctx.shape_key, instance=slot
        ):
            return self.runnable(*args)

    def capture_all(self, progress: bool = True) -> int:
        """Capture every graph the dispatcher lists now, instead of on first use, for every
        live module instance (see `bulk_capture`); runs nothing, so no tensor changes. Needs
        one call with graphs first (its parameters, layout and warmed-up kernels) and the
        thread that owns the graphs. Returns graphs captured."""
        if self.capture_turns is not None:
            logger.warning(
                "graph %d: capture_all skips it: a background capture_all is recording its "
                "graphs; wait() for that one",
                self.report_id,
            )
            return 0
        return bulk_capture.capture_graphs(self, progress) if self.uses_graphs else 0

    def _dispatch(self, n: int, kind: tuple[bool, bool] | None) -> tuple[CUDAGraphMode, Any]:
        if kind is not None:
            return self.dispatcher.dispatch(n, *kind)
        hint = current_batch_hint()  # invalid modes: no memo
        uniform = hint.uniform_decode
        if uniform is None and hint.num_reqs is not None:
            uniform = n == hint.num_reqs * self.dispatcher.uniform_decode_query_len
        return self.dispatcher.dispatch(
            n, bool(uniform), hint.has_lora, invalid_modes=hint.invalid_modes
        )

    def _run_eager(
        self,
        args: tuple[Any, ...],
        n: int | None,
        kind: str | None = None,
        runnable: Callable[..., Any] | None = None,
    ) -> Any:
        counters.num_eager_fallbacks += 1
        self._report.num_eager_fallbacks += 1
        self._fallbacks.warn(kind, n)
        if runnable is None:  # code compiled for >= min_batch rows never runs fewer
            size = self.plan.batch_size(args) if n is None else n
            small = size is not None and size < self.plan.min_batch
            runnable = self.traced if small else self.runnable
        return runnable(*args)

    def _drop_instance(self, slot: int) -> None:
        """A module instance was freed: its graphs go too (their pool blocks are reused)."""
        self._outputs.pop(slot, None)
        self._ready = {key: call for key, call in self._ready.items() if key[0] != slot}
        for wrapper in self.wrappers:
            wrapper.drop_instance(slot)
        logger.debug("graph %d: module instance %d freed, its graphs dropped", self.report_id, slot)

    def _borrow(self, tensors: Any) -> None:
        if self.runtime is not None:
            self.runtime.borrow(tensors)

    @property
    def report(self) -> GraphReport:
        """The compile-time report with live capture figures filled in."""
        return live_report(self._report, self.wrappers, self.runtime, self.input_buffers)

    def format_report(self) -> str:
        """`report` as text: pieces, mode and why, captured keys, times, memory, fallbacks."""
        return self.report.format()
