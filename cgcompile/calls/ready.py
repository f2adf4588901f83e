"""A call whose graphs are all captured and verified, prebuilt: what it copies, what it replays.

Once a key's graphs were captured and replayed once (their input addresses verified), the
compiled graph keeps a `ReadyCall` for it: the static views the caller's tensors go into, the
FULL graph itself (or, for PIECEWISE, the split graph with its forward context built), and
the module instance's `Outputs`. A later call of the key then does, top to bottom:

1. one fused copy of the caller's batch and copied tensors into the static views
   (`torch._foreach_copy_`); pad rows are written only where an earlier call left data
   (`input_buffers.Rows`), so a decode loop at one size pads nothing;
2. FULL: replay the captured graph (no wrapper, no forward context); PIECEWISE: run the split
   graph under the prebuilt forward context, each piece wrapper replaying its graph;
3. copy back the real rows of batch inputs the graph writes, hand out the outputs.

Nothing here grows with the model's parameters but PIECEWISE's argument list (the split graph
takes every input, as Dynamo passes them). The usual full graph (`inline`: no stride-0 input,
nothing copied back, outputs prebuilt) is run by `CompiledGraph.steady` itself, steps 1-3
inlined in its one frame; this object's call serves the rest.

    call = ready_call(wrappers, split_graph, plan, input_buffers, ctx, static_args, n, outputs)
    out = call(args)
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cgcompile.calls.cuda_graph_wrapper import CUDAGraphWrapper
from cgcompile.calls.forward_context import FORWARD_CONTEXT, ForwardContext
from cgcompile.calls.input_buffers import InputBuffers, copy_into
from cgcompile.calls.input_plan import InputPlan
from cgcompile.calls.outputs import Handed, Outputs, row_view
from cgcompile.config import CUDAGraphMode
from cgcompile.graphs import CapturedGraph


def ready_call(
    wrappers: Sequence[CUDAGraphWrapper],
    runnable: Callable[..., Any],
    plan: InputPlan,
    input_buffers: InputBuffers,
    ctx: ForwardContext,
    static_args: Sequence[Any],
    n: int,
    outputs: Outputs,
) -> ReadyCall | None:
    """The steady state of the key `ctx` names once every graph it replays is verified (else
    None); `runnable` is the split graph PIECEWISE runs, `static_args` the call's arguments."""
    mode = ctx.cudagraph_runtime_mode
    entries = [w.entries.get(ctx.graph_key) for w in wrappers if w.runtime_mode is mode]
    if not entries or any(e is None or not e.verified for e in entries):
        return None
    common = (static_args, n, ctx.batch_descriptor.num_tokens, plan, input_buffers, outputs)
    if mode is CUDAGraphMode.FULL:
        (entry,) = entries
        return ReadyCall(*common, graph=entry.graph)
    return ReadyCall(*common, piecewise=(runnable, ctx))


class ReadyCall:
    """The prebuilt steady state of one graph key (FULL or PIECEWISE)."""

    def __init__(
        self,
        static_args: Sequence[Any],
        n: int,
        padded: int,
        plan: InputPlan,
        input_buffers: InputBuffers,
        outputs: Outputs,
        graph: CapturedGraph | None = None,
        piecewise: tuple[Callable[..., Any], ForwardContext] | None = None,
    ) -> None:
        self.n = n
        self.padded = padded
        self.outputs = outputs
        self.graph = graph
        """FULL: the graph to replay; None for PIECEWISE."""
        self.piecewise = piecewise
        """PIECEWISE: (the split graph, the forward context its wrappers read)."""
        self.input_buffers = input_buffers
        self.copied_back = plan.copied_back
        self.sources: list[int] = []
        self.targets: list[torch.Tensor] = []
        self.expanded: list[tuple[int, torch.Tensor]] = []
        """Copied one by one (`copy_into`): a stride-0 target is written once per dim."""
        self.rows: list[tuple[Any, torch.Tensor]] = []
        """(`Rows` or None, padded view) per batch tensor: where pad rows may need writing."""
        for i in plan.batch_tensors:
            view = static_args[i]
            rows = input_buffers.batch_view(i, view, padded)[1]
            self._target(i, view[:n] if padded != n else view)
            self.rows.append((rows, view, i))
        for i in plan.copied_tensors:
            self._target(i, static_args[i])
        self.gather = _gatherer(self.sources)
        self.replaced = {i: static_args[i] for i in (*plan.batch_tensors, *plan.copied_tensors)}
        self.rows_out: dict[int, torch.Tensor] | None = None
        """FULL, padded: views of the real rows of each handed batch output, built once."""
        self.prebuilt: tuple[Handed, ...] | None = None
        """FULL: what `Outputs.hand_out_prebuilt` hands out; None where `hand_out` runs."""
        self.launch = None if graph is None else graph.launch
        """FULL: the graph's launch (`CapturedGraph.launch`: no Python frame where it can)."""
        if graph is not None:
            if padded != n:
                handed = set(plan.handed_outputs) & set(plan.batch_outputs)
                self.rows_out = {i: row_view(graph.output[i], n) for i in sorted(handed)} or None
            self.prebuilt = outputs.prebuilt(graph.output, n, padded, self.rows_out)
        self.replaced.update(dict.fromkeys(plan.size_indices, padded))
        self.marked = tuple(rows for rows, _, _ in self.rows if rows is not None)
        """The `Rows` of each batch input: where pad rows were written, per call."""
        self.inline = (
            self.prebuilt is not None
            and not self.expanded
            and not self.copied_back
            and (padded == n or len(self.marked) == len(self.rows))
        )
        """A full graph whose call `CompiledGraph.steady` runs inline: one fused copy, pad rows
        noted, the launch, the prebuilt outputs (else it calls this object)."""
        self.output = graph.output if graph is not None else None

    def _target(self, i: int, view: torch.Tensor) -> None:
        if 0 in view.stride():
            self.expanded.append((i, view))
        else:
            self.sources.append(i)
            self.targets.append(view)

    def __call__(self, args: tuple[Any, ...]) -> list[Any]:
        n, padded = self.n, self.padded
        if self.targets:
            torch._foreach_copy_(self.targets, self.gather(args))
        for i, view in self.expanded:
            copy_into(view, args[i])
        for rows, view, i in self.rows:
            if rows is None:
                if padded != n:
                    self.input_buffers.pad(i, view[n:])
            elif rows.dirty != n:  # pad rows an earlier call wrote, or note n data rows
                rows.written(n)
        if self.graph is not None:
            self.launch()
            out = self.output
        else:
            out = self._run_pieces(args)
        if self.copied_back:
            self.input_buffers.copy_back(args, self.replaced, n, padded)
        if self.prebuilt is not None and not self.outputs.copies:
            return self.outputs.hand_out_prebuilt(out, self.prebuilt)
        return self.outputs.hand_out(out, n, padded, self.rows_out)

    def _run_pieces(self, args: tuple[Any, ...]) -> Any:
        runnable, ctx = self.piecewise
        static_args = list(args)
        for i, value in self.replaced.items():
            static_args[i] = value
        token = FORWARD_CONTEXT.set(ctx)
        try:
            return runnable(*static_args)
        finally:
            FORWARD_CONTEXT.reset(token)


def _gatherer(indices: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """args -> the tuple of args at `indices`, at C speed for two or more (an itemgetter of one
    index returns the item, not a tuple)."""
    if len(indices) > 1:
        return operator.itemgetter(*indices)
    return lambda args: tuple([args[i] for i in indices])
