"""Mark the batch (token) dim of inputs dynamic so one compiled graph serves sizes 2..max.

By default the batch dim is marked dynamic with a backed size (`mark_dynamic`): Dynamo traces
batches >= 2 once and batch 1 once more (it specialises size 1), and Inductor compiles each with
the size's example value as a hint. `unbacked=True` marks it unbacked instead (with one
`shape_id` shared by the inputs; torch >= 2.11, older torch logs a warning once and marks the
batch backed), so every size including 1 shares ONE trace, at a cost measured on the H200 (torch
2.11, bf16 Llama, 16 layers): Inductor's code for an unbacked batch ran 272 kernels per step
instead of 194, and 13% (8 tokens) to 36% (1024 tokens) more GPU time than the backed or static
code, which matched each other (docs/BENCHMARKS.md). An unbacked size also has no example value,
so code that asks `n == 1` while tracing cannot be traced: on torch 2.11 with CUDA, SDPA's cuDNN
eligibility check does that and Dynamo breaks the graph at every attention call unless that
kernel is disabled (`torch.backends.cuda.enable_cudnn_sdp(False)`).

    cgcompile.mark_dynamic_batch(tokens, positions)                 # fast kernels, 2 traces
    cgcompile.mark_dynamic_batch(tokens, positions, unbacked=True)  # one trace for 1..max
    cgcompile.mark_dynamic_batch(tokens, positions, hint=512)       # kernels tuned for 512
    logits = compiled(tokens, positions)

`hint=N` (torch's `hint_override`) makes N, not the first example's size, the size Inductor
tunes the dynamic graph's kernels for; pass the largest capture size. On the H200 an unhinted
graph traced at 8 tokens ran its MLP activation kernel 1.8-3.5x slower at 1024 tokens than a
static compile, FULL 1.18x a hand-captured graph; with the hint, 1.03x. Inductor's cache key
includes the hint but not an example size, so without one, whichever size first compiled the
graph into the cache decides. Dynamo traces a backed batch with N as its size and then checks
its guards against the real input, so a trace that depends on the batch size fails loudly. A
batch of 1 takes no hint: its graph is specialised to size 1 anyway (and Dynamo's guard check
rejects a hinted size 1).
"""

from __future__ import annotations

import torch
from torch._dynamo.decorators import mark_unbacked

from cgcompile import torch_features

_SHAPE_ID = "cgcompile_batch"


def mark_dynamic_batch(
    *tensors: torch.Tensor, dim: int = 0, unbacked: bool = False, hint: int | None = None
) -> None:
    """Mark `dim` of every tensor as the shared dynamic batch dim (call on each new input)."""
    if hint is not None and (isinstance(hint, bool) or not isinstance(hint, int) or hint < 1):
        raise ValueError(f"mark_dynamic_batch: hint must be a positive int, got {hint!r}")
    if unbacked and not torch_features.SHARED_UNBACKED_BATCH.available:
        torch_features.warn_missing(torch_features.SHARED_UNBACKED_BATCH)
        unbacked = False
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"mark_dynamic_batch takes tensors, got {type(t).__name__}")
        if unbacked:
            mark_unbacked(t, dim, hint_override=hint, shape_id=_SHAPE_ID)
        else:
            # a size-1 dim is specialised anyway; a hint on it trips Dynamo's guard check
            torch._dynamo.mark_dynamic(t, dim, hint_override=hint if t.shape[dim] != 1 else None)
