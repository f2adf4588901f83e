"""Shared test setup: the `cuda` marker, a clean Dynamo and graph registry per test,
hypothesis profiles."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("dev", max_examples=25, deadline=None)
settings.register_profile("ci", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    from cgcompile.calls import live_graphs
    from cgcompile.counters import counters

    counters.reset()
    # graphs of earlier tests live on until the collector frees their cycles: forget them, so
    # `compiled_graphs()` lists this test's only (a full collection per test costs ~0.1 s)
    live_graphs.forget_all()
