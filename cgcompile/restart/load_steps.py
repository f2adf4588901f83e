"""The steps of a precompiled load, timed: what `Precompiled.load_steps` reports.

A load (`saved_file.load`) runs, in seconds per step:
- `read`: the file's bytes; `header`: its header checked against this process;
- `unpickle`: the payload (Inductor's artifacts and the saved functions, still as bytes);
- `inductor artifacts`: `torch.compiler.load_cache_artifacts` (into this process's caches);
- per saved function, inside torch's loader (`load_compiled_function`): `graph unpickle` (the
  saved Dynamo graph, `SavedGraph`), `rebuild` (the backend on that graph: split, analyses,
  wrappers, and the pieces' Inductor compiles, every one a cache hit: `rebuild: pieces`), and
  `torch's loader` (the rest: Dynamo's bytecode and guards).

The steps of the load under way are collected in a context variable, which `SavedGraph` adds to
from inside torch's loader; outside a load nothing is collected.

    with collecting() as steps:
        with step("read"):
            data = path.read_bytes()
    steps  # {"read": 0.004}
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator

_STEPS: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar(
    "cgcompile_load_steps", default=None
)


@contextlib.contextmanager
def collecting() -> Iterator[dict[str, float]]:
    """Collect the timed steps of the block into the dict it yields."""
    steps: dict[str, float] = {}
    token = _STEPS.set(steps)
    try:
        yield steps
    finally:
        _STEPS.reset(token)


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    """Add the block's wall time to step `name` of the load being collected, if any."""
    start = time.perf_counter()
    try:
        yield
    finally:
        add(name, time.perf_counter() - start)


def add(name: str, seconds: float) -> None:
    """Add `seconds` to step `name` of the load being collected (nothing outside a load)."""
    steps = _STEPS.get()
    if steps is not None:
        steps[name] = steps.get(name, 0.0) + seconds


def inside_torch(steps: dict[str, float]) -> dict[str, float]:
    """`steps` with `torch's loader` less the parts of it cgcompile timed itself (`graph
    unpickle` and `rebuild` ran inside it), so the steps but `rebuild: pieces` (a part of
    `rebuild`) add up to the load."""
    ours = steps.get("graph unpickle", 0.0) + steps.get("rebuild", 0.0)
    if "torch's loader" in steps:
        steps = {**steps, "torch's loader": max(steps["torch's loader"] - ours, 0.0)}
    return steps


def describe(steps: dict[str, float]) -> str:
    """`read 0.01 s, header 0.00 s, ...`, in the order the steps ran."""
    return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in steps.items())
