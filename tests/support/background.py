"""Calls beside `capture_all(background=True)` against eager, shared by the CPU (simulated
graphs) and GPU tests: the example Llama writes its KV caches in place on every call."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch

import cgcompile
from examples.llama import Llama, LlamaConfig, _read_slots, make_inputs, mark_batch
from tests.support.hf import VOCAB, tiny_llama

CFG = LlamaConfig(num_layers=2, cache_len=64)
SIZES = [1, 2, 4, 8, 16]
CACHE_LEN = 32
"""Positions of the HF model's static caches."""


def compile_pair(device: str, **options: Any) -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    """(model, an eager copy, the compiled model) on `device`, capture sizes `SIZES`."""
    model = Llama(CFG).to(device).eval()
    reference = copy.deepcopy(model)
    options = {"cudagraph_capture_sizes": SIZES, **options}
    return model, reference, torch.compile(model, backend="cudagraph_modes", options=options)


def call_and_check(compiled: Any, reference: Any, n: int, decode: bool, seed: int) -> None:
    """One call of n tokens (decode or mixed); its logits must equal the eager copy's."""
    device = next(reference.parameters()).device
    tokens, positions = make_inputs(CFG, n, device, torch.Generator().manual_seed(seed))
    mark_batch(CFG, tokens, positions)
    with cgcompile.batch_hint(uniform_decode=decode):
        got = compiled(tokens, positions)
    torch.testing.assert_close(got, reference(tokens, positions), rtol=1e-4, atol=1e-4)


def calls_beside_capture(compiled: Any, model: Any, reference: Any) -> tuple[Any, int]:
    """First calls, then `capture_all(background=True)` and random calls until it is done, each
    checked against eager, then the KV caches; returns (the finished job, calls made while it
    ran)."""
    rng = random.Random(0)
    call_and_check(compiled, reference, 8, False, 0)
    call_and_check(compiled, reference, 1, True, 1)
    job = cgcompile.capture_all(background=True)
    during = 0
    for seed in range(2, 2000):
        if job.done:
            break
        call_and_check(compiled, reference, rng.randint(1, 20), rng.random() < 0.5, seed)
        during += 1
    job.wait(timeout=300)
    torch.testing.assert_close(_read_slots(model), _read_slots(reference))
    return job, during


def soak(compiled: Any, reference: Any, calls: int) -> None:
    """`calls` random calls, each checked against eager."""
    rng = random.Random(1)
    for seed in range(calls):
        call_and_check(compiled, reference, rng.randint(1, 16), rng.random() < 0.5, 10_000 + seed)


def hf_calls_beside_capture(
    device: str, calls: int = 2000, after: int = 40, **options: Any
) -> tuple[Any, int]:
    """A Hugging Face Llama with a `StaticCache` per batch size (1, 2, 4, 8): first calls of
    each size, then `capture_all(background=True)` and random decode calls until it is done,
    then `after` more (a full cache starts over, in place, as transformers' `StaticCache` writes
    each step at its own counter); every call's logits equal an eager copy's, and so do the
    caches at the end (read after the thread is done: a simulated capture undoes its writes
    only when it ends). Returns (the finished job, the calls made while the thread ran)."""
    transformers = pytest.importorskip("transformers")
    model = tiny_llama(device)
    config = model.config
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    caches, theirs, written = {}, {}, {}
    rng = random.Random(0)

    def step(n: int, seed: int) -> None:
        if written.get(n) == CACHE_LEN:  # each step writes at the cache's own counter
            caches[n].reset()
            theirs[n].reset()
            written[n] = 0
        written[n] = written.get(n, 0) + 1
        g = torch.Generator().manual_seed(seed)
        pos = rng.randrange(CACHE_LEN)
        kwargs = {
            "input_ids": torch.randint(1, VOCAB, (n, 1), generator=g).to(device),
            "position_ids": torch.full((n, 1), pos, device=device),
            "cache_position": torch.tensor([pos], device=device),
        }
        if n not in caches:  # made by an eager call, as generate()'s prefill does
            caches[n] = transformers.StaticCache(config=config, max_cache_len=CACHE_LEN)
            theirs[n] = transformers.StaticCache(config=config, max_cache_len=CACHE_LEN)
            model(**kwargs, past_key_values=caches[n])
            reference(**kwargs, past_key_values=theirs[n])
            written[n] += 1
        got = compiled(**kwargs, past_key_values=caches[n]).logits
        want = reference(**kwargs, past_key_values=theirs[n]).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"a call of {n} rows")

    sizes = (1, 2, 4, 8)
    for seed, n in enumerate(sizes):
        step(n, seed)
    job = cgcompile.capture_all(background=True)
    during = 0
    for seed in range(10, 10 + calls):
        if job.done:
            break
        step(rng.choice(sizes), seed)
        during += 1
    job.wait(timeout=300)
    for seed in range(20_000, 20_000 + after):
        step(rng.choice(sizes), seed)
    for n in sizes:
        for mine, ref in zip(caches[n].layers, theirs[n].layers, strict=True):
            torch.testing.assert_close(mine.keys, ref.keys, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(mine.values, ref.values, rtol=1e-4, atol=1e-4)
    return job, during
