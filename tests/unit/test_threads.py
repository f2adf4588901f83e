"""The thread contract: a compiled graph's CUDA graphs belong to the first thread that calls it;
calls from other threads run the traced graph eagerly (warned once), so concurrent calls from
real threads all give eager's results; when the owner thread ends, the next caller takes over."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import cgcompile
from tests.support.models import MODES
from tests.support.semantics import check_threads_match_eager, compile_model, row_attention


def compile_rows(mode: str):
    return compile_model(row_attention, mode)


def call(f, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 8)
    cgcompile.mark_dynamic_batch(x)
    with torch.no_grad():
        return f(x).clone(), row_attention(x)


def run_threads(target, count: int) -> None:
    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.parametrize("mode", MODES)
def test_concurrent_calls_from_threads_equal_eager(mode, caplog):
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        check_threads_match_eager(mode)
    if mode != "NONE":
        assert sum("a call from a thread other than" in m for m in caplog.messages) == 1


def test_owner_thread_replays_while_others_run_eagerly():
    f = compile_rows("FULL")
    for _ in range(3):
        call(f, 4)  # warm-up, capture, replay
    before = cgcompile.counters.snapshot()
    run_threads(lambda i: call(f, 4), 2)
    after = cgcompile.counters.snapshot()
    assert after["num_eager_fallbacks"] - before["num_eager_fallbacks"] == 2
    assert after["num_cudagraph_captured"] == before["num_cudagraph_captured"]


def test_next_caller_owns_the_graphs_once_the_owner_ended():
    f = compile_rows("FULL")
    run_threads(lambda i: call(f, 4), 1)  # a thread that ends
    with cgcompile.counters.expect(num_cudagraph_captured=1, num_eager_fallbacks=0):
        for _ in range(3):
            got, want = call(f, 4)
            torch.testing.assert_close(got, want)


def test_capture_all_skips_graphs_another_live_thread_owns(caplog):
    f = compile_rows("FULL")
    call(f, 4)
    results: list[int] = []
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        run_threads(lambda i: results.append(cgcompile.capture_all(progress=False)), 1)
    assert results == [0]
    assert "capture_all skips it: its graphs belong to thread 'MainThread'" in caplog.text
    assert cgcompile.capture_all(progress=False) == 3  # 8, 4, 2 (a backed batch: not 1)
