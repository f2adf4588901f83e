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

Calls go through `restart.precompiled.Precompiled` (guards checked per call, a call that fits
no example compiled just in time). Calls need no `mark_dynamic_batch`; the examples do, and
where none of them carries a mark, `precompile` marks dim 0 of their batch tensors (those whose
dim 0 differs between examples, else those whose dim 0 is the first tensor's) on aliases of
them. The backend compiles with inference mode off, as Dynamo does, so `torch.inference_mode()`
serves as `torch.no_grad()` does. A model torch cannot AOT-compile (a graph break, a class
defined in a function, torch < 2.10) is compiled just in time at its first call, with one
WARNING, and nothing is saved.

    step = cgcompile.precompile(model, [(tokens8, pos8), (tokens1, pos1)], "llama.cgaot")
    logits = step(tokens, positions)
"""

from __future__ import annotations

import inspect
import io
import json
import logging
import os
import pickle
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from cgcompile import torch_features
from cgcompile.config import CompilationConfig
from cgcompile.dynamic import mark_dynamic_batch
from cgcompile.errors import CGCompileError, ConfigError, ConfigTypeError
from cgcompile.options import TORCH_COMPILE_KEYS
from cgcompile.restart import load_steps
from cgcompile.restart.compile_cache import header_differences, precompile_header, source_checksum
from cgcompile.restart.precompiled import Precompiled
from cgcompile.restart.saved_graph import saving_backend

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
    `mark_dynamic_batch`, or none marked: dim 0 of the batch tensors is) and save them there.
    Call it as you call the model (under `torch.no_grad()` or `torch.inference_mode()` for
    inference). See the module doc."""
    options = _check(model, examples, path, options)
    start = time.perf_counter()
    target = Path(path)
    if not torch_features.AOT_COMPILE.available:
        return _just_in_time(model, options, torch_features.AOT_COMPILE.why_missing())
    examples = _dynamic_first(_marked(examples))
    with load_steps.collecting() as steps:
        functions, why = _load(target, options, examples)
    if functions is not None:
        seconds = time.perf_counter() - start
        steps = load_steps.inside_torch(steps)
        logger.info(
            "precompiled %s loaded from %s in %.2fs: %s",
            _name(model),
            target,
            seconds,
            load_steps.describe(steps),
        )
        return Precompiled(model, options, functions, True, None, seconds, steps)
    try:
        functions = _compile_and_save(model, examples, target, options)
    except CGCompileError:
        raise
    except Exception as exc:  # torch cannot AOT-compile it: a graph break, unsavable guards
        logger.debug("AOT compile of %s failed", _name(model), exc_info=True)
        first_line = (str(exc).splitlines() or [""])[0]
        why = f"torch's AOT compile failed with {type(exc).__name__}: {first_line}"
        fix = "; save_compile_cache after the first calls still speeds up a restart"
        return _just_in_time(model, options, why, fix)
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


def _marked(examples: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The examples as given if one of their tensors carries a mark (the caller chose); else
    with their batch tensors (`_batch_positions`) replaced by aliases (same storage) that
    `mark_dynamic_batch` marks at dim 0, so the caller's tensors stay unmarked."""
    if any(_has_marks(a) for example in examples for a in example):
        return list(examples)
    positions = _batch_positions(examples)
    if not positions:  # no tensor with a dim 0 in every example
        return list(examples)
    marked = []
    for example in examples:
        aliases = tuple(_alias(a) if i in positions else a for i, a in enumerate(example))
        mark_dynamic_batch(*(aliases[i] for i in positions))
        marked.append(aliases)
    logger.info("precompile: no example was marked: dim 0 of arguments %s marked", positions)
    return marked


def _has_marks(value: Any) -> bool:
    """A tensor marked by `mark_dynamic_batch`, torch's `mark_dynamic` or `mark_static`."""
    names = vars(value) if isinstance(value, torch.Tensor) else ()
    return any(n.startswith("_dynamo_") and n.endswith("_indices") for n in names)


def _alias(t: torch.Tensor) -> torch.Tensor:
    alias = t.detach()
    return alias.requires_grad_() if t.requires_grad else alias


def _batch_positions(examples: Sequence[tuple[Any, ...]]) -> list[int]:
    """The positions of the arguments whose dim 0 is the batch: the tensors whose dim 0
    differs between examples, or, where none does, those whose dim 0 is the first tensor's."""
    tensors = [
        i
        for i in range(min(len(e) for e in examples))
        if all(isinstance(e[i], torch.Tensor) and e[i].dim() > 0 for e in examples)
    ]
    varying = [i for i in tensors if len({e[i].shape[0] for e in examples}) > 1]
    if not varying:
        first = examples[0][tensors[0]].shape[0] if tensors else None
        return [i for i in tensors if examples[0][i].shape[0] == first]
    for example in examples:
        if len({example[i].shape[0] for i in varying}) > 1:
            raise ConfigError(
                f"precompile marks the batch of unmarked examples, dim 0 of the tensors whose "
                f"dim 0 differs between examples (arguments {varying}), but they disagree "
                f"within one example: shapes {[tuple(example[i].shape) for i in varying]}; "
                f"mark each example's batch tensors yourself with "
                f"cgcompile.mark_dynamic_batch(tokens, positions)"
            )
    return varying


def _dynamic_first(examples: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Examples with a dynamic batch before the others: a batch-1 graph is then served by the
    dynamic graph's compile, here and after a load."""

    def is_static(example: tuple[Any, ...]) -> bool:  # a marked size 1 is specialised
        tensors = [a for a in example if isinstance(a, torch.Tensor)]
        return not any(
            getattr(t, "_dynamo_unbacked_indices", None)
            or any(t.shape[d] != 1 for d in getattr(t, "_dynamo_dynamic_indices", ()))
            for t in tensors
        )

    return sorted(examples, key=is_static)


def _load(
    target: Path, options: dict[str, Any], examples: list[tuple[Any, ...]]
) -> tuple[list[Any] | None, str]:
    """(the loaded functions, "") or (None, why not); each step timed (`load_steps`)."""
    if not target.exists():
        return None, f"no file at {target}"
    with load_steps.step("read"):
        data = target.read_bytes()
    with load_steps.step("header"):
        header_line, _, payload = data[len(MAGIC) :].partition(b"\n")
        try:
            header = json.loads(header_line) if data.startswith(MAGIC) else None
        except ValueError:
            header = None
        differ = header_differences(header, options, examples) if isinstance(header, dict) else []
    if not isinstance(header, dict):
        return _refuse(target, "it is not a precompiled cgcompile model")
    if differ:
        return _refuse(target, "it was saved with " + "; ".join(differ))
    try:
        with load_steps.step("unpickle"):
            saved = pickle.loads(payload)
        if saved["cache"] is not None:
            with load_steps.step("inductor artifacts"):
                torch.compiler.load_cache_artifacts(saved["cache"])
        start = time.perf_counter()
        functions = [_load_function(b) for b in saved["functions"]]
        load_steps.add("torch's loader", time.perf_counter() - start)
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
    checksums = {m: c for m in sorted(sources) if (c := source_checksum(m)) is not None}
    try:
        _save(target, functions, precompile_header(options, examples, checksums))
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


def _just_in_time(
    model: Callable[..., Any], options: dict[str, Any], why: str, fix: str = ""
) -> Precompiled:
    """The model compiled just in time at its first call, nothing saved: what torch cannot
    AOT-compile (`fix`: what helps instead). The examples are not run (a call may write the
    model's state)."""
    logger.warning(
        "%s is not precompiled (%s): compiled just in time, not saved%s", _name(model), why, fix
    )
    compiled = Precompiled(model, options, [], False, why, 0.0)
    compiled._compile_just_in_time()
    return compiled


def _name(model: Any) -> str:
    named = type(model) if isinstance(model, torch.nn.Module) else model
    return getattr(named, "__qualname__", "the model")
