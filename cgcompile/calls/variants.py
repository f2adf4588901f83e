"""A bounded number of graphs for the int inputs that are not the batch size.

Dynamo turns an int argument that changes between calls into a symbolic size (a sequence
length, or a Llama-style `start_pos`), and every distinct value is a graph key of its own. The
batch size is bounded by the capture sizes; these are not. Nor are the values of host scalars
(`InputPlan.host_scalars`: a float Dynamo passes as a CPU tensor, read on the host while a CUDA
graph is captured, so each value needs graphs of its own), nor the addresses of the state sized
by the batch (`InputPlan.batch_state`: a cache per batch size passed at a static address, whose
address a graph bakes in: another cache of the same size needs graphs of its own, or the graph
would write the first one). `SizeVariants` admits the first `MAX_SIZE_VARIANTS` distinct tuples
of int and scalar values, and the first `MAX_STATE_VARIANTS` distinct state addresses (a set per
cache size), to graphs; calls with further values run without graphs (the backend warns once,
naming the inputs).

    variants = SizeVariants(positions=(5,), host=())    # e.g. L['start_pos']
    variants.admits(variants.key(args))                 # False from the 9th distinct value on
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MAX_SIZE_VARIANTS = 8
"""Distinct values of a graph's non-batch int inputs that get graphs."""
MAX_STATE_VARIANTS = 64
"""Distinct address sets of a graph's batch-sized state that get graphs (one per cache size,
and more for further caches of a size)."""


class SizeVariants:
    """The values of non-batch int inputs and the state addresses that have (or may get) graphs."""

    def __init__(
        self, positions: Sequence[int], host: Sequence[int] = (), state: Sequence[int] = ()
    ) -> None:
        self.positions = tuple(positions)
        self.host = tuple(host)
        self.state = tuple(state)
        self._values: set[tuple[Any, ...]] = set()
        self._states: set[tuple[Any, ...]] = set()

    def key(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """This call's values of the non-batch ints and host scalars, and its state's
        addresses."""
        if not (self.positions or self.host or self.state):
            return ()
        variant = tuple([args[i] for i in self.positions])
        if self.host:
            variant += tuple([args[i].item() for i in self.host])
        if self.state:
            variant += tuple([args[i].data_ptr() for i in self.state])
        return variant

    def admits(self, variant: tuple[Any, ...]) -> bool:
        """Whether these values (`key`) have graphs, or may get them (adding them if so)."""
        cut = len(variant) - len(self.state)
        values, state = variant[:cut], variant[cut:]
        if values and values not in self._values and len(self._values) >= MAX_SIZE_VARIANTS:
            return False
        if state and state not in self._states and len(self._states) >= MAX_STATE_VARIANTS:
            return False
        self._values.add(values)
        self._states.add(state)
        return True
