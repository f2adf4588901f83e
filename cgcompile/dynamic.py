"""Mark the batch (token) dim of inputs dynamic so one Dynamo trace serves sizes 1..max.

Plain `mark_dynamic` specialises batch size 1 (a second trace), and `dynamic=True` makes every
dim dynamic and specialises 1 as well. On torch builds whose `mark_unbacked` takes a
`shape_id`, the batch dim is marked unbacked with one shared id: the inputs share one size
symbol, size 1 is not special, and the whole range shares one trace. Older builds fall back to
`mark_dynamic` (one extra trace for batch 1).

An unbacked size has no example value, so code that asks `n == 1` while tracing cannot be
traced: on torch 2.11 with CUDA, SDPA's cuDNN eligibility check does that and Dynamo breaks the
graph at every attention call. Either disable that kernel
(`torch.backends.cuda.enable_cudnn_sdp(False)`) or pass `unbacked=False` (backed sizes, batch 1
traced separately).

    cgcompile.mark_dynamic_batch(tokens, positions)
    logits = compiled(tokens, positions)
"""

from __future__ import annotations

import inspect

import torch
from torch._dynamo.decorators import mark_unbacked

_SHAPE_ID = "cgcompile_batch"
_HAS_SHAPE_ID = "shape_id" in inspect.signature(mark_unbacked).parameters


def mark_dynamic_batch(*tensors: torch.Tensor, dim: int = 0, unbacked: bool = True) -> None:
    """Mark `dim` of every tensor as the shared dynamic batch dim (call on each new input)."""
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"mark_dynamic_batch takes tensors, got {type(t).__name__}")
        if unbacked and _HAS_SHAPE_ID:
            mark_unbacked(t, dim, shape_id=_SHAPE_ID)
        else:
            torch._dynamo.mark_dynamic(t, dim)
