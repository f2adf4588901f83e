"""Which graph serves a batch: the single source of truth for the graphs that exist.

After resolution, `initialize_cudagraph_keys(mode, q)` builds two key sets, FULL and PIECEWISE,
one key per capture size (PIECEWISE keys relaxed: any request count). `dispatch` pads the
token count to the smallest capture size that fits and tries FULL, then PIECEWISE, then NONE.
Batches above the largest capture size run without graphs, unpadded.

    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(CUDAGraphMode.FULL_AND_PIECEWISE)
    dispatcher.dispatch(5, uniform_decode=True)   # (FULL, BatchDescriptor(8, 8, True))
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from cgcompile.calls.forward_context import BatchDescriptor
from cgcompile.config import CompilationConfig, CUDAGraphMode
from cgcompile.errors import CGCompileError, ConfigError

FULL = CUDAGraphMode.FULL
NONE = CUDAGraphMode.NONE
PIECEWISE = CUDAGraphMode.PIECEWISE
_ALL_RUNTIME_MODES = CUDAGraphMode.valid_runtime_modes()


class CudagraphDispatcher:
    """Holds the key sets and the padding table; lifecycle: construct, initialize, dispatch."""

    def __init__(
        self, config: CompilationConfig, capture_sizes: Iterable[int] | None = None
    ) -> None:
        sizes = config.cudagraph_capture_sizes if capture_sizes is None else capture_sizes
        self.capture_sizes = tuple(sorted(set(sizes)))
        self.max_capture_size = self.capture_sizes[-1] if self.capture_sizes else 0
        self.max_num_reqs = config.effective_max_num_reqs
        self.cudagraph_mode = NONE
        self.uniform_decode_query_len = 1
        self.keys_initialized = False
        self.cudagraph_keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {
            FULL: set(),
            PIECEWISE: set(),
        }
        self._padded = self._padding_table()
        self._memo: dict[tuple[bool, bool], list[Any]] = {}

    def _padding_table(self) -> list[int]:
        """_padded[n] = smallest capture size >= n, for 0 <= n <= max capture size."""
        table = [0] * (self.max_capture_size + 1)
        start = 1
        for size in self.capture_sizes:
            table[start : size + 1] = [size] * (size + 1 - start)
            start = size + 1
        return table

    def initialize_cudagraph_keys(
        self, cudagraph_mode: CUDAGraphMode, uniform_decode_query_len: int = 1
    ) -> None:
        """Build the FULL and PIECEWISE key sets for the resolved mode; call before dispatch."""
        q = uniform_decode_query_len
        self.cudagraph_mode = cudagraph_mode
        self.uniform_decode_query_len = q
        for keys in self.cudagraph_keys.values():
            keys.clear()
        self.keys_initialized = True
        self._memo = {
            (u, lora): [None] * (self.max_capture_size + 1)
            for u in (False, True)
            for lora in (False, True)
        }
        if cudagraph_mode == NONE:
            return
        mixed = cudagraph_mode.mixed_mode()
        if mixed != NONE:
            for size in self.capture_sizes:
                desc = self._descriptor(size, uniform=False, has_lora=False)
                self.cudagraph_keys[mixed].add(desc.relaxed() if mixed == PIECEWISE else desc)
        if cudagraph_mode.separate_routine() and cudagraph_mode.decode_mode() == FULL:
            for size in self.capture_sizes:
                if q <= size <= q * self.max_num_reqs and size % q == 0:
                    self.cudagraph_keys[FULL].add(BatchDescriptor(size, size // q, uniform=True))

    def _descriptor(self, num_tokens: int, uniform: bool, has_lora: bool) -> BatchDescriptor:
        padded = self._padded[num_tokens]
        if uniform:
            num_reqs = min(padded // self.uniform_decode_query_len, self.max_num_reqs)
        else:
            num_reqs = min(padded, self.max_num_reqs)
        return BatchDescriptor(padded, num_reqs, uniform, has_lora)

    def dispatch(
        self,
        num_tokens: int,
        uniform_decode: bool = False,
        has_lora: bool = False,
        valid_modes: Iterable[CUDAGraphMode] | None = None,
        invalid_modes: Iterable[CUDAGraphMode] | None = None,
    ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """The runtime mode and (padded) key for a batch of `num_tokens` tokens."""
        if (
            self.keys_initialized
            and valid_modes is None
            and not invalid_modes
            and 0 < num_tokens <= self.max_capture_size
        ):
            table = self._memo[bool(uniform_decode), bool(has_lora)]
            if table[num_tokens] is None:
                table[num_tokens] = self._dispatch(num_tokens, uniform_decode, has_lora, None, None)
            return table[num_tokens]  # the same descriptor object each time: cheap to hash
        return self._dispatch(num_tokens, uniform_decode, has_lora, valid_modes, invalid_modes)

    def _dispatch(
        self,
        num_tokens: int,
        uniform_decode: bool,
        has_lora: bool,
        valid_modes: Iterable[CUDAGraphMode] | None,
        invalid_modes: Iterable[CUDAGraphMode] | None,
    ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        allowed = set(_ALL_RUNTIME_MODES if valid_modes is None else valid_modes)
        allowed -= set(invalid_modes or ())
        if not allowed:
            raise ConfigError(
                f"no runtime mode left: valid_modes={valid_modes}, invalid_modes={invalid_modes}"
            )
        eager = (NONE, BatchDescriptor(num_tokens))
        if (
            not self.keys_initialized
            or self.cudagraph_mode == NONE
            or not 0 < num_tokens <= self.max_capture_size
            or allowed <= {NONE}
        ):
            return self._eager_or_fail(eager, allowed, num_tokens)
        uniform = uniform_decode and self.cudagraph_mode.separate_routine()
        if uniform and self._padded[num_tokens] % self.uniform_decode_query_len:
            uniform = False  # not a whole number of requests of q tokens
        desc = self._descriptor(num_tokens, uniform, has_lora)
        if FULL in allowed and desc in self.cudagraph_keys[FULL]:
            return FULL, desc
        relaxed = desc.relaxed()
        if PIECEWISE in allowed and relaxed in self.cudagraph_keys[PIECEWISE]:
            return PIECEWISE, relaxed
        return self._eager_or_fail(eager, allowed, num_tokens)

    @staticmethod
    def _eager_or_fail(
        eager: tuple[CUDAGraphMode, BatchDescriptor], allowed: set[CUDAGraphMode], n: int
    ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        if NONE in allowed:
            return eager
        raise CGCompileError(
            f"no graph of mode {sorted(m.name for m in allowed)} serves a batch of {n} tokens, "
            f"and NONE is not allowed; add NONE to valid_modes or a capture size >= {n}"
        )

    def get_capture_descs(self) -> list[tuple[CUDAGraphMode, list[BatchDescriptor]]]:
        """Keys to capture, grouped by runtime mode (PIECEWISE first), each largest first."""
        if not self.keys_initialized or self.cudagraph_mode == NONE:
            return []
        groups = []
        for mode in (PIECEWISE, FULL):
            descs = sorted(self.cudagraph_keys[mode], key=lambda d: d.num_tokens, reverse=True)
            if descs:
                groups.append((mode, descs))
        return groups
