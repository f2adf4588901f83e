"""The library's exceptions.

Every error derives from `CGCompileError` and also from the builtin it refines, so callers can
catch either: `ConfigError` is a `ValueError`, `ConfigTypeError` (a value of the wrong type)
also a `TypeError`, `CaptureError` a `RuntimeError`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class CGCompileError(Exception):
    """Base class of every error raised by cgcompile."""


class ConfigError(CGCompileError, ValueError):
    """An option or a combination of options is invalid; the message names key, value, fix."""


class ConfigTypeError(ConfigError, TypeError):
    """An option or argument has the wrong type, e.g. a str where a list of sizes belongs."""


class CaptureError(CGCompileError, RuntimeError):
    """A CUDA graph could not be captured or would replay on the wrong memory."""


def capture_failed(fn: Callable[..., Any], exc: BaseException) -> CaptureError:
    """The `CaptureError` of a capture of `fn` that raised `exc` (raise it `from exc`)."""
    name = getattr(fn, "__qualname__", type(fn).__name__)
    return CaptureError(
        f"CUDA graph capture of {name} failed with {type(exc).__name__}: {exc}; ops that "
        f"synchronize (.item(), .cpu(), data-dependent shapes) or allocate pinned memory cannot "
        f"be captured"
    )
