"""Mark the batch (token) dim of inputs dynamic so one compiled graph serves every size.

By default the batch dim is marked dynamic with a backed size (`mark_dynamic`): Dynamo traces
batches >= 2 once and batch 1 once more (it specialises size 1); Inductor compiles the first
with the size's example value as a hint, and the second is served by that compile, padded to 2
rows, where the two graphs match (`batch_one`, `backend/batch_one_sharing.py`). `unbacked=True`
marks it unbacked instead (with one `shape_id` shared by the inputs; torch >= 2.11, older torch
logs a warning once and marks the batch backed), so every size including 1 shares ONE trace, at
a cost: Inductor's code for an unbacked batch runs more kernels and more GPU time than the
backed or static code, which match each other (docs/BENCHMARKS.md, "Which batch marking?"). An
unbacked size also has no example value, so code that asks `n == 1` while tracing cannot
be traced: on torch 2.11 with CUDA, SDPA's cuDNN eligibility check does that and Dynamo breaks
the graph at every attention call unless that kernel is disabled
(`torch.backends.cuda.enable_cudnn_sdp(False)`). Code that reads the answer without asking
(`x.squeeze()` of the batch dim) is traced as if the batch were not 1: calls of one row of
such a graph raise (`passes.one_row`).

    cgcompile.mark_dynamic_batch(tokens, positions)                 # 2 traces, 1 compile
    cgcompile.mark_dynamic_batch(tokens, positions, unbacked=True)  # one trace for 1..max
    cgcompile.mark_dynamic_batch(tokens, positions, hint=512)       # kernels tuned for 512
    logits = compiled(tokens, positions)

`hint=N` (torch's `hint_override`) makes N, not the first example's size, the size Inductor
tunes the dynamic graph's kernels for; pass the largest capture size, where a kernel tuned for
a small batch costs the most. Inductor's cache key includes the hint but not an example size,
so without one, whichever size first compiled the graph into the cache decides. Dynamo
traces a backed batch with N as its size and then checks its guards against the real input,
so a trace that depends on the batch size fails loudly. A batch of 1 takes no hint: its graph
is specialised to size 1 anyway (and Dynamo's guard check rejects a hinted size 1).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.decorators import mark_unbacked

from cgcompile import torch_features
from cgcompile.errors import ConfigError, ConfigTypeError
from cgcompile.options import MAX_CAPTURE_SIZE, as_bool, as_index, show

_SHAPE_ID = "cgcompile_batch"
PAD_ATTRIBUTE = "_cgcompile_pad_value"
"""The tensor attribute `pad_value=` sets; the backend reads it from a graph's example inputs."""
BATCH_DIM_ATTRIBUTE = "_cgcompile_batch_dim"
"""The tensor attribute that records a `dim` other than 0; graph modes reject it."""


def is_marked_batch(value: Any) -> bool:
    """Whether dim 0 of `value` was marked dynamic, by `mark_dynamic_batch` or by torch's
    `mark_dynamic` / `mark_unbacked` (the sets torch keeps on the tensor)."""
    marks = ("_dynamo_dynamic_indices", "_dynamo_unbacked_indices")
    return any(0 in getattr(value, name, ()) for name in marks)


def mark_dynamic_batch(
    *tensors: torch.Tensor,
    dim: int = 0,
    unbacked: bool = False,
    hint: int | None = None,
    pad_value: float | None = None,
) -> None:
    """Mark `dim` of every tensor as the shared dynamic batch dim (call on each new input).

    `tensors`: the model's batch inputs (tokens, positions, ...), all with the same size along
    `dim`. `dim`: the batch (token) dim, 0 by default; graph modes pad and slice dim 0 only,
    so they reject another dim when the graph compiles (`ConfigError`; mode NONE takes any).
    `unbacked`: one trace for every size, batch 1 included (torch >= 2.11; older torch warns
    once and marks the batch backed), but Inductor's kernels for an unbacked size are slower
    (docs/guide.md, "Marking the batch"); False: batches >= 2 share a trace and
    batch 1 gets a trace of its own (served padded by the first's compile). `hint`: the size
    Inductor tunes the dynamic graph's kernels for; pass your largest capture size (a batch of
    1 takes none: its trace is static).
    `pad_value`: what the padded rows of these tensors hold when a batch is padded to a
    capture size (default 0), e.g. the index of a reserved trash slot for a slot mapping, so
    padded rows write their KV-cache entries where no real row reads; it is read when the
    graph compiles and used on every call and by `capture_all()`. A graph that writes state
    (a KV cache) at rows a batch input chooses, with no pad value declared for that input, is
    not padded: only batches of exactly a capture size replay graphs. Bad arguments raise a
    `ConfigError` before any tensor is marked.
    """
    dim, hint = _check_batch_args(tensors, dim, unbacked, hint)
    _check_pad_value(pad_value)
    if unbacked and not torch_features.SHARED_UNBACKED_BATCH.available:
        torch_features.warn_missing(torch_features.SHARED_UNBACKED_BATCH)
        unbacked = False
    for t in tensors:
        if pad_value is not None:
            setattr(t, PAD_ATTRIBUTE, pad_value)
        if dim != 0:
            setattr(t, BATCH_DIM_ATTRIBUTE, dim)
        elif hasattr(t, BATCH_DIM_ATTRIBUTE):
            delattr(t, BATCH_DIM_ATTRIBUTE)
        if unbacked:
            mark_unbacked(t, dim, hint_override=hint, shape_id=_SHAPE_ID)
        else:
            # a size-1 dim is specialised anyway; a hint on it trips Dynamo's guard check
            torch._dynamo.mark_dynamic(t, dim, hint_override=hint if t.shape[dim] != 1 else None)


def _check_batch_args(
    tensors: tuple[Any, ...], dim: Any, unbacked: Any, hint: Any
) -> tuple[int, int | None]:
    """(dim, hint) as ints, or a `ConfigError` naming the bad argument and what to pass."""
    index = _as_count("dim", dim, 0, None, "e.g. dim=0")
    _check_tensors(tensors, index)
    as_bool("mark_dynamic_batch: unbacked", unbacked)
    if hint is None:
        return index, None
    return index, _as_count(
        "hint", hint, 1, MAX_CAPTURE_SIZE, "e.g. your largest capture size, hint=512"
    )


def _check_pad_value(value: Any) -> None:
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return
    raise ConfigTypeError(
        f"mark_dynamic_batch: pad_value must be a number (what padded rows hold), got "
        f"{show(value)}; e.g. the index of a reserved trash slot, pad_value=-1"
    )


def _as_count(key: str, value: Any, minimum: int, maximum: int | None, fix: str) -> int:
    n = as_index(value)
    if n is not None and n >= minimum and (maximum is None or n <= maximum):
        return n
    error = ConfigTypeError if n is None else ConfigError
    bound = f"an int >= {minimum}" if minimum == 0 else "a positive int"
    bound += f" <= {maximum}" if maximum else ""
    raise error(f"mark_dynamic_batch: {key} must be {bound}, got {show(value)}; {fix}")


def _check_tensors(tensors: tuple[Any, ...], dim: int) -> None:
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ConfigTypeError(
                f"mark_dynamic_batch takes tensors, got {type(t).__name__} as argument {i}; "
                f"pass the model's batch inputs, e.g. mark_dynamic_batch(tokens, positions)"
            )
        if dim >= t.dim():
            raise ConfigError(
                f"mark_dynamic_batch: tensor {i} of shape {tuple(t.shape)} has no dim {dim}; "
                f"mark only tensors that have the batch dim (0-d tensors have none)"
            )
    if len({t.shape[dim] for t in tensors}) > 1:
        raise ConfigError(
            f"mark_dynamic_batch: the tensors disagree on the batch size (dim {dim}): shapes "
            f"{[tuple(t.shape) for t in tensors]}; mark only tensors whose dim {dim} is the "
            f"batch, all with the same size"
        )
