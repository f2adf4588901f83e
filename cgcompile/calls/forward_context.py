"""What the dispatcher chose for the batch being run, visible to every CUDA-graph wrapper.

`BatchDescriptor` is the hashable key of a padded batch. `set_forward_context` publishes the
chosen runtime mode and descriptor for the duration of a forward; wrappers read it with
`get_forward_context()` and trust it. Contexts nest and are per thread/task (contextvars).

    with set_forward_context(cudagraph_runtime_mode=CUDAGraphMode.FULL,
                             batch_descriptor=BatchDescriptor(8, num_reqs=8, uniform=True)):
        out = compiled(tokens)

`batch_hint` is the lighter, user-facing variant for automatic dispatch: it describes the batch
(uniform decode or not, request count, LoRA, modes a feature forbids) and lets the backend pick.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

from cgcompile.config import CUDAGraphMode
from cgcompile.errors import ConfigError, ConfigTypeError
from cgcompile.options import as_bool, as_index, as_list, show


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    """Key of one padded batch. PIECEWISE keys are relaxed: `num_reqs=None, uniform=False`."""

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    has_lora: bool = False

    def relaxed(self) -> BatchDescriptor:
        """The key a PIECEWISE graph of this size is stored under (any request count)."""
        return dataclasses.replace(self, num_reqs=None, uniform=False)


_NONE, _PIECEWISE, _FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL


@dataclasses.dataclass(frozen=True)
class ForwardContext:
    """What `set_forward_context` published: the runtime mode and the key of this forward."""

    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: BatchDescriptor | None = None
    shape_key: tuple[int, ...] | None = None
    """The graph's dynamic sizes for this call, set by automatic dispatch: every wrapper of one
    forward then keys on the same sizes, so a forward either captures all its pieces or
    replays all of them. None: each wrapper keys on its own int args."""
    capture_only: bool = False
    """Record graphs without running anything (`capture_all`): wrappers capture unseen keys
    without warm-up or replay and return uncomputed outputs."""
    instance: int = 0
    """Which module instance runs (0: the first): graphs bake in its parameters' addresses, so
    every instance has graphs of its own (see `backend.instances`)."""
    graph_key: tuple[BatchDescriptor | None, tuple[int, ...], int] | None = dataclasses.field(
        init=False, repr=False, compare=False
    )
    """(batch_descriptor, shape_key, instance) when shape_key is set: the key every wrapper of
    this forward looks its graph up by, built once per forward instead of once per piece."""

    def __post_init__(self) -> None:
        key = None
        if self.shape_key is not None:
            key = (self.batch_descriptor, self.shape_key, self.instance)
        object.__setattr__(self, "graph_key", key)
        mode = self.cudagraph_runtime_mode
        # identity tests: Enum.__hash__ runs Python code, and this runs on every call
        if not (mode is _NONE or mode is _PIECEWISE or mode is _FULL):
            raise ConfigError(
                f"cudagraph_runtime_mode must be one of NONE, PIECEWISE, FULL, got "
                f"{self.cudagraph_runtime_mode}; composite modes are resolved per batch"
            )
        if self.cudagraph_runtime_mode != CUDAGraphMode.NONE and self.batch_descriptor is None:
            raise ConfigError(
                f"cudagraph_runtime_mode={self.cudagraph_runtime_mode} needs a batch_descriptor"
            )


FORWARD_CONTEXT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "cgcompile_forward_context", default=None
)
"""The active context: set by `set_forward_context`, and by the backend's prebuilt calls
(`runtime.ready`), which set a context built once instead of entering the manager."""


@contextlib.contextmanager
def set_forward_context(
    cudagraph_runtime_mode: CUDAGraphMode | str = CUDAGraphMode.NONE,
    batch_descriptor: BatchDescriptor | None = None,
    num_tokens: int | None = None,
    shape_key: tuple[int, ...] | None = None,
    capture_only: bool = False,
    instance: int = 0,
) -> Iterator[ForwardContext]:
    """Publish the runtime mode and batch key for the enclosed forward; restores on exit.

    `num_tokens` alone builds `BatchDescriptor(num_tokens)`; the mode may be a name, any case.
    `shape_key`, `capture_only` and `instance` are set by automatic dispatch.
    """
    if not isinstance(cudagraph_runtime_mode, CUDAGraphMode):  # a name, in any case
        cudagraph_runtime_mode = CUDAGraphMode.parse(
            cudagraph_runtime_mode, "cudagraph_runtime_mode"
        )
    if batch_descriptor is None and num_tokens is not None:
        n = as_index(num_tokens)
        if n is None or n < 1:
            raise ConfigError(
                f"num_tokens must be a positive int (the padded batch's tokens), got "
                f"{show(num_tokens)}"
            )
        batch_descriptor = BatchDescriptor(n)
    ctx = ForwardContext(
        cudagraph_runtime_mode, batch_descriptor, shape_key, capture_only, instance
    )
    token = FORWARD_CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        FORWARD_CONTEXT.reset(token)


def get_forward_context() -> ForwardContext:
    """The active context; RuntimeError outside `set_forward_context`."""
    ctx = FORWARD_CONTEXT.get()
    if ctx is None:
        raise RuntimeError("no forward context is set; use `with set_forward_context(...)`")
    return ctx


def is_forward_context_available() -> bool:
    """Whether a `set_forward_context` block is active in this thread or task."""
    return FORWARD_CONTEXT.get() is not None


def current_forward_context() -> ForwardContext | None:
    """The active context or None: the cheap read the replay path uses."""
    return FORWARD_CONTEXT.get()


@dataclasses.dataclass(frozen=True)
class BatchHint:
    """What the caller knows about the next batch; read by automatic dispatch."""

    uniform_decode: bool | None = None
    """Every request has the same query length q and num_tokens == q * num_reqs."""
    num_reqs: int | None = None
    """Requests in the batch; when `uniform_decode` is None the batch is uniform decode if
    its token count is `num_reqs * uniform_decode_query_len`."""
    has_lora: bool = False
    """The batch uses LoRA adapters; no graphs are captured for such batches, so it runs
    without graphs."""
    invalid_modes: frozenset[CUDAGraphMode] = frozenset()
    """Runtime modes this batch must not use, e.g. {FULL} for a feature a full graph can't hold."""


BATCH_HINT: contextvars.ContextVar[BatchHint | None] = contextvars.ContextVar(
    "cgcompile_batch_hint", default=None
)
"""The hint of the enclosing `batch_hint`, or None (what the steady state reads per call)."""


class batch_hint:  # noqa: N801 - a context manager named as users call it
    """Describe the batch of the enclosed calls to the automatic dispatcher.

    `uniform_decode`: every request has the same query length q (`uniform_decode_query_len`,
    1 without speculative tokens) and the batch holds q tokens per request; such a batch may
    replay a full decode graph (FULL_AND_PIECEWISE, FULL_DECODE_ONLY). None (default): decided
    by `num_reqs`, else a mixed batch. `num_reqs`: the number of requests; with
    `uniform_decode=None` the batch is uniform decode when it has exactly `num_reqs * q`
    tokens. `has_lora`: the batch uses LoRA adapters; no graphs are captured for LoRA batches,
    so it runs without graphs. `invalid_modes`: runtime modes (NONE, PIECEWISE, FULL, as
    enums or names) the batch must not use, e.g. {"FULL"} for a feature a full graph cannot
    hold; the dispatcher takes the first allowed of FULL, PIECEWISE and NONE that serves the
    batch (`CGCompileError` when none is left).

        with cgcompile.batch_hint(uniform_decode=True):
            logits = compiled(tokens)          # FULL graph in FULL_AND_PIECEWISE
    """

    __slots__ = ("hint", "_tokens")

    def __init__(
        self,
        uniform_decode: bool | None = None,
        num_reqs: int | None = None,
        has_lora: bool = False,
        invalid_modes: set[CUDAGraphMode] | frozenset[CUDAGraphMode] = frozenset(),
    ) -> None:
        common = num_reqs is None and has_lora is False and not invalid_modes
        if common and (uniform_decode is None or uniform_decode is True or uniform_decode is False):
            self.hint = _COMMON_HINTS[uniform_decode]  # a decode loop's hint: nothing to build
        else:
            self.hint = _checked_hint(uniform_decode, num_reqs, has_lora, invalid_modes)
        self._tokens: list[contextvars.Token[BatchHint | None]] = []

    def __enter__(self) -> BatchHint:
        self._tokens.append(BATCH_HINT.set(self.hint))
        return self.hint

    def __exit__(self, *exc: object) -> None:
        BATCH_HINT.reset(self._tokens.pop())


_COMMON_HINTS = {u: BatchHint(u) for u in (None, True, False)}


def _checked_hint(uniform_decode: Any, num_reqs: Any, has_lora: Any, modes: Any) -> BatchHint:
    """The hint, or a `ConfigError` naming the bad argument; mode names in any case."""
    invalid = _checked_modes(modes) if modes else frozenset()  # empty: per step, keep it cheap
    n = None if num_reqs is None else as_index(num_reqs)
    if num_reqs is not None and (n is None or n < 1):
        raise (ConfigError if n is not None else ConfigTypeError)(
            f"batch_hint num_reqs must be >= 1, got {show(num_reqs)}; give the number of "
            f"requests in the batch, or None"
        )
    if uniform_decode is not None:
        as_bool("batch_hint uniform_decode", uniform_decode)
    return BatchHint(uniform_decode, n, as_bool("batch_hint has_lora", has_lora), invalid)


def _checked_modes(modes: Any) -> frozenset[CUDAGraphMode]:
    key = "batch_hint invalid_modes"
    invalid = frozenset(CUDAGraphMode.parse(m, key) for m in as_list(key, modes))
    bad = sorted(m.name for m in invalid - CUDAGraphMode.valid_runtime_modes())
    if bad:
        raise ConfigError(f"invalid_modes must hold runtime modes NONE/PIECEWISE/FULL, got {bad}")
    return invalid


def current_batch_hint() -> BatchHint | None:
    return BATCH_HINT.get()
