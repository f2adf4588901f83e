"""Check one option value and return it normalised, or raise an error that names the key, the
value seen, what was expected and what to do.

`CompilationConfig.__post_init__` passes every field through these checks, so the constructor
and `from_options` accept the same values: numpy ints are ints (bools are not), enum-like
strings are case-insensitive, lists of sizes become sorted tuples. Wrong types raise
`ConfigTypeError`, wrong values `ConfigError`; both are `ConfigError`s.

    as_int("num_warmups", numpy.int64(2), 0, MAX_WARMUPS, "e.g. 1")   # 2
    as_choice("compiler", "Inductor", ("inductor", "eager"))          # "inductor"
"""

from __future__ import annotations

import difflib
import operator
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from cgcompile.errors import ConfigError, ConfigTypeError

MAX_CAPTURE_SIZE = 65536
"""The largest capture size, compile size and batch hint accepted. The dispatcher keeps tables
with an entry per token count up to the largest capture size and the backend static buffers of
that many rows, so an absurd size (2**40) would exhaust host memory instead of failing clearly."""
MAX_WARMUPS = 100
"""The most eager warm-up runs before a capture; more only delay start-up."""
TORCH_COMPILE_KEYS = ("guard_filter_fn", "use_aoti")
"""Keys `torch.compile` takes out of `options` itself: the backend never sees them."""

_OP_NAME = re.compile(r"^[A-Za-z_][\w]*::[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)?$")
_E = TypeVar("_E")


def show(value: Any, limit: int = 120) -> str:
    """`repr(value)`, cut short so a huge value cannot flood an error message."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-2:]}"


def as_options_dict(options: Any, valid: Sequence[str]) -> dict[str, Any]:
    """A copy of the user's options; not a dict, non-str or unknown keys raise."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ConfigTypeError(
            f"options must be a dict of option names to values, got {type(options).__name__} "
            f"{show(options)}; e.g. options={{'cudagraph_mode': 'PIECEWISE'}}"
        )
    bad = [k for k in options if not isinstance(k, str)]
    if bad:
        raise ConfigTypeError(
            f"option names must be strings, got {show(bad)}; valid options: {list(valid)}"
        )
    unknown = sorted(set(options) - set(valid))
    if unknown:
        # the key and its fix first: torch shows this line right under its own
        # "backend='cudagraph_modes' raised:", after Dynamo's traceback
        raise ConfigError(
            f"unknown option(s) {unknown}{_did_you_mean(unknown, valid)} "
            f"Valid options: {list(valid)}"
        )
    return dict(options)


def _did_you_mean(unknown: Sequence[str], valid: Sequence[str]) -> str:
    """`: did you mean 'x'?` for the valid names closest to the unknown ones (any case, or a
    valid name ending in the key: `mode` -> `cudagraph_mode`), else `.`."""
    guesses = {}
    for key in unknown:
        ends = [name for name in valid if name.endswith("_" + key.lower())]
        close = difflib.get_close_matches(key.lower(), valid, n=1) or ends[:1]
        if close:
            guesses[key] = close[0]
    if not guesses:
        return "."
    if len(unknown) == 1:
        return f": did you mean {next(iter(guesses.values()))!r}?"
    return ": did you mean " + ", ".join(f"{v!r} for {k!r}" for k, v in guesses.items()) + "?"


def as_index(value: Any) -> int | None:
    """`value` as an int if it is one (numpy ints and 0-d int tensors too), else None.
    Bools are not ints here: `True` as a size is a mistake, not 1."""
    if isinstance(value, bool) or getattr(value, "dtype", None) is torch.bool:
        return None
    try:
        return operator.index(value)
    except (TypeError, ValueError):
        return None


def as_int(key: str, value: Any, minimum: int, maximum: int, fix: str) -> int:
    """An int in [minimum, maximum]; `fix` tells the user what to give instead."""
    n = as_index(value)
    if n is None:
        raise ConfigTypeError(
            f"{key} must be an int >= {minimum}, got {type(value).__name__} {show(value)}; {fix}"
        )
    if not minimum <= n <= maximum:
        raise ConfigError(
            f"{key} must be an int >= {minimum} and <= {maximum}, got {show(value)}; {fix}"
        )
    return n


def as_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigTypeError(f"{key} must be True or False, got {show(value)}")
    return value


def as_choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    """One of `choices` (lower case), matched in any case."""
    if isinstance(value, str) and value.lower() in choices:
        return value.lower()
    error = ConfigError if isinstance(value, str) else ConfigTypeError
    raise error(f"{key} must be one of {list(choices)} (any case), got {show(value)}")


def parse_enum(cls: type[_E], value: Any, key: str) -> _E:
    """A member of the enum `cls`, or its name in any case."""
    if isinstance(value, cls):
        return value
    names = [m.name for m in cls]  # type: ignore[attr-defined]
    if isinstance(value, str) and value.upper() in names:
        return cls[value.upper()]  # type: ignore[index]
    error = ConfigError if isinstance(value, str) else ConfigTypeError
    raise error(f"{key} must be one of {names} (any case), got {show(value)}")


def as_list(key: str, value: Any) -> tuple[Any, ...]:
    """The items of a list, tuple, set or other iterable that is not a str, bytes or dict."""
    if not isinstance(value, (str, bytes, Mapping)) and isinstance(value, Iterable):
        try:
            return tuple(value)
        except TypeError:  # iterable by type, not by value: a 0-d tensor
            pass
    raise ConfigTypeError(f"{key} must be a list, got {type(value).__name__} {show(value)}")


def as_sizes(key: str, value: Any) -> tuple[int, ...]:
    """Batch sizes: ints in [1, MAX_CAPTURE_SIZE], de-duplicated and sorted."""
    items = as_list(key, value)
    sizes = [as_index(v) for v in items]
    if all(n is not None and 1 <= n <= MAX_CAPTURE_SIZE for n in sizes):
        return tuple(sorted(set(sizes)))  # type: ignore[type-var]
    message = f"{key} must be positive ints <= {MAX_CAPTURE_SIZE}, got {show(list(items))}"
    if None in sizes:
        raise ConfigTypeError(f"{message}; e.g. [1, 2, 4, 8]")
    if max(sizes) <= MAX_CAPTURE_SIZE:  # type: ignore[type-var]
        raise ConfigError(f"{message}; e.g. [1, 2, 4, 8]")
    raise ConfigError(
        f"{message}: per-token dispatch tables and static input buffers grow with the largest "
        f"size, so larger ones are refused; list the batch sizes you run, e.g. [1, 2, 4, 8, 512] "
        f"(batches above the largest capture size run without graphs)"
    )


def as_op_specs(key: str, value: Any) -> tuple[Any, ...] | None:
    """None (the default ops) or a tuple of op specs, each checked by `check_op_spec`."""
    if value is None:
        return None
    specs = as_list(key, value)
    for spec in specs:
        check_op_spec(key, spec)
    return specs


def check_op_spec(key: str, spec: Any) -> None:
    """An op spec is an 'ns::op' / 'ns::op.overload' name, an op object or a callable."""
    expected = "'ns::op' or 'ns::op.overload' names, op objects or callables"
    if isinstance(spec, str):
        if not _OP_NAME.match(spec):
            raise ConfigError(f"{key} takes {expected}, got {show(spec)}; e.g. 'mylib::attention'")
    elif isinstance(spec, (bytes, bytearray)):
        text = bytes(spec).decode(errors="replace")
        raise ConfigTypeError(f"{key} takes {expected}, got bytes {show(spec)}; pass {text!r}")
    elif not callable(spec):
        raise ConfigTypeError(
            f"{key} takes {expected}, got {type(spec).__name__} {show(spec)}; "
            f"e.g. 'mylib::attention' or torch.ops.mylib.attention"
        )
