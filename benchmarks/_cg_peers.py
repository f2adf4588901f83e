"""The cgcompile peers: `torch.compile(model, backend="cudagraph_modes", options=...)` for each
mode and piece compiler, with its cold start, and the headline cold start with default options.

    results = run_cgcompile(bench, "FULL_AND_PIECEWISE", "inductor")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks._harness import (
    Bench,
    Results,
    Workload,
    capture_sizes,
    cold_start,
    describe,
    release,
)
from benchmarks._timing import Step, memory_delta_mb, memory_snapshot, timed_call
from examples.llama import mark_batch

# Which batch kinds (uniform_decode hint) have their own graphs to capture in each mode.
SWEEP_HINTS = {
    "NONE": (),
    "PIECEWISE": (False,),
    "FULL": (False,),  # decode batches reuse the mixed full graph of their padded size
    "FULL_DECODE_ONLY": (True,),
    "FULL_AND_PIECEWISE": (True, False),
}


def cg_backend() -> str | Callable[..., Any]:
    """The name "cudagraph_modes" where the installed package's entry point registers it, else
    the backend function itself (a source checkout that was never pip-installed)."""
    if "cudagraph_modes" in torch._dynamo.list_backends(exclude_tags=()):
        return "cudagraph_modes"
    import cgcompile

    return cgcompile.cudagraph_modes


class CGCompileRun:
    """One torch.compile of the model with backend="cudagraph_modes" and its marked inputs."""

    def __init__(
        self, bench: Bench, options: dict[str, Any] | None, hint: int | None = None
    ) -> None:
        import cgcompile

        self.cg = cgcompile
        self.bench = bench
        self.hint = hint
        self.compiled = torch.compile(bench.model, backend=cg_backend(), options=options)

    def inputs(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh inputs with the batch dim marked dynamic (done for every new tensor)."""
        tokens, positions = self.bench.inputs(n)
        mark_batch(self.bench.s.cfg, tokens, positions, hint=self.hint)
        return tokens, positions

    def call(self, tokens: torch.Tensor, positions: torch.Tensor, uniform: bool = False) -> Any:
        with self.cg.batch_hint(uniform_decode=uniform):
            return self.compiled(tokens, positions)

    def cold_start(self, sizes: list[int], hints: tuple[bool, ...]) -> dict[str, Any]:
        return cold_start(self.bench, self.call, self.inputs, sizes, hints)

    def make_step(self, wl: Workload) -> Step:
        tokens, positions = self.inputs(wl.num_tokens)
        return lambda: self.call(tokens, positions, uniform=wl.uniform_decode)


def run_cgcompile(
    bench: Bench,
    mode: str,
    compiler: str,
    skip_module_guards: bool = False,
    hint: bool = False,
    partition: bool | None = None,
    pieces: bool = False,
) -> Results:
    """One cgcompile peer; `skip_module_guards` passes torch's
    `guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe` (Dynamo then checks
    sizes, inputs and global state per call, not the ~1800 guards on the module and its
    parameters), which shows how much of a step is Dynamo's guard check. `hint` marks the batch
    with `hint=` the largest capture size, so Inductor tunes the dynamic graph for it.
    `partition` (with the hint) picks the path: True, Inductor's graph partition
    (`cg/MODE/partition`); False, the FX split (`cg/MODE/fx-split`); None, the default (the
    partition where available). `pieces` (FX split, with the hint): FULL_AND_PIECEWISE's full
    graphs replay the split's pieces (`full_graph_compile='pieces'`, `cg/MODE/pieces`) instead
    of a whole-graph compile of their own."""
    options: dict[str, Any] = {
        "cudagraph_mode": mode,
        "compiler": compiler,
        "max_cudagraph_capture_size": bench.s.max_capture_size,
    }
    name = f"cg/{mode}/{compiler}"
    if partition is not None:
        name, hint = f"cg/{mode}/{'partition' if partition else 'fx-split'}", True
        options["use_inductor_graph_partition"] = partition
    if pieces:
        name, hint = f"cg/{mode}/pieces", True
        options.update(use_inductor_graph_partition=False, full_graph_compile="pieces")
    if skip_module_guards:
        name += "/skip-module-guards"
        options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
    described = {k: getattr(v, "__name__", v) for k, v in options.items()}
    if hint and partition is None and not pieces:
        name += "/hint"
    if hint:
        described["mark_dynamic_batch(hint=)"] = bench.s.max_capture_size
    # torch.compile pops guard_filter_fn out of options
    run = CGCompileRun(bench, options, hint=bench.s.max_capture_size if hint else None)
    cold = run.cold_start(capture_sizes(bench.s.max_capture_size), SWEEP_HINTS[mode])
    result = {"options": described, "cold_start": cold, **bench.measure(run.make_step)}
    return {name: result}


def run_cold_start_default(bench: Bench) -> Results:
    """The headline cold start: default options (FULL_AND_PIECEWISE, Inductor, max 512)."""
    run = CGCompileRun(bench, None)
    cold = run.cold_start(capture_sizes(512), SWEEP_HINTS["FULL_AND_PIECEWISE"])
    del run
    release()  # a fresh compile, so capture_all starts from no graph at all
    bulk = CGCompileRun(bench, None)
    first, one, decode = bulk.inputs(513), bulk.inputs(1), bulk.inputs(8)
    _, first_s = timed_call(lambda: bulk.call(*first), bench.s.device)
    # FULL_AND_PIECEWISE's full graphs have compiled code of their own: run it once, so
    # capture_all can record them (a compiled kernel's first run cannot be a capture)
    bulk.call(*decode, uniform=True)

    def batch1() -> None:  # batch 1's own graph, both kinds of batch
        bulk.call(*one)
        bulk.call(*one, uniform=True)

    _, batch1_s = timed_call(batch1, bench.s.device)
    before = memory_snapshot(bench.s.device)
    graphs, capture_s = timed_call(lambda: bulk.cg.capture_all(progress=False), bench.s.device)
    cold["capture_all"] = {
        "first_call_s": first_s,
        "batch1_call_s": batch1_s,
        "capture_s": capture_s,
        "graphs": graphs,
        **memory_delta_mb(before, memory_snapshot(bench.s.device)),
    }
    return {"cold_start_default": {"options": "defaults", **cold}}


def describe_backend() -> str:
    try:
        backend = cg_backend()
    except Exception as e:  # the report says why no cg/* peer ran
        return f"unavailable: {describe(e)}"
    if isinstance(backend, str):
        return "backend='cudagraph_modes' (entry point)"
    return "backend=cgcompile.cudagraph_modes (package not installed: no entry point)"
