"""Which thread may use a compiled graph's CUDA graphs: the thread contract.

A compiled graph's CUDA graphs share static input buffers, and a replay's outputs are the
graph's memory until the next replay. Two threads replaying at once would overwrite each
other's inputs and outputs. So the graphs belong to one thread, the *owner*: the first thread
that calls the compiled graph. Calls from any other thread run the traced graph eagerly, on
their own tensors, sharing nothing (the backend warns once). When the owner thread has ended,
the next caller becomes the owner. `capture_all` captures only graphs the calling thread owns
or may take.

    owner = ThreadOwner()
    if owner.ident == threading.get_ident() or owner.claim(): ...   # replay graphs
"""

from __future__ import annotations

import threading


class ThreadOwner:
    """The owner thread of one compiled graph; `ident` is read on every call, unlocked."""

    def __init__(self) -> None:
        self.ident: int | None = None
        """`threading.get_ident()` of the owner, None before the first call."""
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def claim(self) -> bool:
        """Whether the calling thread owns the graphs now: it did, or nobody (alive) did."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.current_thread()
                self.ident = threading.get_ident()
            return self.ident == threading.get_ident()

    @property
    def name(self) -> str:
        return self._thread.name if self._thread is not None else "none"
