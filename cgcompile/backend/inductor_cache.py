"""What torch's compile caches did during this process's compiles: their hits and misses per
graph (the report's `inductor_cache`), and whether a compile cache loaded by
`cgcompile.load_compile_cache` lacked some compile since, said once at WARNING.

    before = inductor_cache_counts()
    ...                                         # compile one graph
    hits, misses = cache_delta(before, inductor_cache_counts())
"""

from __future__ import annotations

import dataclasses
import logging

from torch._dynamo.utils import counters as torch_counters

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Loaded:
    """The file this process loaded and the cache misses before its first compile."""

    path: str
    misses_before: int
    warned: bool = False


_loaded: list[_Loaded] = []
"""Process-wide, like torch's caches: the loads of this process (the last one is checked)."""


def note_loaded(path: str) -> None:
    """A compile cache was loaded from `path`: the compiles from now on should all be hits."""
    _loaded.append(_Loaded(path, _misses()))


def inductor_cache_counts() -> tuple[int, int, int, int]:
    """(hits, misses) of AOTAutograd's cache, then of Inductor's FX-graph cache, in this
    process so far."""
    autograd, inductor = torch_counters["aot_autograd"], torch_counters["inductor"]
    return (
        autograd["autograd_cache_hit"],
        autograd["autograd_cache_miss"],
        inductor["fxgraph_cache_hit"],
        inductor["fxgraph_cache_miss"],
    )


def cache_delta(
    before: tuple[int, int, int, int], after: tuple[int, int, int, int]
) -> tuple[int, int]:
    """(hits, misses) of the compiles between two `inductor_cache_counts`: AOTAutograd's cache
    where it was consulted (under torch's AOT compile it bundles Inductor's output, and the
    FX-graph cache is not asked), else the FX-graph cache's."""
    d = [a - b for a, b in zip(after, before, strict=True)]
    return (d[0], d[1]) if d[0] or d[1] else (d[2], d[3])


def _misses() -> int:
    counts = inductor_cache_counts()
    return counts[1] + counts[3]


def note_compiled(graph_id: int) -> None:
    """After a backend compile: if a loaded cache lacked some of this process's compiles since,
    say so once (the model code, options or configuration differ from the saving process)."""
    if not _loaded or _loaded[-1].warned:
        return
    loaded = _loaded[-1]
    missed = _misses() - loaded.misses_before
    if missed > 0:
        loaded.warned = True
        logger.warning(
            "graph %d: the compile cache loaded from %s lacked %d of the compiles since (the "
            "model code, the options or torch's configuration differ from the process that "
            "saved it): compiled them anew; save the cache again after this run",
            graph_id,
            loaded.path,
            missed,
        )
