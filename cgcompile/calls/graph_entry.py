"""What a `CUDAGraphWrapper` keeps per captured graph: its key and what its replays rely on.

entry = wrapper.entries[key]      # a `GraphEntry`; key: (batch descriptor, sizes, instance)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from cgcompile.calls.forward_context import BatchDescriptor
from cgcompile.graphs.graph_runtime import CapturedGraph

GraphKey = tuple[BatchDescriptor | None, tuple[int, ...], int]
"""(batch descriptor, dynamic sizes, module instance): the sizes are the forward context's
`shape_key`, else the call's int args, which carry the run-time values of symbolic sizes;
graphs for different non-batch sizes or module instances never mix."""


@dataclasses.dataclass
class GraphEntry:
    """One captured graph and what its replays rely on."""

    key: GraphKey
    graph: CapturedGraph
    input_layout: dict[int, tuple[int, torch.Size]]
    """Arg position -> (data_ptr, shape) the graph reads, for args not copied in."""
    static_inputs: tuple[tuple[int, torch.Tensor], ...]
    """(arg position, buffer owned by the entry) for copy_arg_indices; args are copied in."""
    capture_seconds: float
    verified: bool = False
    """Set once the first replay after capture found the inputs where the graph reads them."""
    addresses: tuple[tuple[int, int], ...] = ()
    """(arg position, data_ptr) that every replay in manual mode checks: the non-empty args of
    `input_layout` (an empty tensor has no data to read) but the wrapper's fixed args."""
    launch: Callable[[], Any] = dataclasses.field(init=False, repr=False, compare=False)
    """`graph.launch`, bound once: what the steady state calls (then it returns `output`)."""
    output: Any = dataclasses.field(init=False, repr=False, compare=False)
    """`graph.output`: what a replay writes."""

    def __post_init__(self) -> None:
        self.launch = self.graph.launch
        self.output = self.graph.output
