"""The differential check shared by CPU and GPU tests: the tiny Llama through the backend on a
random batch sequence, every output against eager, and the number of Dynamo traces: one with an
unbacked batch, two with the default backed one (batch 1 is traced on its own), also when the
backed batch carries a size hint."""

from __future__ import annotations

import random

import torch

import cgcompile
from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch

# capture sizes [1, 2, 4, 8]: sizes on them, between them and above the largest
SIZES = [1, 2, 3, 4, 5, 7, 8, 9, 13]


def check_llama_matches_eager(
    mode: str,
    compiler: str,
    *,
    device: str,
    graph_runtime: str,
    dtype: torch.dtype = torch.float32,
    tol: float = 1e-4,
    calls: int = 10,
    unbacked: bool = True,
    hint: int | None = None,
    extra_options: dict | None = None,
) -> None:
    """Assert max|compiled - eager| / max|eager| <= tol on every call, and the trace count;
    `extra_options` add to (or override) the backend options below."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny()).to(device, dtype).eval()
    options = {
        "graph_runtime": graph_runtime,
        "cudagraph_mode": mode,
        "compiler": compiler,
        "cudagraph_capture_sizes": [1, 2, 4, 8],
        **(extra_options or {}),
    }
    f = torch.compile(model, backend="cudagraph_modes", options=options)
    rng = random.Random(f"{mode}-{compiler}-{dtype}")
    torch._dynamo.utils.counters.clear()
    before = cgcompile.counters.num_graphs_seen
    for n in [8, 1] + [rng.choice(SIZES) for _ in range(calls)]:
        tokens, positions = make_inputs(model.cfg, n, device)
        mark_batch(model.cfg, tokens, positions, unbacked=unbacked, hint=hint)
        with cgcompile.batch_hint(uniform_decode=rng.random() < 0.5), torch.no_grad():
            got = f(tokens, positions).float()
            want = model(tokens, positions).float()
        err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
        assert err <= tol, f"n={n}: max|diff| / max|eager| = {err:.3g} > {tol}"
    traces = 1 if unbacked else 2  # the sequence starts with 8 then 1
    assert cgcompile.counters.num_graphs_seen - before == traces
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == traces


def check_every_batch_replays(f, reference, sizes=(1, 2, 3, 4)) -> None:
    """Each size, as a uniform decode batch and as a mixed one, equals `reference` on the 1-D
    silly models, running from graphs captured before (none is captured now)."""
    with cgcompile.counters.expect(num_cudagraph_captured=0):
        for n in sizes:
            for uniform in (True, False):
                x = torch.randn(n)
                cgcompile.mark_dynamic_batch(x, unbacked=True)
                with cgcompile.batch_hint(uniform_decode=uniform):
                    torch.testing.assert_close(f(x), reference(x))
