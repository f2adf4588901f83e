"""Where the batch lives in a graph's inputs and outputs, and which inputs the graph writes:
what every call of a compiled graph reads to find its batch, its key and what to copy.

Dim 0 of every user tensor whose dim 0 is dynamic is the batch (token) dim: those tensors are
copied into the graph's input buffers and padded (`input_buffers.InputBuffers`). Other user
tensors are copied into same-shape buffers, except those the graph writes in place
(`mutated`): they are used in place, like parameters, module buffers and `mark_static_address`
tensors, which are never copied. A mutated batch tensor is copied in and its real rows copied
back after the call. Padded rows hold each batch tensor's pad value, else zero. Outputs that
alias no input live in graph memory, which the next replay overwrites (`handed_outputs`, whose
liveness the backend watches); outputs that alias a copied input live in its buffer, which the
next call refills (`buffer_outputs`, always copied out). The compile side builds the plan from
the Dynamo graph once (`backend.input_analysis.plan_inputs`).

    n = plan.batch_size(args)
    key = plan.shape_key(args)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


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
    passed_static: tuple[int, ...] = ()
    """Static-address tensors the caller passes (not a module's parameters or buffers) of a
    graph without `batch_state`: graphs bake in their addresses, and no parameter event tells
    when a call passes another, so each call checks them, as `in_place` (`kept_in_place`).
    With `batch_state`, whose addresses key the graphs, none: what a cache passes beside its
    batch-sized tensors (a Hugging Face cache's counters) changes with them."""
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
    batch_state: tuple[int, ...] = ()
    """Static tensors whose dim 0 is the batch (a cache allocated per batch size, as Hugging
    Face's `StaticCache`): a graph serves only calls of their size and addresses (`shape_key`:
    another cache of that size gets graphs of its own), and `capture_all` captures the keys of
    each size a call brought."""
    one_row: str | None = None
    """Why a call of one row could differ from eager's (`passes.one_row`: a graph whose batch
    admits 1 and that squeezes a batch dim); such calls raise. None: one row is as any."""
    host_scalars: tuple[int, ...] = ()
    """One-element CPU tensors among the user inputs of a graph that runs on CUDA (a float
    attribute Dynamo passes as a tensor and reads with `.item()`): the host reads them while a
    graph is captured, so their values are part of the graph's key (`shape_key`)."""

    @property
    def kept_in_place(self) -> tuple[int, ...]:
        """Tensors graphs use where the first call had them: a call passing others runs eagerly."""
        return (*self.in_place, *self.passed_static)

    @property
    def copied_back(self) -> tuple[int, ...]:
        """Mutated batch tensors: their real rows are copied back to the caller's tensor."""
        return tuple(i for i in self.batch_tensors if i in self.mutated)

    def state_names(self) -> list[str]:
        """Names of the persistent tensors the graph writes: parameters, buffers, static-address
        and in-place user tensors (what padded rows could write where eager would not)."""
        persistent = set(self.static_tensors) | set(self.in_place)
        return [self.names[i] for i in self.mutated if i in persistent]

    def shape_key(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """The sizes, host scalars and state addresses (`batch_state`) that, with the batch
        descriptor, pick a graph."""
        key = tuple([args[i] for i in self.int_args])
        if self.host_scalars:
            key += tuple([args[i].item() for i in self.host_scalars])
        if self.batch_state:
            key += tuple([args[i].data_ptr() for i in self.batch_state])
        return key

    def fits_state(self, args: Sequence[Any], rows: int) -> bool:
        """Whether a run at `rows` rows can use `args`' static tensors (`batch_state`)."""
        return all(args[i].shape[0] == rows for i in self.batch_state)

    def batch_size(self, args: Sequence[Any]) -> int | None:
        """The batch of this call, or None when the user's batch tensors disagree on it."""
        if not self.batch_tensors:
            return None
        n = args[self.batch_tensors[0]].shape[0]
        for i in self.batch_tensors:
            if args[i].shape[0] != n:
                return None
        return n
