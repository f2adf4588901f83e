"""A Dynamo graph's `InputPlan` (`calls.input_plan`), read from its placeholders and output once
per graph, when it compiles.

`plan_inputs` finds the batch: dim 0 of every user tensor whose dim 0 is dynamic; a graph
without a symbolic batch has the static batch of its first user tensor. Pad values are read from
the example inputs (`mark_dynamic_batch(t, pad_value=...)`). What the graph writes in place and
which outputs alias an input are known only after a fake run (`passes.mutation.find_effects`):
`with_effects` adds them to the plan without reading the graph again. On CUDA, one-element CPU
inputs join the key (`with_host_scalars`); where full graphs serve every batch, a token input of
static second dim q marks decode batches (`with_decode_by_shape`).

    plan = plan_inputs(gm, example_inputs)
    plan = with_effects(plan, find_effects(gm, example_inputs))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from cgcompile.calls.input_plan import InputPlan
from cgcompile.dynamic import PAD_ATTRIBUTE
from cgcompile.passes.mutation import Effects
from cgcompile.passes.one_row import one_row_difference

STATIC_ATTRIBUTE = "_cgcompile_static"
"""Marks a fake example input whose real input was a parameter (a graph rebuilt from a saved
artifact has no real inputs): its address is static, as a parameter's."""


def plan_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> InputPlan:
    """The plan of `gm`'s inputs and outputs before its effects are known: no input is mutated,
    every user tensor but the batch is copied, every tensor output is handed out."""
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
    outputs = _output_values(gm)
    static = tuple(i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and i not in user)
    batch_state = tuple(i for i in static if _dim0_in(values[i], exprs))
    dims = [values[i].shape[0] for i in batch_tensors]
    bounds = [_lower_bound(d) for d in dims if isinstance(d, torch.SymInt)]
    min_batch = max([1, *bounds])
    return InputPlan(
        exprs,
        size_indices,
        batch_tensors,
        tuple(i for i in user if i not in batch_tensors),
        tuple(i for i, v in enumerate(outputs) if _dim0_in(v, exprs)),
        static_batch,
        static,
        tuple(i for i, v in enumerate(values) if isinstance(v, torch.SymInt)),
        min_batch,
        batch_state=batch_state,
        # with state sized by the batch, its addresses key the graphs, and the other static
        # tensors passed come with it (a Hugging Face cache's counters): not checked apart
        passed_static=()
        if batch_state
        else tuple(i for i in static if not _module_state(placeholders[i], example_inputs[i])),
        names=tuple(_name(node) for node in placeholders),
        pad_values=_pad_values(batch_tensors, example_inputs),
        batch_strided=tuple(i for i in batch_tensors if _strides_use(values[i], exprs)),
        handed_outputs=tuple(i for i, v in enumerate(outputs) if isinstance(v, torch.Tensor)),
        one_row=one_row_difference(gm, exprs) if exprs and min_batch == 1 else None,
    )


def with_effects(plan: InputPlan, effects: Effects) -> InputPlan:
    """`plan_inputs`' plan with the graph's effects: mutated user tensors are used in place, not
    copied; an output that aliases an input is not graph memory (and lives in a buffer where
    that input is copied). `plan` must be `plan_inputs`' own, whose handed outputs are every
    tensor output."""
    mutated = effects.mutated
    copied = tuple(i for i in plan.copied_tensors if i not in mutated)
    aliases = effects.output_aliases
    copied_inputs = set(plan.batch_tensors) | set(copied)
    tensors = plan.handed_outputs
    return dataclasses.replace(
        plan,
        copied_tensors=copied,
        mutated=tuple(mutated),
        in_place=tuple(i for i in plan.copied_tensors if i in mutated),
        handed_outputs=tuple(i for i in tensors if i not in aliases),
        buffer_outputs=tuple(i for i in tensors if aliases.get(i) in copied_inputs),
    )


def with_host_scalars(plan: InputPlan, example_inputs: Sequence[Any]) -> InputPlan:
    """`plan` for a graph that runs on CUDA: its one-element CPU inputs are keys."""
    host = tuple(
        i
        for i in (*plan.batch_tensors, *plan.copied_tensors)
        if example_inputs[i].device.type == "cpu" and example_inputs[i].numel() == 1
    )
    return dataclasses.replace(plan, host_scalars=host)


def with_decode_by_shape(plan: InputPlan, gm: fx.GraphModule, q: int) -> InputPlan:
    """`plan` with `decode_by_shape` set if an integer batch input has a static second dim of
    q."""
    values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    by_shape = any(
        not values[i].is_floating_point()
        and values[i].dim() >= 2
        and type(values[i].shape[1]) is int
        and values[i].shape[1] == q
        for i in plan.batch_tensors
    )
    return dataclasses.replace(plan, decode_by_shape=by_shape)


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


def _module_state(node: fx.Node, example: Any) -> bool:
    """A module's parameter or buffer (its name, Dynamo's source or the node's, says so), which
    the parameter events watch; else a static tensor the caller passes."""
    name = _name(node)
    return isinstance(example, torch.nn.Parameter) or any(
        kind in name for kind in ("_parameters", "_buffers")
    )


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
