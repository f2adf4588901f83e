"""GPU tests run with cuDNN attention off: on torch <= 2.11 its eligibility check asks
`batch == 1` while tracing, which an unbacked batch (`mark_dynamic_batch`) cannot answer, so
Dynamo would break the graph at every SDPA call (see `cgcompile.dynamic`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _no_cudnn_attention() -> Iterator[None]:
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    yield
    torch.backends.cuda.enable_cudnn_sdp(enabled)
