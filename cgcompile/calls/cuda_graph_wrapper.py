"""`CUDAGraphWrapper`: replay a callable from a graph per batch key, capturing on first sight.

A wrapper is bound to one runtime mode (FULL or PIECEWISE) and one `GraphRuntime`. It acts only
when the forward context's runtime mode is its own; otherwise it calls straight through. That is
what makes nesting work: a FULL wrapper around the whole model and a PIECEWISE wrapper around
each piece inside it, only the one whose mode matches captures and replays.

    wrapper = CUDAGraphWrapper(piece, CUDAGraphMode.PIECEWISE, make_graph_runtime("simulated"))
    with set_forward_context(CUDAGraphMode.PIECEWISE, num_tokens=8): out = wrapper(x[:8])
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from cgcompile.calls.forward_context import FORWARD_CONTEXT, ForwardContext, current_forward_context
from cgcompile.calls.graph_entry import GraphEntry, GraphKey
from cgcompile.config import CUDAGraphMode
from cgcompile.counters import counters
from cgcompile.errors import CaptureError, ConfigError
from cgcompile.graphs.graph_runtime import GraphRuntime

logger = logging.getLogger(__name__)
_ALONE = contextlib.nullcontext()


class CUDAGraphWrapper:
    """Wraps `runnable`; in its runtime mode, replays a graph per key instead of calling it.

    Per call (`__call__`):
    1. no forward context, or its runtime mode is NONE or another mode: call `passthrough`
       (default: `runnable`; FULL_AND_PIECEWISE's FULL wrapper captures a whole-graph compile
       and passes other calls to the split one);
    2. key = the context's `graph_key` (batch descriptor, the forward's dynamic sizes, module
       instance), built once per forward, else (batch descriptor, this call's int args,
       instance);
    3. unseen key: the first `num_warmups` calls of it are `_warmup` calls: they run `runnable`
       and return its result (allocator growth, autotuning and lazy init happen there; a
       wrapper whose callable never ran warms up once whatever `num_warmups` says, since a
       compiled kernel's first run cannot happen inside a capture). The next call `_capture`s
       (copy args at copy_arg_indices into static buffers, record input addresses, record the
       graph) and `_replay`s at once. Capture runs nothing, so every call
       runs the callable's work exactly once, as an eager call would. A `CaptureError` is
       logged at WARNING once per wrapper, counted, and the key runs eagerly from then on;
    4. the context's `capture_only` (set by `capture_all`): record an unseen key's graph without
       warm-up or replay and return its uncomputed outputs (a known key returns its graph's
       outputs, unreplayed); a `CaptureError` propagates and the key is left to lazy capture,
       as is every key of a wrapper whose callable never ran;
    5. known key: on its first replay `_verify` that inputs sit where the graph reads them
       (addresses and shapes; raising `CaptureError` otherwise); then, inline on later calls:
       in manual mode (a context without `shape_key`) check each non-copied tensor arg's
       address again (but `fixed_arg_indices`), copy args into static buffers, replay, return
       the graph's output objects (overwritten by the next replay). Automatic dispatch feeds
       static buffers and checks the module instance itself, so its replays skip the check.
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        runtime_mode: CUDAGraphMode,
        runtime: GraphRuntime,
        *,
        name: str = "graph",
        num_warmups: int = 1,
        copy_arg_indices: Sequence[int] = (),
        fixed_arg_indices: Sequence[int] = (),
        weak_output: bool = False,
        passthrough: Callable[..., Any] | None = None,
    ) -> None:
        if runtime_mode not in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            raise ConfigError(
                f"CUDAGraphWrapper runtime_mode must be PIECEWISE or FULL, got {runtime_mode}; "
                f"leave a callable unwrapped to run it without graphs"
            )
        if num_warmups < 0:
            raise ConfigError(f"num_warmups must be >= 0, got {num_warmups}")
        self.runnable = runnable
        self.passthrough = passthrough
        """What calls in another runtime mode run, if not `runnable`."""
        self.runtime_mode = runtime_mode
        self.runtime = runtime
        self.name = name
        self.num_warmups = num_warmups
        self.copy_arg_indices = tuple(sorted(set(copy_arg_indices)))
        self.fixed_arg_indices = frozenset(fixed_arg_indices)
        """Args whose addresses the caller guarantees (a module's parameters and buffers,
        whose instance the backend checks by identity): checked on the first replay only."""
        self.weak_output = weak_output
        self.entries: dict[GraphKey, GraphEntry] = {}
        self.failed_keys: dict[GraphKey, str] = {}
        """Keys whose capture failed, with the reason; they run eagerly."""
        self.capture_seconds = 0.0
        """Total wall time spent in captures (warm-up runs excluded)."""
        self.warmup_calls: dict[GraphKey, int] = {}
        """Warm-up calls run so far per key not yet captured."""
        self.ran = False
        """Whether `runnable` ran outside a capture (a warm-up or a pass-through call)."""
        self._int_positions: tuple[int, ...] | None = None
        self._warned = False
        self.turn: contextlib.AbstractContextManager[Any] = _ALONE
        """Held around each capture: a background `capture_all`'s lock, which the owner
        thread's calls hold for their whole call, so the two take turns one graph at a time."""

    @property
    def num_captures(self) -> int:
        """Graphs this wrapper holds."""
        return len(self.entries)

    def captured_keys(self) -> list[GraphKey]:
        """The key of every graph held: (batch descriptor, dynamic sizes, module instance)."""
        return list(self.entries)

    def drop_instance(self, instance: int) -> None:
        """Forget the graphs, warm-up counts and failures of one module instance (it is gone)."""
        for table in (self.entries, self.failed_keys, self.warmup_calls):
            for key in [k for k in table if k[2] == instance]:
                del table[key]

    def __call__(self, *args: Any) -> Any:
        ctx = FORWARD_CONTEXT.get()  # `current_forward_context()`, one frame less per piece
        # self.runtime_mode is never NONE, so this also passes NONE through
        if ctx is None or ctx.cudagraph_runtime_mode is not self.runtime_mode:
            if self.passthrough is not None:
                return self.passthrough(*args)
            self.ran = True
            return self.runnable(*args)
        key = ctx.graph_key or self._key(ctx, args)
        entry = self.entries.get(key)
        if entry is not None and entry.verified and not ctx.capture_only:  # the steady state
            if ctx.graph_key is None:  # manual mode: the caller keeps inputs in place; check
                for i, address in entry.addresses:
                    if args[i].data_ptr() != address:
                        self._verify(entry, args)  # raises CaptureError naming the arg
            for i, buffer in entry.static_inputs:
                if args[i] is not buffer:
                    buffer.copy_(args[i])
            entry.launch()
            return entry.output
        if ctx.capture_only:
            return entry.graph.output if entry else self._capture_only(key, args)
        if entry is None:
            if key in self.failed_keys:
                return self.runnable(*args)
            if not self.ran or self.warmup_calls.get(key, 0) < self.num_warmups:
                return self._warmup(key, args)
            return self._capture_and_replay(key, args)
        self._verify(entry, args)
        return self._replay(entry, args)

    def ready_entry(self) -> GraphEntry | None:
        """The graph this call replays with nothing left to check (automatic dispatch, a key
        replayed before), else None. A caller holding the args in another form (Inductor's
        list, `PartitionAdapter`) then copies them into `static_inputs` itself and replays,
        as the steady state of `__call__` does."""
        ctx = current_forward_context()
        if (
            ctx is None
            or ctx.cudagraph_runtime_mode is not self.runtime_mode
            or ctx.graph_key is None
            or ctx.capture_only
        ):
            return None
        entry = self.entries.get(ctx.graph_key)
        return entry if entry is not None and entry.verified else None

    def _key(self, ctx: ForwardContext, args: tuple[Any, ...]) -> GraphKey:
        """The key of a call without a context-wide shape key: the call's own int args."""
        # the runnable's signature is fixed (a compiled graph), so int positions never move
        if self._int_positions is None:
            self._int_positions = tuple(i for i, a in enumerate(args) if type(a) is int)
        return ctx.batch_descriptor, tuple([args[i] for i in self._int_positions]), ctx.instance

    def _capture_and_replay(self, key: GraphKey, args: tuple[Any, ...]) -> Any:
        try:
            entry, output = self._capture(key, args)
        except CaptureError as exc:
            return self._capture_failed(key, args, str(exc))
        self._replay(entry, args)
        # The capture's own output objects (the same memory the replay just wrote): strong
        # refs keep their pool blocks reserved while later pieces of this forward capture.
        return output

    def _warmup(self, key: GraphKey, args: tuple[Any, ...]) -> Any:
        """A call of a key not captured yet runs eagerly: allocator growth, autotuning and lazy
        init happen outside the capture, and the call's result is the eager one."""
        self.warmup_calls[key] = self.warmup_calls.get(key, 0) + 1
        self.ran = True
        return self.runnable(*args)

    def _capture_only(self, key: GraphKey, args: tuple[Any, ...]) -> Any:
        if not self.ran:
            raise CaptureError(
                f"{self.name}: its callable has not run yet, and a compiled kernel's first run "
                f"cannot happen inside a capture; call the compiled model once in this mode"
            )
        return self._capture(key, args, dry_run=True)[1]

    def _capture(
        self, key: GraphKey, args: tuple[Any, ...], dry_run: bool = False
    ) -> tuple[GraphEntry, Any]:
        """Record the graph for `key` under `turn`, unless the other side of a background
        `capture_all` recorded it while this capture waited for its turn."""
        with self.turn:
            entry = self.entries.get(key)
            if entry is not None:
                return entry, entry.graph.output
            return self._record(key, args, dry_run)

    def _record(
        self, key: GraphKey, args: tuple[Any, ...], dry_run: bool
    ) -> tuple[GraphEntry, Any]:
        """Record the graph for `key`, reading copied args from buffers the entry owns."""
        static = self._static_buffers(args)
        capture_args = tuple(static.get(i, a) for i, a in enumerate(args))
        layout = {
            i: (a.data_ptr(), a.shape)
            for i, a in enumerate(args)
            if isinstance(a, torch.Tensor) and i not in static
        }
        start = time.perf_counter()
        graph, output = self.runtime.capture(
            self.runnable,
            capture_args,
            weak_output=self.weak_output,
            dry_run=dry_run,
            instance=key[2],
        )
        seconds = time.perf_counter() - start
        counters.num_cudagraph_captured += 1
        self.capture_seconds += seconds
        entry = GraphEntry(key, graph, layout, tuple(static.items()), seconds)
        entry.addresses = tuple(
            (i, ptr)
            for i, (ptr, shape) in layout.items()
            if shape.numel() > 0 and i not in self.fixed_arg_indices
        )
        self.entries[key] = entry
        self.warmup_calls.pop(key, None)
        logger.debug(
            "%s: captured %s graph for %s in %.3f s", self.name, self.runtime.name, key, seconds
        )
        return entry, output

    def _static_buffers(self, args: tuple[Any, ...]) -> dict[int, torch.Tensor]:
        static = {}
        for i in self.copy_arg_indices:
            if i >= len(args) or not isinstance(args[i], torch.Tensor):
                got = type(args[i]).__name__ if i < len(args) else f"only {len(args)} args"
                raise ConfigError(
                    f"{self.name}: copy_arg_indices names arg {i}, which must be a tensor, got "
                    f"{got}; list only positions of tensor args"
                )
            static[i] = args[i].detach().clone()
        return static

    def _verify(self, entry: GraphEntry, args: tuple[Any, ...]) -> None:
        """First replay of a key: every arg the graph reads in place must be where it was."""
        for i, (address, shape) in entry.input_layout.items():
            arg = args[i]
            # an empty tensor has no data to read, so its address may change freely
            if arg.shape != shape or (arg.numel() > 0 and arg.data_ptr() != address):
                raise CaptureError(
                    f"{self.name}: tensor arg {i} for key {entry.key} is at address "
                    f"{arg.data_ptr():#x} with shape {tuple(arg.shape)}, but the graph was "
                    f"captured reading address {address:#x} with shape {tuple(shape)}, so "
                    f"replay would read stale memory; keep inputs at fixed addresses (e.g. "
                    f"slices of persistent buffers) or let automatic dispatch copy them in "
                    f"(copy_arg_indices)"
                )
        for i, buffer in entry.static_inputs:
            if args[i].shape != buffer.shape:
                raise CaptureError(
                    f"{self.name}: copied arg {i} for key {entry.key} has shape "
                    f"{tuple(args[i].shape)}, but its static buffer has shape "
                    f"{tuple(buffer.shape)}; pass the int sizes as args so each size gets a key"
                )
        entry.verified = True

    def _replay(self, entry: GraphEntry, args: tuple[Any, ...]) -> Any:
        """Copy args into static buffers, replay; the output is overwritten by the next replay."""
        for i, buffer in entry.static_inputs:
            arg = args[i]
            if arg is not buffer:
                buffer.copy_(arg)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s: replay %s", self.name, entry.key)
        return entry.graph.replay()

    def _capture_failed(self, key: GraphKey, args: tuple[Any, ...], reason: str) -> Any:
        """A failed capture: count it, warn once per wrapper, run this key eagerly for good."""
        counters.num_capture_failures += 1
        self.failed_keys[key] = reason
        if not self._warned:
            self._warned = True
            logger.warning(
                "%s: CUDA graph capture failed for %s; running it eagerly from now on: %s",
                self.name,
                key,
                reason,
            )
        else:
            logger.debug("%s: capture failed for %s: %s", self.name, key, reason)
        return self.runnable(*args)


class WrapperFactory(Protocol):
    """Builds the PIECEWISE wrapper of one piece or partition (the backend's, for both paths)."""

    def __call__(
        self,
        runnable: Callable[..., Any],
        *,
        name: str,
        copy_arg_indices: Sequence[int],
        weak_output: bool,
        fixed_arg_indices: Sequence[int] = (),
    ) -> CUDAGraphWrapper: ...
