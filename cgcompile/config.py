"""Modes, attention support levels and the one configuration object.

`CUDAGraphMode` names what gets captured; the two composite modes are pairs
(decode mode, mixed mode). `AttentionCGSupport` is what an attention op can tolerate inside a
full graph. `CompilationConfig.from_options(options)` validates the `options` dict a user passes
to `torch.compile(..., backend="cudagraph_modes", options=...)`; `validate_options` is the same
check for users, before the first call. Each field's check lives in `cgcompile.options`.

    config = CompilationConfig.from_options({"cudagraph_mode": "piecewise"})
    config.cudagraph_capture_sizes[:4]    # (1, 2, 4, 8)
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from cgcompile.errors import ConfigError, ConfigTypeError
from cgcompile.options import (
    MAX_CAPTURE_SIZE,
    MAX_WARMUPS,
    TORCH_COMPILE_KEYS,
    as_choice,
    as_int,
    as_op_specs,
    as_options_dict,
    as_sizes,
    parse_enum,
    show,
)


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
        """The runtime mode for uniform decode batches."""
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        """The runtime mode for mixed (prefill) batches."""
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def has_mode(self, mode: CUDAGraphMode) -> bool:
        """Whether `mode` is the decode or the mixed runtime mode of this mode."""
        return mode in (self.decode_mode(), self.mixed_mode())

    def has_full_cudagraphs(self) -> bool:
        """Some batches replay one whole-model graph."""
        return self.has_mode(CUDAGraphMode.FULL)

    def has_piecewise_cudagraphs(self) -> bool:
        """Some batches replay per-piece graphs, attention running eagerly between them."""
        return self.has_mode(CUDAGraphMode.PIECEWISE)

    def requires_piecewise_compilation(self) -> bool:
        """The graph must be split at the splitting ops."""
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
        """NONE, PIECEWISE and FULL: the modes a single batch runs in."""
        return frozenset({cls.NONE, cls.PIECEWISE, cls.FULL})

    @classmethod
    def parse(cls, value: CUDAGraphMode | str, key: str = "cudagraph_mode") -> CUDAGraphMode:
        """A member, or its name in any case; else a ConfigError naming `key`."""
        return parse_enum(cls, value, key)

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
        """A member, or its name in any case; else a ConfigError naming `key`."""
        return parse_enum(cls, value, key)

    def __str__(self) -> str:
        return self.name


OpSpec = str | torch._ops.OpOverload | torch._ops.OpOverloadPacket | Callable[..., Any]


_INT_FIELDS: dict[str, tuple[int, int, str]] = {
    "max_cudagraph_capture_size": (
        1,
        MAX_CAPTURE_SIZE,
        "e.g. 512 (the default); larger batches run without graphs",
    ),
    "max_num_reqs": (1, MAX_CAPTURE_SIZE, "e.g. 256, or None for the largest capture size"),
    "uniform_decode_query_len": (1, MAX_CAPTURE_SIZE, "1 + speculative tokens per request, e.g. 1"),
    "num_warmups": (0, MAX_WARMUPS, "e.g. 1 (the default)"),
}
"""Int fields: (minimum, maximum, what to give instead)."""
_CHOICES = {
    "compiler": ("inductor", "eager"),
    "graph_runtime": ("auto", "cuda", "simulated"),
    "full_graph_compile": ("whole", "pieces"),
    "batch_one": ("padded", "own"),
}


def default_capture_sizes(max_size: int) -> tuple[int, ...]:
    """1, 2, 4, multiples of 8 up to 64, then four sizes per doubling (a step of a quarter of the
    power of two below, at most 256), up to max_size, which is always included.

    Up to 512 that is 23 sizes: 1, 2, 4, 8, 16, ..., 64, 80, 96, 112, 128, 160, ..., 448, 512.
    A batch pads by at most a quarter of its size above 64 tokens, where a step's time grows
    slowly with its tokens; small batches, where padding costs the most, keep fine steps.
    """
    sizes = [1, 2, 4, *range(8, 65, 8)]
    power = 64
    while sizes[-1] < max_size:
        step = min(power // 4, 256)
        sizes += range(power + step, 2 * power + 1, step)
        power *= 2
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
    split is used with a WARNING; None: where available, falling back quietly (INFO); False
    (default): always the FX split."""
    full_graph_compile: Literal["whole", "pieces"] = "pieces"
    """What FULL_AND_PIECEWISE's full graphs replay on the FX split with Inductor. 'pieces'
    (default): the piecewise graphs' compiled pieces, captured as one graph (no extra compile;
    decode steps 0.99x FULL's, `passes.output_addmm`); 'whole': a second Inductor compile of the
    unsplit graph, fused across attention as in FULL (about twice the pieces' compile time at
    the first call). The partition path always replays its one whole compile."""
    batch_one: Literal["padded", "own"] = "padded"
    """Batches of 1 of a backed dynamic batch (Dynamo traces size 1 apart). 'padded': where that
    graph is the dynamic graph at batch 1 (checked node by node), the dynamic graph's compile and
    graphs serve it, padded to 2 rows; 'own': it compiles and captures on its own."""
    num_warmups: int = 1
    """Eager runs before each capture (allocator, autotuning, lazy init)."""
    graph_runtime: Literal["auto", "cuda", "simulated"] = "auto"
    """'auto': CUDA graphs on CUDA inputs, none otherwise; 'simulated': CPU graph semantics."""
    attention_cg_support: AttentionCGSupport | None = None
    """Override of the support level found from the graph's attention ops."""

    def __post_init__(self) -> None:
        self._normalize()
        if self.cudagraph_capture_sizes and self.cudagraph_capture_sizes[-1] != (
            self.max_cudagraph_capture_size
        ):
            raise ConfigError(
                f"max_cudagraph_capture_size={self.max_cudagraph_capture_size} disagrees with "
                f"the largest of cudagraph_capture_sizes={list(self.cudagraph_capture_sizes)}; "
                f"give one of the two, or make the max equal the largest size"
            )
        if (
            self.cudagraph_mode == CUDAGraphMode.FULL
            and self.attention_cg_support == AttentionCGSupport.NEVER
        ):
            raise ConfigError(
                "cudagraph_mode=FULL needs attention inside full graphs, but "
                "attention_cg_support=NEVER; use cudagraph_mode='PIECEWISE' (attention runs "
                "eagerly between pieces) or a higher support level"
            )

    def _normalize(self) -> None:
        """Check every field and store its canonical form (enums, lower case, sorted tuples)."""
        values = {
            "cudagraph_mode": CUDAGraphMode.parse(self.cudagraph_mode),
            "splitting_ops": as_op_specs("splitting_ops", self.splitting_ops),
            "cudagraph_capture_sizes": as_sizes(
                "cudagraph_capture_sizes", self.cudagraph_capture_sizes
            ),
            "compile_sizes": as_sizes("compile_sizes", self.compile_sizes),
            "use_inductor_graph_partition": _as_partition(self.use_inductor_graph_partition),
        }
        for key, (minimum, maximum, fix) in _INT_FIELDS.items():
            value = getattr(self, key)
            if value is not None or key != "max_num_reqs":
                values[key] = as_int(key, value, minimum, maximum, fix)
        for key, choices in _CHOICES.items():
            values[key] = as_choice(key, getattr(self, key), choices)
        if self.attention_cg_support is not None:
            values["attention_cg_support"] = AttentionCGSupport.parse(self.attention_cg_support)
        for key, value in values.items():
            object.__setattr__(self, key, value)

    @property
    def effective_max_num_reqs(self) -> int:
        """`max_num_reqs`, or the largest capture size when that is None."""
        return self.max_num_reqs or self.max_cudagraph_capture_size

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None) -> CompilationConfig:
        """Validate a user's options dict; unknown keys are rejected with the valid ones.

        Every bad value raises a `ConfigError` naming the key, the value and a fix, before
        anything is allocated. `cgcompile.validate_options` is the public front door.
        """
        opts = as_options_dict(options, [f.name for f in dataclasses.fields(cls)])
        _fill_capture_sizes(opts, cls.max_cudagraph_capture_size)
        return cls(**opts)


def _fill_capture_sizes(opts: dict[str, Any], default_max: int) -> None:
    """A user list is de-duplicated and sorted and sets the max; a lone max sets the defaults."""
    sizes = opts.get("cudagraph_capture_sizes")
    if sizes is None:
        key = "max_cudagraph_capture_size"
        max_size = as_int(key, opts.get(key, default_max), *_INT_FIELDS[key])
        opts["cudagraph_capture_sizes"] = default_capture_sizes(max_size)
        return
    sizes = as_sizes("cudagraph_capture_sizes", sizes)
    if not sizes:
        raise ConfigError(
            "cudagraph_capture_sizes is empty; give sizes such as [1, 2, 4, 8], or use "
            "cudagraph_mode='NONE' for no graphs"
        )
    opts["cudagraph_capture_sizes"] = sizes
    opts.setdefault("max_cudagraph_capture_size", sizes[-1])


def validate_options(options: Mapping[str, Any] | None = None) -> CompilationConfig:
    """Check the `options` of `torch.compile(..., backend="cudagraph_modes", options=...)` now.

    torch.compile hands options to the backend only when the first call is compiled, and an
    error there arrives wrapped in Dynamo's `BackendCompilerFailed`. Call this first to get the
    `ConfigError` (key, value, fix) at once; it returns the config the backend will use. Keys
    that torch.compile consumes itself (`guard_filter_fn`, `use_aoti`) are ignored.

        config = cgcompile.validate_options(options)
        compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    """
    if isinstance(options, Mapping):
        options = {k: v for k, v in options.items() if k not in TORCH_COMPILE_KEYS}
    return CompilationConfig.from_options(options)


def _as_partition(value: Any) -> bool | None:
    """True, False, or None ("where available")."""
    if value is None or isinstance(value, bool):
        return value
    raise ConfigTypeError(
        f"use_inductor_graph_partition must be True, False or None (where available), got "
        f"{show(value)}"
    )
