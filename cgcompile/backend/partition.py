"""The Inductor graph-partition path: Dynamo's graph compiled once, whole, cut by Inductor.

Instead of splitting the FX graph (`passes.split`), Inductor compiles the whole graph, so its
fusions see across layers, and cuts the generated code into partitions at the splitting ops
(`custom_should_partition_ops`). The splitting ops run eagerly in Inductor's `call` between
partitions. Inductor hands each partition to a process-global hook
(`set_customized_partition_wrappers`), which wraps it here in a `PartitionAdapter` around a
PIECEWISE `CUDAGraphWrapper`. Steps of `compile_partitioned`:
1. set the hook (restoring any hook set before) and compile a copy of the graph with
   `compile_fx`, partitioning at the splitting ops' Inductor names plus `PARTITION_SALT`;
2. count the partitions the hook saw (0: the caller takes the FX split instead);
3. compile one more artifact per `compile_sizes` entry, with the batch fixed to it.
`unavailable_reason` says beforehand why this path cannot work for a graph, if it cannot.

    result = compile_partitioned(request)
    result.runnable(*args)     # Inductor's code; each partition replays from its own graphs
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx

from cgcompile.backend.build import BuildRequest
from cgcompile.backend.piece_artifacts import (
    PieceRunner,
    Specialized,
    compile_for_size,
    has_tuple_output,
)
from cgcompile.calls.partition_adapter import (
    FirstForward,
    PartitionAdapter,
    PartitionedGraph,
    WrapperFactory,
)
from cgcompile.passes.op_match import describe, spec_key

logger = logging.getLogger(__name__)

PARTITION_SALT = "cgcompile::__partition_wrapper_v1__"
"""Listed with the splitting ops in `custom_should_partition_ops`, where it matches no op. The
FX-graph cache key ignores whether a partition wrapper is set, so without the salt this path
could load an artifact compiled without one: no partitions, nothing wrapped, no error."""

_SDPA_KERNELS = tuple(
    f"aten::_scaled_dot_product_{kernel}"
    for kernel in (
        "flash_attention",
        "efficient_attention",
        "cudnn_attention",
        "flash_attention_for_cpu",
        "fused_attention_overrideable",
    )
)
"""What SDPA becomes in Inductor's graph (a fallback kernel per backend); SDPA's math backend
decomposes into matmuls instead, which no name can cut at."""


class RefusalRule(enum.Enum):
    """Why a graph asked for Inductor's partition gets the FX split instead."""

    TORCH_TOO_OLD = "partitioning at named ops needs torch >= 2.9.1"
    EAGER_COMPILER = "graph partition is done by Inductor, and compiler='eager' skips Inductor"
    NOT_ON_GPU = "Inductor forms partitions only in CUDA code"
    UNNAMED_SPLITTING_OP = "Inductor cuts partitions only at ops it knows by name"
    NO_PARTITION_FORMED = "Inductor formed no partition to wrap"
    NO_PIECEWISE_GRAPHS = "the resolved mode has no piecewise graphs, so nothing is split"


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why Inductor's partition does not serve a graph: the rule, and what was seen."""

    rule: RefusalRule
    cause: str

    def __str__(self) -> str:
        return f"{self.rule.name}: {self.cause}; {self.rule.value}"


@dataclasses.dataclass
class PartitionedCompile:
    runnable: Callable[..., Any]
    """The compiled graph, called like the Dynamo graph: `runnable(*args)`."""
    num_partitions: int
    """Partitions wrapped in the general (symbolic batch) artifact; 0 means none formed."""
    num_compilations: int
    """Inductor compiles run: 1 + one per compile size."""


def has_partition_api() -> bool:
    """Whether this torch can partition at named ops and wrap partitions (2.9.1+)."""
    from torch._inductor import config as inductor_config
    from torch._inductor import utils

    return hasattr(inductor_config, "custom_should_partition_ops") and hasattr(
        utils, "set_customized_partition_wrappers"
    )


def gpu_input_reason(example_inputs: Sequence[Any]) -> str | None:
    """None when an input lives on CUDA; else where the inputs are. Inductor makes every
    non-GPU node a partition boundary, so a CPU graph never forms a partition."""
    devices = sorted({t.device.type for t in example_inputs if isinstance(t, torch.Tensor)})
    if "cuda" in devices:
        return None
    return f"the graph's inputs are on {', '.join(devices) or 'no device'}"


def inductor_op_names(specs: Sequence[Any]) -> tuple[list[str], list[str]]:
    """(names Inductor can partition at, readable names of the specs that have none)."""
    names: list[str] = []
    unnamed: list[str] = []
    for spec in specs:
        key = spec_key(spec)
        if isinstance(key, str):
            names.append(key)
        elif key is torch._C._nn.scaled_dot_product_attention:
            names.extend(_SDPA_KERNELS)
        else:
            unnamed.append(describe(key))
    return names, unnamed


def unavailable_reason(request: BuildRequest) -> Refusal | None:
    """Why the partition path cannot (or need not) serve this graph, or None when it can."""
    config = request.config
    if not request.mode.has_piecewise_cudagraphs():
        return Refusal(RefusalRule.NO_PIECEWISE_GRAPHS, f"mode {request.mode}")
    if not has_partition_api():
        cause = f"torch {torch.__version__} has no inductor config custom_should_partition_ops"
        return Refusal(RefusalRule.TORCH_TOO_OLD, cause)
    if config.compiler != "inductor":
        return Refusal(RefusalRule.EAGER_COMPILER, f"compiler={config.compiler!r}")
    where = gpu_input_reason(request.example_inputs)
    if where is not None:
        return Refusal(RefusalRule.NOT_ON_GPU, where)
    _, unnamed = inductor_op_names(request.specs)
    if unnamed:
        cause = f"splitting ops {unnamed} are Python callables, not torch ops"
        return Refusal(RefusalRule.UNNAMED_SPLITTING_OP, cause)
    return None


def partition_config_patches(op_names: Sequence[str]) -> dict[str, Any]:
    """Inductor config for a partitioned compile, whatever the process-wide settings."""
    return {
        "graph_partition": True,
        "custom_should_partition_ops": [*op_names, PARTITION_SALT],
        "triton.cudagraphs": False,  # our wrappers capture, not cudagraph trees
        "triton.cudagraph_skip_dynamic_graphs": False,  # else it cuts at every dynamic node
        "cpp_wrapper": False,  # Inductor's C++ wrapper does not support partitions
        # With reuse, a partition may write its output into an input it frees; a second run
        # on the same inputs (warm-up, then capture and replay) then reads clobbered data, and
        # the simulated runtime cannot undo such writes (they bypass version counters).
        "allow_buffer_reuse": False,
        "inplace_buffers": False,
    }


@contextlib.contextmanager
def partition_wrappers(hook: Callable[[Any, Any], Any]) -> Iterator[None]:
    """Install `hook` as Inductor's partition wrapper; put back whatever was set before."""
    from torch._inductor import utils

    previous = utils._unstable_customized_partition_wrapper.wrapper
    utils.set_customized_partition_wrappers(hook)
    try:
        yield
    finally:
        utils.set_customized_partition_wrappers(previous)


def compile_partitioned(request: BuildRequest) -> PartitionedCompile:
    """Compile the whole graph with partitions at the splitting ops, each wrapped PIECEWISE."""
    from torch._inductor.compile_fx import compile_fx

    patches = partition_config_patches(inductor_op_names(request.specs)[0])
    inputs = list(request.example_inputs)
    general, count = _compile_wrapped(
        lambda g: compile_fx(g, inputs, config_patches=patches),
        request.gm,
        request.make_wrapper,
        "partition",
    )
    plan, sizes = request.plan, request.config.compile_sizes
    if count == 0 or not (sizes and plan.size_indices):
        return PartitionedCompile(general, count, 1)
    runner = PieceRunner(general)
    runner.size_index = plan.size_indices[0]
    for size in sizes:
        runner.by_size[size] = _compile_for_size(request, size, patches)
    return PartitionedCompile(runner, count, 1 + len(runner.by_size))


def _compile_for_size(request: BuildRequest, size: int, patches: dict[str, Any]) -> Specialized:
    """The artifact for batch `size` (other sizes as traced), with its own wrapped partitions."""
    gm = request.gm
    fake_args = [_example_value(n) for n in gm.graph.find_nodes(op="placeholder")]
    as_tuple = has_tuple_output(gm)
    batch_exprs = request.plan.batch_exprs
    specialized: list[Specialized] = []

    def compile_fn(g: fx.GraphModule) -> Callable[..., Any]:
        with torch._inductor.config.patch(patches):
            specialized.append(compile_for_size(g, fake_args, size, batch_exprs, as_tuple))
        return specialized[0].fn

    compiled, _ = _compile_wrapped(compile_fn, gm, request.make_wrapper, f"size{size}.partition")
    return Specialized(compiled, specialized[0].layout)


def _compile_wrapped(
    compile_fn: Callable[[fx.GraphModule], Callable[..., Any]],
    gm: fx.GraphModule,
    make_wrapper: WrapperFactory,
    prefix: str,
) -> tuple[PartitionedGraph, int]:
    """Run one compile with the hook set; returns the artifact and its wrapped partitions."""
    first_forward = FirstForward()
    adapters: list[PartitionAdapter] = []

    def hook(partition: Callable[[list[Any]], Any], meta: Any) -> PartitionAdapter:
        index = meta.partition_index
        adapter = PartitionAdapter(
            partition, index, meta.num_partitions, first_forward, make_wrapper, f"{prefix}_{index}"
        )
        adapters.append(adapter)
        return adapter

    with partition_wrappers(hook):
        compiled = compile_fn(_copy_graph(gm))  # compile_fx may rewrite the graph it is given
    first_forward.unclassified = len(adapters)
    logger.debug("%s: Inductor formed %d wrapped partitions", prefix, len(adapters))
    return PartitionedGraph(compiled, first_forward), len(adapters)


def _copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A new module over a copy of the graph, sharing attributes; the FX split may follow."""
    copied = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    copied.meta.update(gm.meta)
    return copied


def _example_value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))
