"""What the backend did for one graph, kept for inspection: `cgcompile.compiled_graphs()`.

for g in cgcompile.compiled_graphs():
    print(g.format_report())
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from cgcompile.calls.cuda_graph_wrapper import CUDAGraphWrapper
from cgcompile.calls.forward_context import BatchDescriptor
from cgcompile.calls.input_buffers import InputBuffers
from cgcompile.graphs import GraphRuntime

FX_SPLIT = "FX split"
INDUCTOR_PARTITION = "Inductor partition"


_FULL_GRAPHS = {
    "whole": "a compile of the whole graph (fused across attention)",
    "pieces": "the pieces of the split",
}


@dataclasses.dataclass
class PieceInfo:
    name: str
    capturable: bool
    ops: tuple[str, ...]
    """Splitting ops in this piece (empty for capturable pieces)."""
    shares_compile_with: str | None = None
    """An earlier piece with the same structure whose compiled artifact this one reuses."""


@dataclasses.dataclass
class GraphReport:
    graph_id: int
    requested_mode: str
    mode: str
    reasons: list[str]
    attention_ops: dict[str, str]
    """Attention ops found in the graph and their declared CUDA-graph support."""
    attention_support: str
    graph_runtime: str | None
    compiler: str
    pieces: list[PieceInfo]
    capture_sizes: list[int]
    compile_seconds: float
    compile_path: str = FX_SPLIT
    """FX_SPLIT (pieces compiled one by one) or INDUCTOR_PARTITION (one whole compile)."""
    num_partitions: int = 0
    """Partitions Inductor formed and cgcompile wrapped (Inductor partition path only)."""
    partition_fallback: str | None = None
    """Why `use_inductor_graph_partition` (True or None) did not give the partition path."""
    full_graph_compile: str | None = None
    """FULL_AND_PIECEWISE: what its full graphs replay: 'whole' (a compile of the unsplit graph,
    the partition path's or `full_graph_compile='whole'`) or 'pieces' (the split's pieces)."""
    compile_parts: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds of the parts of `compile_seconds` compiled apart ('pieces', 'whole graph')."""
    inductor_cache: tuple[int, int] = (0, 0)
    """(hits, misses) of the compile caches during this compile (AOTAutograd's where it was
    consulted, else Inductor's FX-graph cache): after `load_compile_cache` or a precompiled
    load, all hits."""
    precompiled: bool = False
    """Rebuilt from a `precompile` file: Dynamo traced nothing in this process."""
    num_eager_fallbacks: int = 0
    captured: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    """Graph keys captured so far, per runtime mode."""
    capture_seconds: float = 0.0
    graph_memory_bytes: int = 0
    static_input_bytes: int = 0
    pad_unsafe: str | None = None
    """Why batches are not padded (sizes between capture sizes run without graphs), if so."""
    serves_batch_one: bool = False
    """Whether it also serves Dynamo's batch-1 graph, padded to 2 rows (`batch_one`)."""
    batch_one_not_shared: str | None = None
    """A batch-1 graph compiled on its own: why no dynamic graph serves it."""

    def format(self) -> str:
        lines = [
            f"graph {self.graph_id}: mode {self.mode} (requested {self.requested_mode}), "
            f"runtime {self.graph_runtime or 'none'}, compiler {self.compiler}",
            f"  attention: {self.attention_ops or 'none'} -> support {self.attention_support}",
            f"  {self._format_path()}, compiled in {self.compile_seconds:.2f}s{self._parts()}",
        ]
        if self.precompiled:
            lines.append("  rebuilt from a precompiled file: no Dynamo trace in this process")
        if self.full_graph_compile:
            lines.append(f"  full graphs replay: {_FULL_GRAPHS[self.full_graph_compile]}")
        if self.partition_fallback:
            lines.append(f"  partition not used: {self.partition_fallback}")
        lines += [f"  downgrade: {r}" for r in self.reasons]
        if self.pad_unsafe:
            lines.append(f"  padding off: {self.pad_unsafe}")
        if self.serves_batch_one:
            lines.append("  also serves Dynamo's batch-1 graph, padded to 2 rows (no compile)")
        if self.batch_one_not_shared:
            lines.append(f"  batch-1 graph compiled on its own: {self.batch_one_not_shared}")
        for mode, keys in self.captured.items():
            lines.append(f"  captured {mode}: {len(keys)} graphs {keys}")
        lines.append(
            f"  capture {self.capture_seconds:.2f}s, graph memory "
            f"{self.graph_memory_bytes / 2**20:.1f} MiB, static inputs "
            f"{self.static_input_bytes / 2**20:.1f} MiB, eager fallbacks {self.num_eager_fallbacks}"
        )
        return "\n".join(lines)

    def _parts(self) -> str:
        parts = [f"{name} {s:.2f}s" for name, s in self.compile_parts.items()]
        hits, misses = self.inductor_cache
        if hits or misses:
            parts.append(f"compile cache {hits} hits, {misses} misses")
        return f" ({', '.join(parts)})" if parts else ""

    def _format_path(self) -> str:
        if self.num_partitions:
            return (
                f"{self.compile_path}: {self.num_partitions} partitions of one whole-graph compile"
            )
        n_cap = sum(p.capturable for p in self.pieces)
        shared = sum(p.shares_compile_with is not None for p in self.pieces)
        return (
            f"{self.compile_path}: {len(self.pieces)} pieces ({n_cap} capturable, "
            f"{shared} reuse a compile)"
        )


def describe_key(key: tuple[BatchDescriptor, tuple[int, ...], int]) -> str:
    """`24u24[24, 24]#1`: padded tokens, `u` and requests for uniform decode, the graph's int
    inputs unless they are just the token count, `#k` for the k-th module instance after the
    first."""
    desc, sizes, instance = key
    text = f"{desc.num_tokens}"
    if desc.uniform:
        text += f"u{desc.num_reqs}"
    text += f"{list(sizes)}" if sizes and sizes != (desc.num_tokens,) else ""
    return text + (f"#{instance}" if instance else "")


def live_report(
    report: GraphReport,
    wrappers: Sequence[CUDAGraphWrapper],
    runtime: GraphRuntime | None,
    input_buffers: InputBuffers,
) -> GraphReport:
    """`report` with the live figures filled in: captured keys per runtime mode, capture
    seconds, graph memory and static input bytes."""
    captured: dict[str, set[Any]] = {}
    for wrapper in wrappers:
        captured.setdefault(str(wrapper.runtime_mode), set()).update(wrapper.captured_keys())
    report.captured = {
        mode: [describe_key(k) for k in sorted(keys, key=lambda k: (k[2], k[0].num_tokens, k[1]))]
        for mode, keys in captured.items()
    }
    report.capture_seconds = sum(w.capture_seconds for w in wrappers)
    report.graph_memory_bytes = runtime.memory_bytes() if runtime else 0
    report.static_input_bytes = input_buffers.nbytes()
    return report
