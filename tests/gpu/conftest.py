"""GPU tests run with cuDNN attention off, except those that mark the batch backed (the
default): on torch <= 2.11 its eligibility check asks `batch == 1` while tracing, which an
unbacked batch (`mark_dynamic_batch(..., unbacked=True)`) cannot answer, so Dynamo would break
the graph at every SDPA call (see `cgcompile.dynamic`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _no_cudnn_attention(request: pytest.FixtureRequest) -> Iterator[None]:
    callspec = getattr(request.node, "callspec", None)
    backed = callspec is not None and callspec.params.get("batch") == "backed"
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(backed and enabled)
    yield
    torch.backends.cuda.enable_cudnn_sdp(enabled)
