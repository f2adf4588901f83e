"""Why a compiled graph runs a call without CUDA graphs: one WARNING per kind.

Missing sizes must be neither silent nor noisy, so `FallbackLog.warn(kind, n)` logs the first
call of each kind of miss per compiled graph, with what was seen and what to do; later ones
are only counted (`num_eager_fallbacks`). Kinds: `large` (above the largest capture size),
`key` (no graph for this batch_hint), `shape` (batch tensors disagree), `unpadded` (padding
could change the result or the state it writes), `moved` (an input written in place moved),
`instances` (too many live module instances), `variants` (too many values of a non-batch int
input), `thread` (a call from a thread that does not own the graphs), `held` (the caller still
holds a view of the previous call's outputs).

    log = FallbackLog(graph_id, plan, dispatcher, owner)
    log.warn("large", n=1024)
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cgcompile.calls.dispatcher import CudagraphDispatcher
from cgcompile.calls.input_plan import InputPlan
from cgcompile.calls.instances import MAX_INSTANCES
from cgcompile.calls.ownership import ThreadOwner
from cgcompile.calls.variants import MAX_SIZE_VARIANTS, MAX_STATE_VARIANTS

logger = logging.getLogger(__name__)


class FallbackLog:
    """Warns once per kind of miss for one compiled graph."""

    def __init__(
        self,
        graph_id: int,
        plan: InputPlan,
        dispatcher: CudagraphDispatcher,
        owner: ThreadOwner,
    ) -> None:
        self.graph_id = graph_id
        self.plan = plan
        self.dispatcher = dispatcher
        self.owner = owner
        self._warned: set[str] = set()

    def warn(self, kind: str | None, n: int | None) -> None:
        """Log the first miss of `kind` (None: decided from the batch size n)."""
        kind = kind or self._size_kind(n)
        if kind in self._warned:
            return
        self._warned.add(kind)
        why = _MESSAGES[kind](self, n)
        logger.warning(
            "graph %d runs a batch without CUDA graphs (%s); counted in num_eager_fallbacks, "
            "warned once",
            self.graph_id,
            why,
        )

    def _size_kind(self, n: int | None) -> str:
        if n is None:
            return "shape"
        return "large" if n > self.dispatcher.max_capture_size else "key"


def _moved(log: FallbackLog, n: int | None) -> str:
    names = [log.plan.names[i] for i in log.plan.kept_in_place]
    return (
        f"it uses {names} in place and one of them is not the tensor of the first call; "
        f"graphs read and write those tensors where they were, so keep them at fixed "
        f"addresses (e.g. allocate a cache once)"
    )


def _unpadded(log: FallbackLog, n: int | None) -> str:
    return (
        f"{n} rows are not padded to a capture size: padding could change what the caller "
        f"sees, as {log.plan.pad_unsafe}; batches of a capture size still use graphs"
    )


def _held(log: FallbackLog, n: int | None) -> str:
    return (
        "a view or detached alias of an output of its previous call is still referenced, and a "
        "replay would overwrite it: calls run without graphs until it is dropped, and from now on "
        "this graph copies its outputs out of graph memory (one copy per output per call). To "
        "keep the zero-copy path, let go of a call's outputs (and views of them) before the "
        "next call, and clone what you keep"
    )


def _instances(log: FallbackLog, n: int | None) -> str:
    return (
        f"more than {MAX_INSTANCES} live module instances share this compiled graph (instances "
        f"of one class, or identical layers compiled as separate frames after a graph break); "
        f"each of the first {MAX_INSTANCES} has graphs of its own, further ones run eagerly"
    )


def _variants(log: FallbackLog, n: int | None) -> str:
    plan = log.plan
    positions = [i for i in plan.int_args if i not in plan.size_indices] + [*plan.host_scalars]
    names = [plan.names[i] for i in positions]
    caches = [plan.names[i] for i in plan.batch_state[:1]]
    state = (
        f", or its batch-sized caches ({caches[0]}, ...) more than {MAX_STATE_VARIANTS} "
        f"address sets (reuse a cache, reset in place, rather than making one per call)"
        if caches
        else ""
    )
    return (
        f"its int inputs and host scalars {names} took more than {MAX_SIZE_VARIANTS} distinct "
        f"values{state}, and each needs graphs of its own; further ones run without graphs. "
        f"Pass a value that changes every call (a position, a step, a temperature) as a CUDA "
        f"tensor, so it is data, not part of the graph"
    )


def _large(log: FallbackLog, n: int | None) -> str:
    largest = log.dispatcher.max_capture_size
    return (
        f"{n} tokens exceed the largest capture size {largest}; raise the option "
        f"max_cudagraph_capture_size to give such batches graphs"
    )


def _thread(log: FallbackLog, n: int | None) -> str:
    return (
        f"a call from a thread other than {log.owner.name!r}, which owns this graph's CUDA "
        f"graphs; calls from other threads run the traced graph eagerly (see docs/guide.md, "
        f"Threads)"
    )


_MESSAGES: dict[str, Callable[[FallbackLog, int | None], str]] = {
    "moved": _moved,
    "held": _held,
    "unpadded": _unpadded,
    "instances": _instances,
    "thread": _thread,
    "variants": _variants,
    "shape": lambda log, n: "the batch tensors disagree on dim 0, or there are none",
    "large": _large,
    "key": lambda log, n: f"no graph serves {n} tokens with the current batch_hint",
}
