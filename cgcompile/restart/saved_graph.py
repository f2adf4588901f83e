"""A Dynamo graph compiled by `cudagraph_modes` that torch's AOT compile can save and load.

Under `torch.compile(...).aot_compile(...)` (torch >= 2.10) the backend must return a
`SerializableCallable`: torch saves Dynamo's bytecode and guards, and asks the backend's object
for bytes that rebuild it in another process, where no Dynamo trace runs. `saving_backend`
returns a `SavedGraph`: the compiled graph (a `CompiledGraph` or a `PaddedBatchOne`) plus, taken
before compiling, the Dynamo graph with the fake example values a rebuild reads
(`_values_read_on_load`: inputs, outputs, sizes, what crosses a piece boundary, the splitting
ops' arguments; `GraphPickler`), the options and
what the backend reads from the real example inputs beyond their fake values (pad values, a
batch dim other than 0, which inputs are parameters), and after compiling what the backend's
fake runs found (`backend.analyses.Analyses`). Loading rebuilds the fake example inputs from those
facts and runs the backend again on the same graph without those fake runs: its Inductor
compiles are cache lookups (the caller loads the saved Inductor artifacts first). A batch-1
graph that the saving process served by a dynamic graph (`backend.batch_one_sharing`) is saved
as its placeholders with their fake values, with where its batch sizes go and which dynamic
graph served it, and apart from them its nodes without metadata, which only a call in manual
mode runs (unpickled then: they cost a third of the example Llama's graph unpickle); loaded
after that graph, it is served by it again without matching the nodes.

    compiled = torch.compile(fn, backend=saving_backend(options), fullgraph=True)
    with torch._dynamo.config.patch(enable_aot_compile=True): ...   # see restart.precompile
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch._functorch.config
import torch._inductor.config
import torch.utils._pytree as pytree
from torch import fx
from torch._dynamo.aot_compile import SerializableCallable
from torch._dynamo.utils import (
    maybe_disable_inference_mode,
    maybe_disable_inference_mode_for_fake_prop,
)
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._graph_pickler import GraphPickler, Options
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from cgcompile.backend.attention import attention_ops
from cgcompile.backend.batch_one_sharing import code_digest, dynamic_gm_of, serve_matched_batch_one
from cgcompile.backend.entry import compile_dynamo_graph, cudagraph_modes
from cgcompile.backend.input_analysis import STATIC_ATTRIBUTE
from cgcompile.calls.compiled_graph import CompiledGraph
from cgcompile.calls.padded_batch_one import PaddedBatchOne
from cgcompile.config import CompilationConfig
from cgcompile.dynamic import BATCH_DIM_ATTRIBUTE, PAD_ATTRIBUTE
from cgcompile.passes.one_row import squeezed_input
from cgcompile.passes.op_match import OpMatcher
from cgcompile.passes.sdpa_masks import writes_first_arg
from cgcompile.passes.split import generated_forward, split_graph
from cgcompile.restart import load_steps

_DROPPED_META = ("source_fn_stack", "nn_module_stack")
"""Node metadata that holds module objects and classes; nothing in the backend reads it."""


_CACHE_KEYED_CONFIG = {
    torch._functorch.config: (
        "strict_autograd_cache",
        "bypass_autograd_cache_key",
        "bundled_autograd_cache",
        "force_non_lazy_backward_lowering",
        "force_autograd_cache",
    ),
    torch._inductor.config: ("enable_autograd_for_aot",),
}
"""Settings that torch's AOT compile sets around the backend and its loader sets otherwise, and
that AOTAutograd's cache keys include: the rebuild runs under the saving backend's values, so
its compiles find the saving process's cache entries."""
_CONFIGS = {module.__name__: module for module in _CACHE_KEYED_CONFIG}


class _Pickler(GraphPickler):
    """Torch's graph pickler, minus the fake mode a view's base still references (the loader
    supplies its own)."""

    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, FakeTensorMode):
            return type(None), ()
        return super().reducer_override(obj)


class SavedGraph(SerializableCallable):
    """A compiled Dynamo graph and the bytes that rebuild it (`state`)."""

    def __init__(self, compiled: Callable[..., Any], state: bytes) -> None:
        self.compiled = compiled
        self.state = state

    def __call__(self, *args: Any) -> Any:
        return self.compiled(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: SavedGraph) -> bytes:
        return fn.state

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> SavedGraph:
        state = pickle.loads(data)
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        with _slices_as_pytree_nodes(), load_steps.step("graph unpickle"):
            gm = GraphPickler.loads(state["graph"], fake_mode)
        examples = _examples(gm, state["facts"])
        with contextlib.ExitStack() as stack:
            stack.enter_context(load_steps.step("rebuild"))
            stack.enter_context(_compiling())
            stack.enter_context(tracing(TracingContext(fake_mode)))
            for module, values in state["config"].items():
                stack.enter_context(_CONFIGS[module].patch(values))
            config = CompilationConfig.from_options(state["options"])
            served = state.get("batch_one")
            if served is not None:
                traced = _unpickled_on_first_call(state["traced"])
                compiled = serve_matched_batch_one(gm, examples, config, *served, traced)
            else:
                compiled = compile_dynamo_graph(gm, examples, config, state["analyses"])
        if isinstance(compiled, CompiledGraph):
            compiled.report.precompiled = True
            load_steps.add("rebuild: pieces", compiled.report.compile_parts.get("pieces", 0.0))
        return cls(compiled, data)


def saving_backend(
    options: Mapping[str, Any] | None,
) -> Callable[[fx.GraphModule, Sequence[Any]], SavedGraph]:
    """A Dynamo backend that compiles as `cudagraph_modes` with `options` and returns a
    `SavedGraph`."""
    options = dict(options or {})

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> SavedGraph:
        _drop_meta(gm)
        # before compiling: passes annotate gm
        graph = _pickled(gm, _values_read_on_load(gm, options))
        with _compiling():
            compiled = cudagraph_modes(gm, example_inputs, options)
        state = _state(graph, example_inputs, options)
        state["analyses"] = getattr(compiled, "analyses", None)  # a batch-1 graph served: none
        if isinstance(compiled, PaddedBatchOne):  # its nodes run only in manual mode
            state["graph"] = _pickled(_placeholders_of(gm))
            state["traced"] = _pickled(gm, bare=True)
            state["batch_one"] = (
                compiled.size_positions,
                code_digest(dynamic_gm_of(compiled.graph)),
            )
        return SavedGraph(compiled, pickle.dumps(state))

    return backend


@contextlib.contextmanager
def _compiling() -> Iterator[None]:
    """Inference mode off (grad stays off) while the backend compiles, as Dynamo turns it off
    around a just-in-time compile but not around torch's AOT compile's backend call: fake runs
    of the graph read version counters, which inference tensors lack."""
    with maybe_disable_inference_mode(), maybe_disable_inference_mode_for_fake_prop():
        yield


def _drop_meta(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        for key in _DROPPED_META:
            node.meta.pop(key, None)


def _pickled(gm: fx.GraphModule, values: set[str] | None = None, bare: bool = False) -> bytes:
    """`gm` pickled with its nodes' metadata, but the example values of nodes not in `values`
    (None: all kept); or (`bare`) without any metadata."""
    saved = {}
    for node in gm.graph.nodes:
        if bare:
            saved[node], node.meta = node.meta, {}
        elif values is not None and node.name not in values and _VALUE_KEYS & node.meta.keys():
            saved[node] = node.meta
            node.meta = {k: v for k, v in node.meta.items() if k not in _VALUE_KEYS}
            node.meta["example_value"] = None  # AOTAutograd's cache asks only whether it is there
    try:
        with _slices_as_pytree_nodes():
            return _Pickler.dumps(gm, Options(ops_filter=None))
    finally:
        for node, meta in saved.items():
            node.meta = meta


_VALUE_KEYS = frozenset({"example_value", "val"})


def _placeholders_of(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm`'s placeholders alone: what a rebuild of a served batch-1 graph reads."""
    graph = fx.Graph()
    for node in gm.graph.find_nodes(op="placeholder"):
        graph.node_copy(node)
    graph.output(())
    return fx.GraphModule(torch.nn.Module(), graph)


def _unpickled_on_first_call(data: bytes) -> Callable[..., Any]:
    """The generated forward of the graph pickled in `data` (`_pickled(gm, bare=True)`),
    unpickled when first called: a load skips its nodes, a third of the load's graph unpickle
    on the example Llama."""
    forward: Callable[..., Any] | None = None

    def traced(*args: Any) -> Any:
        nonlocal forward
        if forward is None:
            with _slices_as_pytree_nodes():
                gm = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
            gm.recompile()  # an unpickled graph module has no code yet
            forward = generated_forward(gm)
        return forward(*args)

    return traced


def _values_read_on_load(gm: fx.GraphModule, options: Mapping[str, Any]) -> set[str]:
    """Names of the nodes whose example values a rebuild reads; the others' fake tensors were
    most of what a load unpickled. A rebuild
    runs no fake run (the saving process's analyses are reused), so it reads the inputs', the
    outputs', sizes and scalars, the values the split hands between pieces (each piece compiles
    with its placeholders' values), the splitting ops' and their arguments' (`sdpa_masks`, the
    shape-only stand-ins), what in-place ops write (`sdpa_masks` leaves written masks) and what
    squeezes take (`one_row`)."""
    config = CompilationConfig.from_options(options)
    matcher = OpMatcher(attention_ops() if config.splitting_ops is None else config.splitting_ops)
    values = set()
    for node in gm.graph.nodes:
        value = node.meta.get("example_value", node.meta.get("val"))
        if node.op in ("placeholder", "output") or not isinstance(value, torch.Tensor):
            values.add(node.name)
        if node.op == "output" or matcher.matches(node):
            values.add(node.name)
            values.update(n.name for n in node.all_input_nodes)
        if writes_first_arg(node) and node.args and isinstance(node.args[0], fx.Node):
            values.add(node.args[0].name)
        squeezed = squeezed_input(node)
        if squeezed is not None:
            values.add(squeezed.name)
    for item in split_graph(gm, matcher).items:  # a copy of gm: gm stays as it is
        values.update(n.name for n in item.graph.graph.find_nodes(op="placeholder"))
    return values


@contextlib.contextmanager
def _slices_as_pytree_nodes() -> Iterator[None]:
    """Slices as pytree nodes while a graph is pickled or unpickled. Torch's graph pickler maps
    the nodes in a node's arguments with pytree, and a slice can hold one: `cache[:n]` with a
    dynamic `n` is `getitem(cache, slice(None, sym_size_int))`. Newer torch registers slices
    there itself; torch 2.11 does not, and fails with "Unexpected raw Node during pickling"."""
    if slice in pytree.SUPPORTED_NODES:
        yield
        return
    pytree._private_register_pytree_node(
        slice, lambda s: ([s.start, s.stop, s.step], None), lambda bounds, _: slice(*bounds)
    )
    try:
        yield
    finally:
        pytree._deregister_pytree_node(slice)


def _state(graph: bytes, example_inputs: Sequence[Any], options: dict[str, Any]) -> dict[str, Any]:
    config = {
        module.__name__: {key: getattr(module, key) for key in keys if hasattr(module, key)}
        for module, keys in _CACHE_KEYED_CONFIG.items()
    }
    return {"graph": graph, "facts": _facts(example_inputs), "options": options, "config": config}


def _facts(example_inputs: Sequence[Any]) -> dict[int, dict[str, Any]]:
    """Per input index, what the backend reads from a real example input: its pad value, a
    batch dim other than 0, and whether it is a parameter (its address is static)."""
    facts: dict[int, dict[str, Any]] = {}
    for i, value in enumerate(example_inputs):
        fact = {
            name: getattr(value, name)
            for name in (PAD_ATTRIBUTE, BATCH_DIM_ATTRIBUTE)
            if hasattr(value, name)
        }
        if isinstance(value, torch.nn.Parameter):
            fact[STATIC_ATTRIBUTE] = True
        if fact:
            facts[i] = fact
    return facts


def _examples(gm: fx.GraphModule, facts: dict[int, dict[str, Any]]) -> list[Any]:
    """The placeholders' fake values, carrying the saved facts as the real inputs did."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    examples = [n.meta["example_value"] for n in placeholders]
    for i, fact in facts.items():
        for name, value in fact.items():
            setattr(examples[i], name, value)
    return examples
