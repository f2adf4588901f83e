"""Where the batch lives in a graph's inputs and outputs, and which inputs the graph writes.

`InputPlan.from_graph` reads Dynamo's placeholders once. Dim 0 of every user tensor whose dim 0
is dynamic is the batch (token) dim: those tensors are copied into static buffers and padded
(`static_inputs.StaticInputs`). Other user tensors are copied into same-shape buffers, except
those the graph writes in place (`mutated`): they are used in place, like parameters, module
buffers and `mark_static_address` tensors, which are never copied. A mutated batch tensor is
copied in and its real rows copied back after the call. Padded rows hold each batch tensor's
pad value (`mark_dynamic_batch(t, pad_value=...)`, read from the example inputs), else zero.
Outputs that alias no input live in graph memory, which the next replay overwrites
(`handed_outputs`, whose liveness the backend watches); outputs that alias a copied input live in
its static buffer, which the next call refills (`buffer_outputs`, always copied out).

    plan = InputPlan.from_graph(gm, example_inputs, find_effects(gm, example_inputs))
    plan.batch_tensors, plan.in_place, plan.state_names()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from cgcompile.dynamic import PAD_ATTRIBUTE
from cgcompile.passes.mutation import Effects

STATIC_ATTRIBUTE = "_cgcompile_static"
"""Marks a fake example input whose real input was a parameter (a graph rebuilt from a saved
artifact has no real inputs): its address is static, as a parameter's."""


@dataclasses.dataclass(frozen=True)
class InputPlan:
    batch_exprs: frozenset[Any]
    """Symbols of dim 0 of the user's dynamic tensors: all are the batch. Empty: static batch."""
    size_indices: tuple[int, ...]
    """Positions of the int arguments that carry the batch size."""
    batch_tensors: tuple[int, ...]
    """Positions of tensors whose dim 0 is the batch: copied and padded."""
    copied_tensors: tuple[int, ...]
    """Other user tensors: copied into same-shape static buffers."""
    batch_outputs: tuple[int, ...]
    """Positions of outputs whose dim 0 is the batch: sliced back to the real size."""
    static_batch: int | None
    """The batch size of a graph without a symbolic batch (dim 0 of its first user tensor)."""
    static_tensors: tuple[int, ...] = ()
    """Parameters and buffers: used in place, so graphs bake in their addresses."""
    int_args: tuple[int, ...] = ()
    """Positions of all int (dynamic size) arguments: with the descriptor, a graph's key."""
    min_batch: int = 1
    """The smallest batch this graph's guards admit: 2 for a backed batch (Dynamo traces batch 1
    separately), so capture sizes below it would record graphs no call can reach."""
    names: tuple[str, ...] = ()
    """A readable name per placeholder: the user's expression (`x`, `self.cache`)."""
    mutated: tuple[int, ...] = ()
    """Placeholders the graph writes in place."""
    in_place: tuple[int, ...] = ()
    """Mutated user tensors that are not batch tensors: passed as they are, never copied."""
    pad_values: tuple[tuple[int, Any], ...] = ()
    """(position, value) of batch tensors with a declared pad value; others pad with zeros."""
    batch_strided: tuple[int, ...] = ()
    """Batch tensors whose strides depend on the batch size (batch dim not outermost)."""
    pad_unsafe: str | None = None
    """Why padding could change what the caller sees (`passes.pad_safety`); None: pad freely."""
    handed_outputs: tuple[int, ...] = ()
    """Tensor outputs that alias no input: a replay's live in graph memory, which the next
    replay of the same module instance overwrites."""
    buffer_outputs: tuple[int, ...] = ()
    """Tensor outputs that alias a copied input: views of a static buffer the next call
    refills."""
    decode_by_shape: bool = False
    """Calls without a `batch_hint` are uniform decode batches: a token input has a static
    second dim of q (HF's `input_ids` of shape [batch, 1]), so each row is one request of q
    tokens. Set only where full graphs serve every kind of batch (attention support ALWAYS),
    so a misread batch still replays an exact graph."""
    host_scalars: tuple[int, ...] = ()
    """One-element CPU tensors among the user inputs of a graph that runs on CUDA (a float
    attribute Dynamo passes as a tensor and reads with `.item()`): the host reads them while a
    graph is captured, so their values are part of the graph's key (`shape_key`)."""

    @property
    def copied_back(self) -> tuple[int, ...]:
        """Mutated batch tensors: their real rows are copied back to the caller's tensor."""
        return tuple(i for i in self.batch_tensors if i in self.mutated)

    def state_names(self) -> list[str]:
        """Names of the persistent tensors the graph writes: parameters, buffers, static-address
        and in-place user tensors (what padded rows could write where eager would not)."""
        persistent = set(self.static_tensors) | set(self.in_place)
        return [self.names[i] for i in self.mutated if i in persistent]

    @classmethod
    def from_graph(
        cls,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        effects: Effects | None = None,
    ) -> InputPlan:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        values = [n.meta.get("example_value", n.meta.get("val")) for n in placeholders]
        user = [
            i
            for i, (node, value) in enumerate(zip(placeholders, values, strict=True))
            if isinstance(value, torch.Tensor) and not _is_static(node, example_inputs[i])
        ]
        exprs = frozenset(
            values[i].shape[0].node.expr
            for i in user
            if values[i].dim() > 0 and isinstance(values[i].shape[0], torch.SymInt)
        )
        batch_tensors = tuple(i for i in user if _dim0_in(values[i], exprs))
        size_indices = tuple(
            i for i, v in enumerate(values) if isinstance(v, torch.SymInt) and v.node.expr in exprs
        )
        static_batch = None
        if not exprs and user and values[user[0]].dim() > 0:
            static_batch = int(values[user[0]].shape[0])
            batch_tensors = (user[0],)
        effects = effects or Effects((), {})
        mutated = effects.mutated
        outputs = _output_values(gm)
        batch_outputs = tuple(i for i, v in enumerate(outputs) if _dim0_in(v, exprs))
        in_place = tuple(i for i in user if i not in batch_tensors and i in mutated)
        copied = tuple(i for i in user if i not in batch_tensors and i not in in_place)
        static = tuple(
            i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and i not in user
        )
        ints = tuple(i for i, v in enumerate(values) if isinstance(v, torch.SymInt))
        tensors = [i for i, v in enumerate(outputs) if isinstance(v, torch.Tensor)]
        aliases = effects.output_aliases
        copied_inputs = set(batch_tensors) | set(copied)
        dims = [values[i].shape[0] for i in batch_tensors]
        bounds = [_lower_bound(d) for d in dims if isinstance(d, torch.SymInt)]
        return cls(
            exprs,
            size_indices,
            batch_tensors,
            copied,
            batch_outputs,
            static_batch,
            static,
            ints,
            max([1, *bounds]),
            names=tuple(_name(node) for node in placeholders),
            mutated=tuple(mutated),
            in_place=in_place,
            pad_values=_pad_values(batch_tensors, example_inputs),
            batch_strided=tuple(i for i in batch_tensors if _strides_use(values[i], exprs)),
            handed_outputs=tuple(i for i in tensors if i not in aliases),
            buffer_outputs=tuple(i for i in tensors if aliases.get(i) in copied_inputs),
        )

    def shape_key(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """The sizes and host scalars that, with the batch descriptor, pick a graph."""
        key = tuple([args[i] for i in self.int_args])
        if self.host_scalars:
            key += tuple([args[i].item() for i in self.host_scalars])
        return key

    def with_host_scalars(self, example_inputs: Sequence[Any]) -> InputPlan:
        """This plan for a graph that runs on CUDA: its one-element CPU inputs are keys."""
        host = tuple(
            i
            for i in (*self.batch_tensors, *self.copied_tensors)
            if example_inputs[i].device.type == "cpu" and example_inputs[i].numel() == 1
        )
        return dataclasses.replace(self, host_scalars=host)

    def with_decode_by_shape(self, gm: fx.GraphModule, q: int) -> InputPlan:
        """This plan with `decode_by_shape` set if an integer batch input has a static second
        dim of q."""
        values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        by_shape = any(
            not values[i].is_floating_point()
            and values[i].dim() >= 2
            and type(values[i].shape[1]) is int
            and values[i].shape[1] == q
            for i in self.batch_tensors
        )
        return dataclasses.replace(self, decode_by_shape=by_shape)

    def batch_size(self, args: Sequence[Any]) -> int | None:
        """The batch of this call, or None when the user's batch tensors disagree on it."""
        if not self.batch_tensors:
            return None
        n = args[self.batch_tensors[0]].shape[0]
        for i in self.batch_tensors:
            if args[i].shape[0] != n:
                return None
        return n


def _name(node: fx.Node) -> str:
    """`L['self'].cache` for a module buffer, `L['x']` for an argument: Dynamo's source name."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    if callable(name):  # a method before torch 2.13
        name = name()
    return name or node.name


def _pad_values(batch_tensors: Sequence[int], example_inputs: Sequence[Any]) -> tuple[Any, ...]:
    values = ((i, getattr(example_inputs[i], PAD_ATTRIBUTE, None)) for i in batch_tensors)
    return tuple((i, v) for i, v in values if v is not None)


def _strides_use(value: torch.Tensor, exprs: frozenset[Any]) -> bool:
    """Whether a stride of the traced tensor involves a batch symbol (e.g. `x.t()`)."""
    symbols = {s for e in exprs for s in getattr(e, "free_symbols", ())}
    return any(
        isinstance(s, torch.SymInt) and s.node.expr.free_symbols & symbols for s in value.stride()
    )


def _lower_bound(size: torch.SymInt) -> int:
    """The least value the shape environment allows for a symbolic size (0 if unbounded)."""
    node = size.node
    try:
        return int(node.shape_env.bound_sympy(node.expr).lower)
    except (TypeError, ValueError, OverflowError):  # -oo
        return 0


def _is_static(node: fx.Node, example: Any) -> bool:
    """Parameters, module buffers and `mark_static_address` tensors keep their address."""
    if isinstance(example, torch.nn.Parameter) or getattr(example, STATIC_ATTRIBUTE, False):
        return True
    return bool(node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type"))


def _dim0_in(value: Any, exprs: frozenset[Any]) -> bool:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    d0 = value.shape[0]
    return isinstance(d0, torch.SymInt) and d0.node.expr in exprs


def _output_values(gm: fx.GraphModule) -> list[Any]:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    flat = output.args[0]
    if not isinstance(flat, (tuple, list)):
        flat = [flat]
    return [
        a.meta.get("example_value", a.meta.get("val")) if isinstance(a, fx.Node) else a
        for a in flat
    ]
