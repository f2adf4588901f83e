"""Counters of the work the backend did, for tests and reports.

`counters` is the process-wide instance. Tests assert exact deltas:

    with counters.expect(num_cudagraph_captured=6):   # 2 sizes x 3 pieces
        run_model()
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator


@dataclasses.dataclass
class Counters:
    """Totals since the last `reset()`; `cgcompile.counters` is the one the backend updates."""

    num_graphs_seen: int = 0
    """Dynamo graphs handed to the backend."""
    num_graphs_shared: int = 0
    """Dynamo graphs served by another graph's compile instead of one of their own: a batch-1
    graph by the dynamic graph, padded to 2 rows (`batch_one="padded"`)."""
    num_piecewise_graphs_seen: int = 0
    """Pieces produced by splitting, splitting-op pieces included."""
    num_piecewise_capturable_graphs_seen: int = 0
    """Pieces without a splitting op: the ones compiled and captured piecewise."""
    num_backend_compilations: int = 0
    """Pieces handed to a compiler (Inductor or eager); identical pieces are compiled once."""
    num_inductor_partitions: int = 0
    """Partitions Inductor formed and the backend wrapped (`use_inductor_graph_partition`);
    each Dynamo graph on that path also counts one piece, capturable."""
    num_cudagraph_captured: int = 0
    """CUDA graphs captured (real or simulated)."""
    num_eager_fallbacks: int = 0
    """Batches run without any graph because none fit (too large, or no key for them)."""
    num_capture_failures: int = 0
    """Captures that failed; the key then runs eagerly."""

    def snapshot(self) -> dict[str, int]:
        """Every counter by name, as a new dict."""
        return dataclasses.asdict(self)

    def reset(self) -> None:
        """Set every counter to 0."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, 0)

    @contextlib.contextmanager
    def expect(self, **deltas: int) -> Iterator[None]:
        """Assert that the block changes each named counter by exactly the given delta."""
        unknown = sorted(set(deltas) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise AttributeError(f"unknown counters {unknown}; valid: {sorted(self.snapshot())}")
        before = self.snapshot()
        yield
        after = self.snapshot()
        wrong = {
            name: (after[name] - before[name], want)
            for name, want in deltas.items()
            if after[name] - before[name] != want
        }
        if wrong:
            detail = ", ".join(
                f"{k}: got +{got}, expected +{want}" for k, (got, want) in wrong.items()
            )
            raise AssertionError(f"counter deltas differ: {detail}")


counters = Counters()
