"""Warm restart without Dynamo: compile a model ahead of time for example calls, save it, load it.

`precompile(model, examples, path, options)` gives a callable that computes what
`torch.compile(model, backend="cudagraph_modes", options=options)` computes. When `path` holds
a file that fits, nothing is traced: the file is loaded. Otherwise every example call is
compiled ahead of time with torch's AOT compile (torch >= 2.10: Dynamo's bytecode and guards,
one `SavedGraph` per example) and the file is written, with this process's Inductor artifacts.

Steps of a load:
1. read the header and compare it with this process: cgcompile, torch and Python versions, the
   GPU, digests of the options and of the examples (dtypes, devices, shapes but the marked
   dims, grad mode), the checksums of every source file Dynamo traced; any
   difference, or a file that fails to load, is logged once at WARNING with the reason, and the
   model is compiled and saved again (never loaded wrong);
2. put the saved Inductor artifacts into this process's caches
   (`torch.compiler.load_cache_artifacts`);
3. load each compiled function, in the saved order (dynamic-batch examples first, so a batch-1
   graph finds the dynamic graph that serves it): each rebuilds its graph from the saved Dynamo
   graph, its Inductor compiles cache lookups.

Calls go through `runtime.precompiled.Precompiled` (guards checked per call, a call that fits
no example compiled just in time). Calls need no `mark_dynamic_batch`: it marks the examples.
A model torch cannot AOT-compile (a graph break, a class defined in a function, torch < 2.10)
is compiled just in time at its first call, with one WARNING, and nothing is saved.

    step = cgcompile.precompile(model, [(tokens8, pos8), (tokens1, pos1)], "llama.cgaot")
    logits = step(tokens, positions)
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import io
import json
import logging
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from cgcompile import torch_features
from cgcompile.backend.compile_cache import process_header
from cgcompile.backend.saved_graph import saving_backend
from cgcompile.config import CompilationConfig
from cgcompile.errors import CGCompileError, ConfigError, ConfigTypeError
from cgcompile.options import TORCH_COMPILE_KEYS
from cgcompile.runtime.precompiled import Precompiled

logger = logging.getLogger(__name__)

MAGIC = b"cgcompile-precompiled 1\n"


def precompile(
    model: Callable[..., Any],
    examples: Sequence[tuple[Any, ...]],
    path: str | os.PathLike[str],
    options: dict[str, Any] | None = None,
) -> Precompiled:
    """Load `model`'s compiled functions from `path` if the file fits, else compile one per
    example call (a tuple of positional arguments, batch dims marked with
    `mark_dynamic_batch`) and save them there. Call it as you call the model (under
    `torch.no_grad()` for inference). See the module doc."""
    options = _check(model, examples, path, options)
    start = time.perf_counter()
    target = Path(path)
    if not torch_features.AOT_COMPILE.available:
        return _just_in_time(model, options, torch_features.AOT_COMPILE.why_missing())
    examples = _dynamic_first(examples)
    functions, why = _load(target, options, examples)
    if functions is not None:
        seconds = time.perf_counter() - start
        logger.info("precompiled %s loaded from %s in %.2fs", _name(model), target, seconds)
        return Precompiled(model, options, functions, True, None, seconds)
    try:
        functions = _compile_and_save(model, examples, target, options)
    except CGCompileError:
        raise
    except Exception as exc:  # torch cannot AOT-compile it: a graph break, unsavable guards
        logger.debug("AOT compile of %s failed", _name(model), exc_info=True)
        first_line = (str(exc).splitlines() or [""])[0]
        why = f"torch's AOT compile failed with {type(exc).__name__}: {first_line}"
        return _just_in_time(model, options, why)
    seconds = time.perf_counter() - start
    logger.info("%s precompiled in %.2fs", _name(model), seconds)
    return Precompiled(model, options, functions, False, why, seconds)


def _check(model: Any, examples: Any, path: Any, options: dict[str, Any] | None) -> dict[str, Any]:
    if not callable(model):
        raise ConfigTypeError(
            f"precompile takes a module or a function, got {type(model).__name__}"
        )
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigTypeError(f"precompile: path must be a file path, got {type(path).__name__}")
    if (
        not isinstance(examples, Sequence)
        or not examples
        or not all(isinstance(e, tuple) for e in examples)
    ):
        raise ConfigTypeError(
            "precompile: examples must be a non-empty list of argument tuples, one per kind of "
            "call, e.g. [(tokens8, positions8), (tokens1, positions1)]"
        )
    options = dict(options or {})
    given = sorted(set(options) & set(TORCH_COMPILE_KEYS))
    if given:
        raise ConfigError(f"precompile takes the backend's options only, not {given}")
    CompilationConfig.from_options(options)  # bad options raise before any compile
    return options


def _dynamic_first(examples: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Examples with a dynamic batch before the others: a batch-1 graph is then served by the
    dynamic graph's compile, here and after a load."""

    def is_static(example: tuple[Any, ...]) -> bool:
        return not any(hasattr(a, "_dynamo_dynamic_indices") for a in example)

    return sorted(examples, key=is_static)


def _header(
    options: dict[str, Any], examples: list[tuple[Any, ...]], sources: dict[str, str]
) -> dict[str, Any]:
    config = repr(CompilationConfig.from_options(options))
    return {
        **process_header(),
        "options": _digest(config),
        "examples": _digest(repr([_describe(e) for e in examples] + [torch.is_grad_enabled()])),
        "sources": sources,
    }


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _describe(example: tuple[Any, ...]) -> list[Any]:
    """What the example calls' guards depend on: each tensor's dtype, device, grad flag and
    shape (marked dims as -1); other arguments' values."""
    described: list[Any] = []
    for a in example:
        if isinstance(a, torch.Tensor):
            dynamic = getattr(a, "_dynamo_dynamic_indices", set())
            shape = [-1 if d in dynamic else n for d, n in enumerate(a.shape)]
            described.append((str(a.dtype), a.device.type, a.requires_grad, shape))
        else:
            described.append(repr(a))
    return described


def _source_checksum(module_name: str) -> str | None:
    try:
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
        source = inspect.getsource(module)
    except (ImportError, OSError, TypeError):
        return None
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def _differences(
    saved: dict[str, Any], options: dict[str, Any], examples: list[tuple[Any, ...]]
) -> list[str]:
    """How the saving process differs from this one (empty: the file fits)."""
    ours = _header(options, examples, {})
    differ = [
        f"{k} {saved.get(k)!r} (here {v!r})"
        for k, v in ours.items()
        if k != "sources" and saved.get(k) != v
    ]
    for module, checksum in saved.get("sources", {}).items():
        if _source_checksum(module) != checksum:
            differ.append(f"the source of {module} changed")
    return differ


def _load(
    target: Path, options: dict[str, Any], examples: list[tuple[Any, ...]]
) -> tuple[list[Any] | None, str]:
    """(the loaded functions, "") or (None, why not)."""
    if not target.exists():
        return None, f"no file at {target}"
    data = target.read_bytes()
    header_line, _, payload = data[len(MAGIC) :].partition(b"\n")
    try:
        header = json.loads(header_line) if data.startswith(MAGIC) else None
    except ValueError:
        header = None
    if not isinstance(header, dict):
        return _refuse(target, "it is not a precompiled cgcompile model")
    differ = _differences(header, options, examples)
    if differ:
        return _refuse(target, "it was saved with " + "; ".join(differ))
    try:
        saved = pickle.loads(payload)
        if saved["cache"] is not None:
            torch.compiler.load_cache_artifacts(saved["cache"])
        functions = [_load_function(b) for b in saved["functions"]]
    except Exception as exc:  # anything torch's loader raises: compile instead, say why
        logger.debug("loading %s failed", target, exc_info=True)
        return _refuse(target, f"loading it failed with {type(exc).__name__}: {exc}")
    return functions, ""


def _refuse(target: Path, why: str) -> tuple[None, str]:
    logger.warning("%s not loaded: %s; compiling the model and saving it again", target, why)
    return None, why


def _load_function(data: bytes) -> Any:
    fn = torch.compiler.load_compiled_function(io.BytesIO(data))
    fn.disable_guard_check()  # Precompiled checks the guards before each call
    return fn


def _compile_and_save(
    model: Callable[..., Any],
    examples: list[tuple[Any, ...]],
    target: Path,
    options: dict[str, Any],
) -> list[Any]:
    forward = type(model).forward if isinstance(model, torch.nn.Module) else model
    prefix = (model,) if isinstance(model, torch.nn.Module) else ()
    with torch._dynamo.config.patch(enable_aot_compile=True):
        wrapped = torch.compile(forward, backend=saving_backend(options), fullgraph=True)
    functions = [wrapped.aot_compile(((*prefix, *example), {})) for example in examples]
    sources = {inspect.getmodule(forward).__name__} if inspect.getmodule(forward) else set()
    for fn in functions:
        info = fn.source_info() if hasattr(fn, "source_info") else None
        sources |= {s.module for s in getattr(info, "inlined_sources", ())}
    checksums = {m: c for m in sorted(sources) if (c := _source_checksum(m)) is not None}
    try:
        _save(target, functions, _header(options, examples, checksums))
    except (OSError, pickle.PicklingError, AttributeError, TypeError, RuntimeError) as exc:
        # what pickling raises for what it cannot save (a class defined in a function: torch's
        # guards name the model's class), besides the file system's errors
        logger.warning("not saved to %s: %s; the next process compiles again", target, exc)
    for fn in functions:
        fn.disable_guard_check()
    return functions


def _save(target: Path, functions: list[Any], header: dict[str, Any]) -> None:
    """Write the functions and this process's Inductor artifacts (replaced whole)."""
    saved_cache = torch.compiler.save_cache_artifacts()
    payload = pickle.dumps(
        {
            "functions": [_serialize(fn) for fn in functions],
            "cache": saved_cache[0] if saved_cache is not None else None,
        }
    )
    temporary = target.with_name(target.name + ".partial")
    temporary.write_bytes(MAGIC + json.dumps(header).encode() + b"\n" + payload)
    temporary.replace(target)  # a reader never sees half a file
    logger.info("saved to %s: %d bytes", target, len(payload))


def _serialize(fn: Any) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "fn"
        fn.save_compiled_function(str(file))
        return file.read_bytes()


def _just_in_time(model: Callable[..., Any], options: dict[str, Any], why: str) -> Precompiled:
    """The model compiled just in time at its first call, nothing saved: what torch cannot
    AOT-compile. The examples are not run (a call may write the model's state)."""
    logger.warning(
        "%s is not precompiled (%s): compiled just in time, not saved", _name(model), why
    )
    compiled = Precompiled(model, options, [], False, why, 0.0)
    compiled._compile_just_in_time()
    return compiled


def _name(model: Any) -> str:
    named = type(model) if isinstance(model, torch.nn.Module) else model
    return getattr(named, "__qualname__", "the model")
