"""Dynamo's batch-1 graph served by the dynamic graph's compile, padded to 2 rows.

The backend hands Dynamo a `PaddedBatchOne` for a batch-1 graph that is the dynamic graph at
batch 1 (`passes.batch_one_match`). A call inserts the batch size, 1, where the dynamic graph
takes it as an int and calls the dynamic `CompiledGraph`, whose capture sizes start at 2: the
batch is padded to 2 rows like any batch between capture sizes and its outputs are sliced back,
and a call that runs without graphs runs its traced graph, never code compiled for 2 or more
rows. Only a caller that sets the forward context itself (manual mode, where nothing pads) gets
the batch-1 graph as traced, run eagerly, with one WARNING. A captured full graph's steady state
does not rebuild the arguments (they grow with the parameters): the dynamic graph's
`CompiledGraph.steady` runs on a dict of the few positions it reads, taken from this graph's.

    served = PaddedBatchOne(dynamic_graph, size_positions=(0, 5), traced=gm.forward)
    out = served(*dynamo_args)      # = dynamic_graph(1, *args[:5], 1, *args[5:]) for (0, 5)
"""

from __future__ import annotations

import bisect
import logging
import operator
from collections.abc import Callable
from typing import Any

from cgcompile.calls.compiled_graph import CompiledGraph
from cgcompile.calls.forward_context import FORWARD_CONTEXT
from cgcompile.calls.steady_state import MISS
from cgcompile.counters import counters

logger = logging.getLogger(__name__)
_ONE = (1,)


class PaddedBatchOne:
    """Calls `graph` (the dynamic graph) with the batch-1 graph's arguments and the size 1."""

    def __init__(
        self, graph: CompiledGraph, size_positions: tuple[int, ...], traced: Callable[..., Any]
    ) -> None:
        self.graph = graph
        self.size_positions = size_positions
        self.__wrapped__ = graph  # what `cgcompile.trusted` binds
        self.traced = traced
        self._cuts = tuple(p - k for k, p in enumerate(size_positions))
        """Where 1 goes, as positions in the batch-1 graph's arguments."""
        self._warned = False
        self._read: tuple[tuple[int, ...], Callable[..., tuple[Any, ...]]] | None = None
        """(positions the graph's steady state reads, in the dynamic graph's arguments; a
        getter of those arguments from this graph's): `CompiledGraph.steady` runs on a dict of
        them."""

    def __call__(self, *args: Any) -> Any:
        read = self._read
        if read is not None:  # the steady state of a full graph, without rebuilding `args`
            values = dict(zip(read[0], read[1](args), strict=False))  # a repeat dropped
            out = self.graph.steady(values, any_ready=False)
            if out is not MISS:
                return out
        elif self._reads_from_now():
            return self(*args)
        if FORWARD_CONTEXT.get() is not None:
            return self._run_manual(args)
        full, start = (), 0
        for p in self._cuts:  # one or two cuts: tuple slices, copied at C speed
            full += args[start:p] + _ONE
            start = p
        return self.graph(*full, *args[start:])

    def _reads_from_now(self) -> bool:
        """Set `_read` once the graph names what its steady state reads (after its first call):
        those positions of the dynamic graph's arguments and a getter of them from this graph's."""
        reads = self.graph.steady_reads()
        if reads is None:
            return False
        here = [i - bisect.bisect_left(self.size_positions, i) for i in reads]
        if here:
            getter = operator.itemgetter(*here, *here[:1])  # a tuple even for one position
        else:  # nothing to read: `steady` finds no batch tensor and misses
            getter = lambda args: ()  # noqa: E731
        self._read = (reads, getter)
        return True

    def _run_manual(self, args: tuple[Any, ...]) -> Any:
        counters.num_eager_fallbacks += 1
        self.graph.report.num_eager_fallbacks += 1  # the report's count, as for its own calls
        if not self._warned:
            self._warned = True
            logger.warning(
                "graph %d serves Dynamo's batch-1 graph padded to 2 rows, and a caller that "
                "sets the forward context (manual mode) gets no padding: batch-1 calls run the "
                "traced graph without CUDA graphs; counted in num_eager_fallbacks, warned once. "
                "Pass options batch_one='own' to compile batch 1 on its own",
                self.graph.report_id,
            )
        return self.traced(*args)
