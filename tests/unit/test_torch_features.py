"""Features that need a newer torch: detection, the warning where torch lacks one, what runs
instead.

An old torch is simulated by replacing the detected feature with one marked unavailable.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import cgcompile
from cgcompile import torch_features
from cgcompile.torch_features import SHARED_UNBACKED_BATCH
from tests.support.requires import needs

LOGGER = "cgcompile.torch_features"


@pytest.fixture(autouse=True)
def _warn_afresh():
    torch_features.warn_missing.cache_clear()
    yield
    torch_features.warn_missing.cache_clear()


@pytest.fixture
def old_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = dataclasses.replace(SHARED_UNBACKED_BATCH, available=False)
    monkeypatch.setattr(torch_features, "SHARED_UNBACKED_BATCH", missing)


def _count_traces(unbacked: bool, sizes: tuple[int, ...] = (3, 1, 5)) -> int:
    counter = CompileCounter()
    f = torch.compile(lambda x: x * 2, backend=counter)
    for n in sizes:
        x = torch.randn(n)
        cgcompile.mark_dynamic_batch(x, unbacked=unbacked)
        torch.testing.assert_close(f(x), x * 2)
    return counter.frame_count


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_unbacked_batch_on_old_torch_warns_once_naming_the_version(old_torch, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _count_traces(unbacked=True)
        _count_traces(unbacked=True)
    (message,) = _warnings(caplog)  # 6 calls, one warning
    assert "mark_dynamic_batch(unbacked=True) needs torch >= 2.11" in message
    assert f"torch {torch.__version__} lacks it" in message


def test_unbacked_batch_on_old_torch_falls_back_to_a_backed_batch(old_torch):
    assert _count_traces(unbacked=True) == 2  # sizes >= 2, then batch 1 on its own


@needs(SHARED_UNBACKED_BATCH)
def test_unbacked_batch_on_new_torch_is_one_trace_and_silent(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert _count_traces(unbacked=True) == 1
    assert _warnings(caplog) == []


def test_backed_batch_never_warns(old_torch, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert _count_traces(unbacked=False) == 2
    assert _warnings(caplog) == []


def test_detected_feature_agrees_with_the_release_it_names():
    # torch.__version__ compares as a version: "2.10.0+cpu" < "2.11"
    assert SHARED_UNBACKED_BATCH.available == (torch.__version__ >= SHARED_UNBACKED_BATCH.needs)
