"""Benchmark processes that prepare at the same time and time one at a time.

Compiling and capturing take most of a benchmark run's wall time and need no quiet machine;
timing needs one. With `CGBENCH_TURNS=DIR` set for every process of a run (`run_all.sh` sets it
when it runs stages side by side), each process marks itself as preparing (a file
`DIR/preparing-PID`) from `preparing()` until it enters `timing_turn()`, which waits until no
live process is preparing and then holds an exclusive lock on `DIR/lock` while it times. A
process that prepares again after a turn calls `preparing()` again. Without the variable both
do nothing, so a benchmark run alone behaves as before.

Turns keep compiles off the CPU while a process times, not the other processes' CUDA contexts
off the GPU: with a dozen idle ones alive, host time per call read 2-5x high on the H200 machine
(bare replay included), so host-time benchmarks run alone; peers timed in turns inside one
process (decode loop, generate()) compare fairly, their absolute figures may read high.

    preparing()
    ... compile, capture, warm up ...
    with timing_turn():
        ... timed loops ...
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path


def _dir() -> Path | None:
    value = os.environ.get("CGBENCH_TURNS")
    return Path(value) if value else None


def preparing() -> None:
    """Mark this process as preparing: no process times until it enters its turn."""
    root = _dir()
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / "lock", "a") as lock:  # not while another process times
            fcntl.flock(lock, fcntl.LOCK_EX)
            (root / f"preparing-{os.getpid()}").touch()
            fcntl.flock(lock, fcntl.LOCK_UN)


def _others_preparing(root: Path) -> bool:
    for path in root.glob("preparing-*"):
        pid = int(path.name.split("-")[1])
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:  # died while preparing
            path.unlink(missing_ok=True)
            continue
        except PermissionError:
            pass
        return True
    return False


@contextlib.contextmanager
def timing_turn() -> Iterator[None]:
    """Wait until nobody prepares, then time alone (among the run's processes)."""
    root = _dir()
    if root is None:
        yield
        return
    (root / f"preparing-{os.getpid()}").unlink(missing_ok=True)
    with open(root / "lock", "a") as lock:
        while True:
            while _others_preparing(root):
                time.sleep(0.2)
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not _others_preparing(root):  # one may have started while we waited
                break
            fcntl.flock(lock, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
