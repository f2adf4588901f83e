"""What the installed torch can do, for features of cgcompile that need more than the oldest
supported torch (2.9.1).

A `TorchFeature` is detected from torch's own API when this module is imported (a nightly or a
backport counts by what it can do, not by its version string) and names the first release that
has it, for the warning a caller logs, the tests' skip reasons and docs/COMPATIBILITY.md. The
batch size hint (`mark_dynamic_batch(hint=...)`) is not here: every supported torch honours it.

    if not torch_features.SHARED_UNBACKED_BATCH.available:
        torch_features.warn_missing(torch_features.SHARED_UNBACKED_BATCH)
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

import torch
from torch._dynamo.decorators import mark_unbacked

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TorchFeature:
    """A feature that needs a newer torch, and what cgcompile does where torch lacks it."""

    name: str
    """What the user asks for, as they write it: `mark_dynamic_batch(unbacked=True)`."""
    needs: str
    """The first torch release that has it: `2.11`."""
    available: bool
    """Whether the installed torch has it."""
    instead: str
    """What cgcompile does instead on an older torch, as a clause: `the batch is marked ...`."""

    def why_missing(self) -> str:
        return (
            f"{self.name} needs torch >= {self.needs}; torch {torch.__version__} lacks it, "
            f"so {self.instead}"
        )


SHARED_UNBACKED_BATCH = TorchFeature(
    name="mark_dynamic_batch(unbacked=True)",
    # `shape_id` lets every input share one unbacked size; without it each input would get its
    # own, and ops joining them (tokens with positions) could not be traced
    needs="2.11",
    available="shape_id" in inspect.signature(mark_unbacked).parameters,
    instead="the batch is marked dynamic and backed: batch 1 is traced on its own (2 traces)",
)


AOT_COMPILE = TorchFeature(
    name="cgcompile.precompile",
    needs="2.10",
    available=hasattr(torch.compiler, "load_compiled_function")
    and hasattr(torch._dynamo.config, "enable_aot_compile"),
    instead="it compiles just in time and saves nothing (save_compile_cache serves a restart)",
)


@functools.cache  # once per feature and process: the caller may run on every input
def warn_missing(feature: TorchFeature) -> None:
    """Log at WARNING, once per feature, that the installed torch lacks `feature`."""
    logger.warning(
        "%s. Upgrade torch, or leave the feature off, to silence this.", feature.why_missing()
    )
