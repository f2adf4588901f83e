"""Skip markers for tests that need a newer torch than the oldest supported one.

@needs(SHARED_UNBACKED_BATCH)  # skipped on torch < 2.11, the reason names the version
def test_one_trace_for_every_size(): ...
"""

from __future__ import annotations

import pytest

from cgcompile.torch_features import TorchFeature


def needs(feature: TorchFeature) -> pytest.MarkDecorator:
    """Skip where the installed torch lacks `feature`, saying which release has it."""
    return pytest.mark.skipif(not feature.available, reason=feature.why_missing())
