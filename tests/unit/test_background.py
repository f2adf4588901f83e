"""`capture_all(background=True)` on the simulated runtime: calls made while the thread captures
equal eager's (logits and KV caches), the thread captures every key, a failure is reported."""

from __future__ import annotations

import logging
import time

import pytest
import torch

import cgcompile
from cgcompile.calls import background, bulk_capture
from cgcompile.errors import CGCompileError
from cgcompile.graphs.simulated import SimulatedGraphRuntime
from examples.llama import _read_slots
from tests.support.background import call_and_check, calls_beside_capture, compile_pair, soak

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
