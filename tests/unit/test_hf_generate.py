"""Hugging Face `generate()` through the backend gives eager's greedy tokens in every mode
(CPU, simulated graphs; `tests/gpu/test_hf_cuda.py` runs the same on real graphs)."""

from __future__ import annotations

import pytest
import torch

import cgcompile
from tests.support.hf import PATHS, generate_tokens
from tests.support.models import MODES

pytest.importorskip("transformers")


def check(path: str, mode: str, compiler: str) -> None:
    options = {"cudagraph_mode": mode, "graph_runtime": "simulated", "compiler": compiler}
    torch._dynamo.utils.counters.clear()
    got, want = generate_tokens(path, options, device="cpu")
    assert got.tolist() == want.tolist()
    if path == "static-cache":  # HF compiles the decode step: one graph, replayed
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # no recompiles
        assert (cgcompile.counters.num_cudagraph_captured > 0) == (mode != "NONE")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", PATHS)
def test_generate_matches_eager(path, mode):
    check(path, mode, "eager")


@pytest.mark.parametrize("path", PATHS)
def test_generate_matches_eager_with_inductor(path):
    if path == "compiled-forward" and torch.__version__ < "2.13":
        pytest.skip(
            "torch < 2.13's Inductor emits C++ that does not compile for this model's dynamic "
            "cache on CPU ('tmp2' was not declared); plain torch.compile(model.forward) fails too"
        )
    check(path, "FULL_AND_PIECEWISE", "inductor")


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE"])
def test_a_kept_static_cache_replays_across_generate_calls(mode):
    """HF builds a new StaticCache (new tensors) in every generate(), so its decode graph is
    captured again per call; a cache the caller keeps and resets in place is where the graph
    wrote it, and later calls only replay."""
    from transformers import CompileConfig, StaticCache

    from examples.hf_generate import cache_argument
    from tests.support.hf import tiny_llama

    model = tiny_llama("cpu")
    options = {"cudagraph_mode": mode, "graph_runtime": "simulated", "compiler": "eager"}
    config = CompileConfig(backend="cudagraph_modes", mode=None, options=options)
    config._compile_all_devices = True  # HF compiles only on accelerators otherwise
    cache = StaticCache(config=model.config, max_cache_len=32)
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    captured = []
    for seed in range(3):
        prompts = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(seed))
        want = model.generate(prompts, cache_implementation="static", **kwargs)
        before = cgcompile.counters.num_cudagraph_captured
        cache.reset()
        got = model.generate(prompts, compile_config=config, **{cache_argument(): cache}, **kwargs)
        captured.append(cgcompile.counters.num_cudagraph_captured - before)
        assert got.tolist() == want.tolist()
    assert captured == [1, 0, 0]  # the decode step's full graph, then replays only
