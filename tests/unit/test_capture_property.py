"""Property: a key is captured once, on its call after `num_warmups` warm-up calls (the graph's
very first call always warms up: compiled code never first runs inside a capture); replays and
warm-ups never capture."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

import cgcompile
from cgcompile import CUDAGraphMode, counters
from cgcompile.torch_features import SHARED_UNBACKED_BATCH
from tests.support.models import silly_closed_form, silly_model
from tests.support.requires import needs

PIECES = 3  # capturable pieces of silly_model


@needs(SHARED_UNBACKED_BATCH)  # one graph, one dispatcher for every size
@given(
    mode=st.sampled_from([m.name for m in CUDAGraphMode]),
    calls=st.lists(st.tuples(st.integers(1, 10), st.booleans()), min_size=1, max_size=12),
    num_warmups=st.integers(0, 2),
)
def test_captures_equal_distinct_keys(mode, calls, num_warmups):
    torch._dynamo.reset()
    f = torch.compile(
        silly_model,
        backend="cudagraph_modes",
        options={
            "cudagraph_mode": mode,
            "graph_runtime": "simulated",
            "compiler": "eager",
            "cudagraph_capture_sizes": [1, 2, 4, 8],
            "num_warmups": num_warmups,
        },
    )
    seen: dict[tuple[CUDAGraphMode, cgcompile.BatchDescriptor], int] = {}
    dispatcher = None
    first = None
    for n, uniform in calls:
        x = torch.randn(n)
        cgcompile.mark_dynamic_batch(x, unbacked=True)
        before = counters.num_cudagraph_captured
        with cgcompile.batch_hint(uniform_decode=uniform):
            out = f(x)
        torch.testing.assert_close(out, silly_closed_form(x))
        dispatcher = dispatcher or cgcompile.compiled_graphs()[-1].dispatcher
        key = dispatcher.dispatch(n, uniform_decode=uniform)
        first = first or key
        seen[key] = seen.get(key, 0) + 1
        extra = num_warmups == 0 and key == first  # the graph's first call warmed this key up
        captures = key[0] != CUDAGraphMode.NONE and seen[key] == num_warmups + 1 + extra
        per_key = PIECES if key[0] == CUDAGraphMode.PIECEWISE else 1
        assert counters.num_cudagraph_captured - before == (per_key if captures else 0)
