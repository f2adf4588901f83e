"""What torch's compile caches did during this process's compiles: their hits and misses per
graph (the report's `inductor_cache`), and whether a compile cache loaded by
`cgcompile.load_compile_cache` lacked some compile since, said once at WARNING. And the keys
those caches hash torch's and Triton's sources into, computed once per process (reading and
hashing files: ~0.5 s on the H100 machine, at a precompiled load's first piece), started in a
thread beside the work before the first compile (`prefetch_source_keys`: a load's unpickle, a
cold compile's analyses and split; hashing releases the GIL) and waited for before it.

    before = inductor_cache_counts()
    ...                                         # compile one graph
    hits, misses = cache_delta(before, inductor_cache_counts())
"""

from __future__ import annotations

import dataclasses
import logging
import threading

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


_prefetch: threading.Thread | None = None


def prefetch_source_keys() -> None:
    """Start computing Inductor's source keys in a thread (once per process)."""
    global _prefetch
    if _prefetch is not None:
        return
    from torch._inductor import codecache

    keys = [codecache.torch_key]
    try:
        from torch._inductor.runtime.triton_compat import HAS_TRITON, triton_key

        keys += [triton_key] if HAS_TRITON else []
    except ImportError:  # a torch without this module: its own call computes the key
        pass

    def compute() -> None:
        for key in keys:
            try:
                key()
            except Exception:  # the compile that needs it computes it and raises there
                logger.debug("prefetching %s failed", key, exc_info=True)

    _prefetch = threading.Thread(target=compute, name="cgcompile-source-keys", daemon=True)
    _prefetch.start()


def source_keys_ready() -> None:
    """Wait for `prefetch_source_keys` (torch's caches of the keys take no lock on every
    version: a compile meanwhile would hash the sources again)."""
    if _prefetch is not None:
        _prefetch.join()
