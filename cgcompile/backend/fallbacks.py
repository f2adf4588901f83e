"""Why a compiled graph runs a call without CUDA graphs, or pads it: one WARNING per kind.

Missing sizes must be neither silent nor noisy, so `FallbackLog.warn(kind, n)` logs the first
call of each kind of miss per compiled graph, with what was seen and what to do; later ones
are only counted (`num_eager_fallbacks`). Kinds: `large` (above the largest capture size),
`key` (no graph for this batch_hint), `shape` (batch tensors disagree), `unpadded` (padding
could change the result), `padding` (a state-writing graph padded without a pad value),
`moved` (an input written in place moved), `instances` (too many live module instances),
`variants` (too many values of a non-batch int input), `thread` (a call from a thread that
does not own the graphs).

    log = FallbackLog(graph_id, plan, dispatcher, owner)
    log.warn("large", n=1024)
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cgcompile.backend.inputs import InputPlan
from cgcompile.backend.instances import MAX_INSTANCES
from cgcompile.backend.ownership import ThreadOwner
from cgcompile.backend.variants import MAX_SIZE_VARIANTS
from cgcompile.dispatcher import CudagraphDispatcher

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
        if kind == "padding":
            logger.warning("graph %d pads a batch: %s", self.graph_id, why)
            return
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
    names = [log.plan.names[i] for i in log.plan.in_place]
    return (
        f"it writes {names} in place and one of them is not the tensor of the first call; "
        f"graphs read and write those tensors where they were, so keep them at fixed "
        f"addresses (e.g. allocate a cache once)"
    )


def _padding(log: FallbackLog, n: int | None) -> str:
    batch = [log.plan.names[i] for i in log.plan.batch_tensors]
    return (
        f"{n} rows padded with zeros; the graph writes {log.plan.state_names()} in place and "
        f"padded rows may write there where an eager call would not. Declare what padded rows "
        f"hold with cgcompile.mark_dynamic_batch(t, pad_value=...) for the batch input that "
        f"says where rows write ({batch}), e.g. a reserved trash slot"
    )


def _unpadded(log: FallbackLog, n: int | None) -> str:
    return (
        f"{n} rows are not padded to a capture size: padding could change what the caller "
        f"sees, as {log.plan.pad_unsafe}; batches of a capture size still use graphs"
    )


def _instances(log: FallbackLog, n: int | None) -> str:
    return (
        f"more than {MAX_INSTANCES} live module instances share this compiled graph (instances "
        f"of one class, or identical layers compiled as separate frames after a graph break); "
        f"each of the first {MAX_INSTANCES} has graphs of its own, further ones run eagerly"
    )


def _variants(log: FallbackLog, n: int | None) -> str:
    plan = log.plan
    names = [plan.names[i] for i in plan.int_args if i not in plan.size_indices]
    return (
        f"its int inputs {names} took more than {MAX_SIZE_VARIANTS} distinct values, and each "
        f"value needs graphs of its own; further values run without graphs. Pass a value that "
        f"changes every call (a position, a step) as a tensor, so it is data, not a shape"
    )


def _thread(log: FallbackLog, n: int | None) -> str:
    return (
        f"a call from a thread other than {log.owner.name!r}, which owns this graph's CUDA "
        f"graphs; calls from other threads run the traced graph eagerly (see README, Threads)"
    )


_MESSAGES: dict[str, Callable[[FallbackLog, int | None], str]] = {
    "moved": _moved,
    "padding": _padding,
    "unpadded": _unpadded,
    "instances": _instances,
    "thread": _thread,
    "variants": _variants,
    "shape": lambda log, n: "the batch tensors disagree on dim 0, or there are none",
    "large": lambda log, n: (
        f"{n} tokens exceed the largest capture size {log.dispatcher.max_capture_size}"
    ),
    "key": lambda log, n: f"no graph serves {n} tokens with the current batch_hint",
}
