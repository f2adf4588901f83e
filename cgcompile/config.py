"""Modes, attention support levels and the one configuration object.

`CUDAGraphMode` names what gets captured; the two composite modes are pairs
(decode mode, mixed mode). `AttentionCGSupport` is what an attention op can tolerate inside a
full graph. `CompilationConfig.from_options(options)` validates the `options` dict a user passes
to `torch.compile(..., backend="cudagraph_modes", options=...)`.

    config = CompilationConfig.from_options({"cudagraph_mode": "piecewise"})
    config.cudagraph_capture_sizes[:4]    # (1, 2, 4, 8)
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from cgcompile.errors import ConfigError


class CUDAGraphMode(enum.Enum):
    """NONE, PIECEWISE and FULL are runtime modes; the tuples are (decode mode, mixed mode)."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    def separate_routine(self) -> bool:
        """Decode batches and mixed batches use different graphs."""
        return isinstance(self.value, tuple)

    def decode_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def has_mode(self, mode: CUDAGraphMode) -> bool:
        return mode in (self.decode_mode(), self.mixed_mode())

    def has_full_cudagraphs(self) -> bool:
        return self.has_mode(CUDAGraphMode.FULL)

    def has_piecewise_cudagraphs(self) -> bool:
        return self.has_mode(CUDAGraphMode.PIECEWISE)

    def requires_piecewise_compilation(self) -> bool:
        return self.has_piecewise_cudagraphs()

    def without_piecewise(self) -> CUDAGraphMode:
        """The mode left when nothing is split: PIECEWISE -> NONE, F&P -> FULL_DECODE_ONLY."""
        if self == CUDAGraphMode.PIECEWISE:
            return CUDAGraphMode.NONE
        if self == CUDAGraphMode.FULL_AND_PIECEWISE:
            return CUDAGraphMode.FULL_DECODE_ONLY
        return self

    def min_attention_support(self, uniform_decode_query_len: int = 1) -> AttentionCGSupport:
        """The least attention support under which every graph of this mode is valid."""
        if not self.has_full_cudagraphs():
            return AttentionCGSupport.NEVER
        if self.mixed_mode() == CUDAGraphMode.FULL:
            return AttentionCGSupport.ALWAYS
        if uniform_decode_query_len > 1:
            return AttentionCGSupport.UNIFORM_BATCH
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def valid_runtime_modes(cls) -> frozenset[CUDAGraphMode]:
        return frozenset({cls.NONE, cls.PIECEWISE, cls.FULL})

    @classmethod
    def parse(cls, value: CUDAGraphMode | str, key: str = "cudagraph_mode") -> CUDAGraphMode:
        return _parse_enum(cls, value, key)

    def __str__(self) -> str:
        return self.name


class AttentionCGSupport(enum.IntEnum):
    """How much of a CUDA graph an attention op can live in; ordered, min over ops wins."""

    NEVER = 0
    """Never inside a graph: attention must run eagerly between pieces."""
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    """Full graphs of pure decode batches with one query token per request."""
    UNIFORM_BATCH = 2
    """Full graphs of batches where every request has the same query length (spec decode)."""
    ALWAYS = 3
    """Full graphs of any batch, mixed prefill and decode included."""

    @classmethod
    def parse(
        cls, value: AttentionCGSupport | str, key: str = "attention_cg_support"
    ) -> AttentionCGSupport:
        return _parse_enum(cls, value, key)

    def __str__(self) -> str:
        return self.name


def _parse_enum(cls: Any, value: Any, key: str) -> Any:
    if isinstance(value, cls):
        return value
    names = [m.name for m in cls]
    if isinstance(value, str) and value.upper() in names:
        return cls[value.upper()]
    raise ConfigError(f"{key} must be one of {names} (any case), got {value!r}")


OpSpec = str | torch._ops.OpOverload | torch._ops.OpOverloadPacket | Callable[..., Any]
_OP_NAME = re.compile(r"^[A-Za-z_][\w]*::[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)?$")


def default_capture_sizes(max_size: int) -> tuple[int, ...]:
    """[1, 2, 4] + multiples of 8 below 256 + multiples of 16 from 256, up to max_size."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)]
    return tuple(sorted({s for s in sizes if s <= max_size} | {max_size}))


@dataclasses.dataclass(frozen=True)
class CompilationConfig:
    """Everything the `cudagraph_modes` backend can be told; build it with `from_options`."""

    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.FULL_AND_PIECEWISE
    """Requested mode; resolution may lower it once the graph's attention ops are known."""
    splitting_ops: tuple[OpSpec, ...] | None = None
    """Ops to split the graph at; None means SDPA plus every registered attention op."""
    cudagraph_capture_sizes: tuple[int, ...] = ()
    """Batch sizes (tokens) that get graphs, ascending; others pad up to the next one."""
    max_cudagraph_capture_size: int = 512
    """Largest capture size; larger batches run without graphs, unpadded."""
    max_num_reqs: int | None = None
    """Most requests in one batch; bounds decode keys. None: the largest capture size."""
    uniform_decode_query_len: int = 1
    """Query tokens per request in a uniform decode batch (1 + speculative tokens)."""
    compile_sizes: tuple[int, ...] = ()
    """Extra batch sizes to compile pieces for with concrete shapes."""
    compiler: Literal["inductor", "eager"] = "inductor"
    """How each piece is compiled."""
    use_inductor_graph_partition: bool | None = False
    """Let Inductor compile the whole graph and partition it at the splitting ops instead of
    the FX split (torch >= 2.9.1, CUDA, compiler 'inductor'). True: where it cannot, the FX
    split is used with a WARNING; None: where available, falling back quietly (INFO)."""
    num_warmups: int = 1
    """Eager runs before each capture (allocator, autotuning, lazy init)."""
    graph_runtime: Literal["auto", "cuda", "simulated"] = "auto"
    """'auto': CUDA graphs on CUDA inputs, none otherwise; 'simulated': CPU graph semantics."""
    attention_cg_support: AttentionCGSupport | None = None
    """Override of the support level found from the graph's attention ops."""

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_scalars()
        if (
            self.cudagraph_mode == CUDAGraphMode.FULL
            and self.attention_cg_support == AttentionCGSupport.NEVER
        ):
            raise ConfigError(
                "cudagraph_mode=FULL needs attention inside full graphs, but "
                "attention_cg_support=NEVER; use cudagraph_mode='PIECEWISE' (attention runs "
                "eagerly between pieces) or a higher support level"
            )

    def _check_sizes(self) -> None:
        for key in ("cudagraph_capture_sizes", "compile_sizes"):
            sizes = getattr(self, key)
            if any(type(s) is not int or s < 1 for s in sizes):
                raise ConfigError(
                    f"{key} must be positive ints, got {list(sizes)}; e.g. [1, 2, 4, 8]"
                )
        _check_int("max_cudagraph_capture_size", self.max_cudagraph_capture_size, 1)
        if self.cudagraph_capture_sizes and self.cudagraph_capture_sizes[-1] != (
            self.max_cudagraph_capture_size
        ):
            raise ConfigError(
                f"max_cudagraph_capture_size={self.max_cudagraph_capture_size} disagrees with "
                f"the largest of cudagraph_capture_sizes={list(self.cudagraph_capture_sizes)}; "
                f"give one of the two, or make the max equal the largest size"
            )

    def _check_scalars(self) -> None:
        _check_int("uniform_decode_query_len", self.uniform_decode_query_len, 1)
        _check_int("num_warmups", self.num_warmups, 0)
        if self.max_num_reqs is not None:
            _check_int("max_num_reqs", self.max_num_reqs, 1)
        _check_choice("compiler", self.compiler, ("inductor", "eager"))
        _check_choice("graph_runtime", self.graph_runtime, ("auto", "cuda", "simulated"))
        partition = self.use_inductor_graph_partition
        if partition is not None and type(partition) is not bool:
            raise ConfigError(
                f"use_inductor_graph_partition must be True, False or None (where available), "
                f"got {self.use_inductor_graph_partition!r}"
            )
        for op in self.splitting_ops or ():
            if isinstance(op, str) and not _OP_NAME.match(op):
                raise ConfigError(
                    f"splitting_ops entries must be 'ns::op' or 'ns::op.overload' names, ops or "
                    f"callables, got {op!r}; e.g. 'mylib::attention'"
                )

    @property
    def effective_max_num_reqs(self) -> int:
        return self.max_num_reqs or self.max_cudagraph_capture_size

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None) -> CompilationConfig:
        """Validate a user's options dict; unknown keys are rejected with the valid ones."""
        opts = dict(options or {})
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(opts) - set(valid))
        if unknown:
            raise ConfigError(f"unknown option(s) {unknown}; valid options: {valid}")
        if "cudagraph_mode" in opts:
            opts["cudagraph_mode"] = CUDAGraphMode.parse(opts["cudagraph_mode"])
        if opts.get("attention_cg_support") is not None:
            opts["attention_cg_support"] = AttentionCGSupport.parse(opts["attention_cg_support"])
        if opts.get("splitting_ops") is not None:
            opts["splitting_ops"] = _as_tuple("splitting_ops", opts["splitting_ops"])
        if "compile_sizes" in opts:
            sizes = _as_tuple("compile_sizes", opts["compile_sizes"])
            # sort only ints: mixed types would raise TypeError before __post_init__ explains
            opts["compile_sizes"] = tuple(sorted(set(sizes))) if _all_ints(sizes) else sizes
        _fill_capture_sizes(opts)
        return cls(**opts)


def _fill_capture_sizes(opts: dict[str, Any]) -> None:
    """A user list is de-duplicated and sorted and sets the max; a lone max sets the defaults."""
    sizes = opts.get("cudagraph_capture_sizes")
    if sizes is None:
        max_size = opts.get("max_cudagraph_capture_size", 512)
        _check_int("max_cudagraph_capture_size", max_size, 1)
        opts["cudagraph_capture_sizes"] = default_capture_sizes(max_size)
        return
    sizes = _as_tuple("cudagraph_capture_sizes", sizes)
    if not sizes:
        raise ConfigError(
            "cudagraph_capture_sizes is empty; give sizes such as [1, 2, 4, 8], or use "
            "cudagraph_mode='NONE' for no graphs"
        )
    if _all_ints(sizes):
        sizes = tuple(sorted(set(sizes)))
    opts["cudagraph_capture_sizes"] = sizes
    if all(type(s) is int and s > 0 for s in sizes):
        opts.setdefault("max_cudagraph_capture_size", sizes[-1])


def _all_ints(values: tuple[Any, ...]) -> bool:
    return all(type(v) is int for v in values)


def _as_tuple(key: str, value: Any) -> tuple[Any, ...]:
    if isinstance(value, (list, tuple, set, frozenset)):
        return tuple(value)
    raise ConfigError(f"{key} must be a list, got {type(value).__name__} {value!r}")


def _check_int(key: str, value: Any, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise ConfigError(f"{key} must be an int >= {minimum}, got {value!r}")


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {list(choices)}, got {value!r}")
