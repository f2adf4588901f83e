"""`capture_all(background=True)` on the simulated runtime: calls made while the thread captures
equal eager's (logits and KV caches), the thread captures every key, a failure is reported."""

from __future__ import annotations

import copy
import logging
import random
import threading
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import cgcompile
from cgcompile.calls import background, bulk_capture
from cgcompile.config import CUDAGraphMode
from cgcompile.errors import CGCompileError
from cgcompile.graphs.simulated import SimulatedGraphRuntime
from examples.llama import _read_slots
from tests.support.background import (
    call_and_check,
    calls_beside_capture,
    compile_pair,
    hf_calls_beside_capture,
    soak,
)

SIM = {"graph_runtime": "simulated", "compiler": "eager"}


@pytest.fixture
def slow_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each background capture hands over for 2 ms: calls fall between captures for sure."""
    exit_turn = background.Turns.__exit__

    def slow_exit(self: background.Turns, *exc: object) -> None:
        exit_turn(self, *exc)
        if self.capturer is not None and self.capturer == background.threading.get_ident():
            time.sleep(0.002)

    monkeypatch.setattr(background.Turns, "__exit__", slow_exit)


@pytest.mark.usefixtures("slow_turns")
def test_calls_during_background_capture_equal_eager() -> None:
    model, reference, compiled = compile_pair("cpu", **SIM)
    with torch.inference_mode():
        job, during = calls_beside_capture(compiled, model, reference)
    assert during >= 3  # calls really ran beside the thread
    # sizes 2, 4, 8, 16 x (decode FULL, mixed PIECEWISE); batch 1 has a Dynamo graph of its own
    assert job.keys_done == job.total_keys == 8
    assert job.graphs_captured > 0 and job.seconds is not None
    assert all(g.capture_turns is None for g in cgcompile.compiled_graphs())


def test_after_background_capture_calls_capture_nothing() -> None:
    model, reference, compiled = compile_pair("cpu", **SIM)
    with torch.inference_mode():
        calls_beside_capture(compiled, model, reference)
        with cgcompile.counters.expect(num_cudagraph_captured=0):
            soak(compiled, reference, 40)
        torch.testing.assert_close(_read_slots(model), _read_slots(reference))


def test_background_error_is_logged_and_raised_by_wait(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _, reference, compiled = compile_pair("cpu", **SIM)
    real = bulk_capture.capture_key
    seen = []

    def failing(graph: object, *item: object, **kwargs: object) -> None:
        seen.append(item)
        if len(seen) == 3:
            raise RuntimeError("boom on the third key")
        real(graph, *item, **kwargs)

    monkeypatch.setattr(bulk_capture, "capture_key", failing)
    with torch.inference_mode(), caplog.at_level(logging.ERROR):
        call_and_check(compiled, reference, 8, False, 0)
        job = cgcompile.capture_all(background=True)
        with pytest.raises(RuntimeError, match="boom on the third key"):
            job.wait(timeout=120)
        assert job.keys_done == 2
        assert "background capture failed after 2 keys" in caplog.text
        call_and_check(compiled, reference, 5, True, 1)  # calls go on: the lock is gone
    assert all(g.capture_turns is None for g in cgcompile.compiled_graphs())


@pytest.mark.usefixtures("slow_turns")
def test_second_capture_all_is_refused_while_one_runs_in_the_background() -> None:
    _, reference, compiled = compile_pair("cpu", **SIM)
    with torch.inference_mode():
        call_and_check(compiled, reference, 8, False, 0)
        job = cgcompile.capture_all(background=True)
        with pytest.raises(CGCompileError, match="being captured in the background already"):
            cgcompile.capture_all(background=True)
        assert cgcompile.capture_all(progress=False) == 0  # skipped, with a warning
        job.wait(timeout=120)


def test_a_thread_that_cannot_prepare_leaves_no_lock_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(self: SimulatedGraphRuntime) -> None:
        raise RuntimeError("no handles on this thread")

    monkeypatch.setattr(SimulatedGraphRuntime, "prepare_thread", broken)
    _, reference, compiled = compile_pair("cpu", **SIM)
    with torch.inference_mode():
        call_and_check(compiled, reference, 8, False, 0)
        job = cgcompile.capture_all(background=True)
        with pytest.raises(RuntimeError, match="no handles on this thread"):
            job.wait(timeout=120)
        assert job.keys_done == 0
        assert all(g.capture_turns is None for g in cgcompile.compiled_graphs())
        call_and_check(compiled, reference, 5, True, 1)


def test_calls_replay_the_smallest_captured_key_that_fits_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With only the largest key captured (the thread held before its second key), calls of
    other sizes replay it, padded further, instead of warming up their own key: a mixed call
    its PIECEWISE graphs, a decode call too (no FULL key is captured yet); exact throughout."""
    model, reference, compiled = compile_pair("cpu", **SIM)
    first_key, go_on = threading.Event(), threading.Event()
    capture_key, seen = bulk_capture.capture_key, []

    def held_after_first(graph: Any, *args: Any, **kwargs: Any) -> None:
        if graph is dynamic:
            seen.append(args)
            if len(seen) == 2:
                first_key.set()
                go_on.wait(60)
        capture_key(graph, *args, **kwargs)

    monkeypatch.setattr(bulk_capture, "capture_key", held_after_first)
    with torch.inference_mode():
        call_and_check(compiled, reference, 8, False, 0)
        call_and_check(compiled, reference, 1, True, 1)
        dynamic = cgcompile.compiled_graphs()[0]
        job = cgcompile.capture_all(background=True)
        try:
            assert first_key.wait(60)
            assert (
                seen[0][2:] == (CUDAGraphMode.PIECEWISE, seen[0][3]) and seen[0][3].num_tokens == 16
            )

            def warmups() -> int:
                return sum(sum(w.warmup_calls.values()) for w in dynamic.wrappers)

            before = warmups()
            with cgcompile.counters.expect(num_cudagraph_captured=0, num_eager_fallbacks=0):
                for seed, (n, decode) in enumerate([(3, False), (5, True), (9, False)]):
                    call_and_check(compiled, reference, n, decode, 10 + seed)
            assert warmups() == before  # every call replayed the key of 16 tokens
        finally:
            go_on.set()
        job.wait(timeout=60)
        soak(compiled, reference, 20)
        torch.testing.assert_close(_read_slots(model), _read_slots(reference))


class _PerBatchCache(torch.nn.Module):
    """A decode step writing a cache allocated for one batch size and passed at a static
    address (as Hugging Face's `StaticCache`), then attending over it: a graph of one size
    writes that size's cache."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        cache.index_copy_(1, pos, q[:, None])
        kv = cache[:, None]
        return self.o(F.scaled_dot_product_attention(q[:, None, None], kv, kv)[:, 0, 0])


def test_calls_meanwhile_never_replay_a_graph_of_another_sizes_cache() -> None:
    """Caches of 1, 2, 4 and 8 rows, random calls while `capture_all(background=True)` runs
    and after: every output equals eager's, and every cache once the thread is done (a call
    may not replay, padded, a graph captured with another size's cache: it would write that
    cache, not its own, and attend over it)."""
    options = {**SIM, "cudagraph_capture_sizes": [1, 2, 4, 8]}
    model = _PerBatchCache().eval()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    caches = {n: torch.zeros(n, 16, 8) for n in (1, 2, 4, 8)}
    theirs = {n: c.clone() for n, c in caches.items()}
    rng = random.Random(0)

    def call_both(n: int, seed: int) -> None:
        x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
        pos = torch.tensor([rng.randrange(16)])
        torch._dynamo.mark_static_address(caches[n])
        torch.testing.assert_close(compiled(x, caches[n], pos), reference(x, theirs[n], pos))
        if job is None or job.done:  # a simulated capture shows its writes until it ends
            for m in caches:
                torch.testing.assert_close(caches[m], theirs[m], msg=f"cache {m}, a call of {n}")

    job = None
    with torch.inference_mode():
        for seed, n in enumerate(caches):
            call_both(n, seed)
        job = cgcompile.capture_all(background=True)
        seed = 10
        while not job.done:
            call_both(rng.choice(list(caches)), seed)
            seed += 1
        job.wait(timeout=60)
        for seed in range(100, 150):
            call_both(rng.choice(list(caches)), seed)


def test_hf_static_caches_calls_during_background_capture_equal_eager() -> None:
    """HF Llama with a `StaticCache` per batch size, calls beside the thread."""
    with torch.inference_mode():
        _, during = hf_calls_beside_capture("cpu", **SIM)
    assert during >= 1
