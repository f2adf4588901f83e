"""What a compile path is given (`BuildRequest`) and what it gives back (`Built`).

Two paths turn a Dynamo graph into a runnable with PIECEWISE wrappers: the FX split
(`fx_split`) and Inductor's graph partition (`partition`). The pipeline picks one, wraps the
result in a FULL wrapper if the mode has full graphs, and reports from `Built`.

    built = build_split(BuildRequest(gm, example_inputs, config, plan, mode, specs, make))
    built.runnable(*args)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

from cgcompile.calls.cuda_graph_wrapper import WrapperFactory
from cgcompile.calls.input_plan import InputPlan
from cgcompile.calls.report import FX_SPLIT, PieceInfo
from cgcompile.config import CompilationConfig, CUDAGraphMode


@dataclasses.dataclass(frozen=True)
class BuildRequest:
    gm: fx.GraphModule
    """Dynamo's graph; paths work on copies, so the other path can still follow."""
    example_inputs: Sequence[Any]
    config: CompilationConfig
    plan: InputPlan
    mode: CUDAGraphMode
    """The resolved mode."""
    specs: Sequence[Any]
    """The splitting ops."""
    make_wrapper: WrapperFactory
    """Builds each PIECEWISE wrapper (and keeps it for the report)."""


@dataclasses.dataclass
class Built:
    """A compiled graph before any FULL wrapper, and what the report and counters need."""

    runnable: Callable[..., Any]
    pieces: list[PieceInfo]
    counts: dict[str, int]
    """Counter deltas, applied once the whole compile succeeded."""
    path: str = FX_SPLIT
    num_partitions: int = 0
    partition_fallback: str | None = None
    """Why Inductor's partition was asked for but not used."""
    full_runnable: Callable[..., Any] | None = None
    """What full graphs capture, if not `runnable`: FULL_AND_PIECEWISE's whole-graph compile
    on the FX split (`full_graph_compile='whole'`)."""
    compile_parts: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds per part of the compile: 'pieces' and 'whole graph' (FX split with
    FULL_AND_PIECEWISE's whole-graph compile), for the report."""
    shapes_only: Callable[[], contextlib.AbstractContextManager[None]] | None = None
    """A context in which the eager splitting ops only compute shapes (`dry_run`), for
    recording PIECEWISE graphs without running anything; None where they cannot be replaced
    (inside Inductor's partitioned code)."""

    def full_graph_compile(self, mode: CUDAGraphMode) -> str | None:
        """What the full graphs of a mode with both kinds replay: 'whole' or 'pieces'."""
        if not (mode.has_full_cudagraphs() and mode.has_piecewise_cudagraphs()):
            return None
        return "pieces" if self.path == FX_SPLIT and self.full_runnable is None else "whole"
