"""Warm restart without Dynamo: compile a model ahead of time for example calls, save it, load it.

`precompile(model, examples, path, options)` gives a callable that computes what
`torch.compile(model, backend="cudagraph_modes", options=options)` computes. When `path` holds
a file that fits, nothing is traced: the file is loaded. Otherwise every example call (its
positional arguments as a tuple, or its keyword arguments as a dict) is compiled ahead of time
with torch's AOT compile (torch >= 2.10: Dynamo's bytecode and the guards that can cross
processes, `restart.portable`; one `SavedGraph` per example that no earlier example's
compile serves: with an unbacked batch, one for every size) and the file is written, with
this process's Inductor artifacts. The first `capture_all()` after the save adds the tuning of
the Triton kernels that ran (`saved_file.add_tuning`), so a loading process picks the saver's
kernel configs without timing them.

Steps of a load (`restart.saved_file`):
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
where none of them carries a mark, `precompile` marks their batch (`restart.examples`); where
the model fixes its batch size (a cache of one batch size) those marks fail, and each example
is compiled for its own shapes. The backend compiles with inference mode off, as Dynamo does,
so `torch.inference_mode()` serves as `torch.no_grad()` does. A model torch cannot AOT-compile
(a graph break, a model class defined in a function, torch < 2.10) is compiled just in time
at its first call, with one WARNING, and nothing is saved.

    step = cgcompile.precompile(model, [(tokens8, pos8), (tokens1, pos1)], "llama.cgaot")
    logits = step(tokens, positions)
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import pickle
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

from cgcompile import torch_features
from cgcompile.calls import live_graphs
from cgcompile.config import CompilationConfig
from cgcompile.errors import CGCompileError, ConfigError, ConfigTypeError
from cgcompile.options import TORCH_COMPILE_KEYS
from cgcompile.restart import load_steps, saved_file
from cgcompile.restart.compile_cache import precompile_header, source_checksum
from cgcompile.restart.examples import Example, call_of, dynamic_first, marked
from cgcompile.restart.portable import builtins_as_globals, closure_externals, portable_guards
from cgcompile.restart.precompiled import Precompiled, without_marks
from cgcompile.restart.saved_graph import saving_backend

logger = logging.getLogger(__name__)


def precompile(
    model: Callable[..., Any],
    examples: Sequence[Example],
    path: str | os.PathLike[str],
    options: dict[str, Any] | None = None,
) -> Precompiled:
    """Load `model`'s compiled functions from `path` if the file fits, else compile one per
    example call (a tuple of positional arguments or a dict of keyword arguments, batch dims
    marked with `mark_dynamic_batch`, or none marked: dim 0 of the batch tensors is) and save
    them there.
    Call it as you call the model (under `torch.no_grad()` or `torch.inference_mode()` for
    inference). See the module doc."""
    options = _check(model, examples, path, options)
    start = time.perf_counter()
    target = Path(path)
    if not torch_features.AOT_COMPILE.available:
        return _just_in_time(model, options, torch_features.AOT_COMPILE.why_missing())
    if isinstance(model, torch.nn.Module) and "<locals>" in _name(model):
        why = f"its class {_name(model)} is defined in a function: a saved file could not name it"
        return _just_in_time(model, options, why)
    given = list(examples)
    examples, auto = marked(given)
    examples = dynamic_first(examples)
    with load_steps.collecting() as steps:
        functions, why = saved_file.load(
            target, options, examples, given if auto else None, _forward(model)
        )
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
        functions = _compile_marked_else_static(model, examples, given, auto, target, options)
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


def _compile_marked_else_static(
    model: Callable[..., Any],
    examples: list[Example],
    given: list[Example],
    auto: bool,
    target: Path,
    options: dict[str, Any],
) -> list[Any]:
    """`_compile_and_save` of the examples; where `precompile` marked them (`auto`) and the
    model fixes its batch (a constraint violation), of the examples as given, each static."""
    try:
        with _quiet_guard_errors() if auto else contextlib.nullcontext():
            return _compile_and_save(model, examples, target, options)
    except ConstraintViolationError as exc:
        if not auto:
            raise
        logger.info(
            "precompile: %s fixes its batch size (%s): each example is compiled for its own shapes",
            _name(model),
            (str(exc).splitlines() or [""])[0],
        )
        return _compile_and_save(model, dynamic_first(given), target, options, "static")


@contextlib.contextmanager
def _quiet_guard_errors() -> Iterator[None]:
    """Torch logs a failed guard with its traceback at ERROR before raising; a batch marked by
    `precompile` that the model fixes fails so, is handled, and said at INFO instead."""
    guards = logging.getLogger("torch._guards")
    level = guards.level
    guards.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        guards.setLevel(level)


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
        or not all(isinstance(e, (tuple, dict)) for e in examples)
    ):
        raise ConfigTypeError(
            "precompile: examples must be a non-empty list of calls' arguments, one per kind of "
            "call: tuples of positional arguments, e.g. [(tokens8, positions8), (tokens1, "
            "positions1)], or dicts of keyword arguments, e.g. [{'input_ids': ids8}, ...]"
        )
    options = dict(options or {})
    given = sorted(set(options) & set(TORCH_COMPILE_KEYS))
    if given:
        raise ConfigError(f"precompile takes the backend's options only, not {given}")
    CompilationConfig.from_options(options)  # bad options raise before any compile
    return options


def _forward(model: Callable[..., Any]) -> Callable[..., Any]:
    return type(model).forward if isinstance(model, torch.nn.Module) else model


def _compile_and_save(
    model: Callable[..., Any],
    examples: list[Example],
    target: Path,
    options: dict[str, Any],
    batch: str = "marked",
) -> list[Any]:
    """Each example AOT-compiled (`batch`: "static" where the examples carry no marks), then
    saved with this process's Inductor artifacts."""
    forward = _forward(model)
    prefix = (model,) if isinstance(model, torch.nn.Module) else ()
    functions = []
    # static: each example for its own shapes, whatever sizes the others (or a failed marked
    # attempt) showed Dynamo for this code
    settings = {"enable_aot_compile": True, "automatic_dynamic_shapes": batch != "static"}
    with torch._dynamo.config.patch(**settings), builtins_as_globals():
        for i, example in enumerate(examples):
            args, kwargs = call_of(example)
            args = (*prefix, *args)
            if any(_fits(fn, args, kwargs) for fn in functions):
                logger.info(
                    "precompile: example %d is served by an earlier example's compile (an "
                    "unbacked batch serves every size): not traced again",
                    i,
                )
                continue
            guards = {"guard_filter_fn": portable_guards(forward, args, kwargs)}
            backend = saving_backend(options)
            wrapped = torch.compile(forward, backend=backend, fullgraph=True, options=guards)
            functions.append(wrapped.aot_compile((args, kwargs)))
    sources = {inspect.getmodule(forward).__name__} if inspect.getmodule(forward) else set()
    for fn in functions:
        info = fn.source_info() if hasattr(fn, "source_info") else None
        sources |= {s.module for s in getattr(info, "inlined_sources", ())}
    checksums = {m: c for m in sorted(sources) if (c := source_checksum(m)) is not None}
    header = {**precompile_header(options, examples, checksums), "batch": batch}
    try:
        digest = saved_file.save(target, functions, header, closure_externals(forward))
    except (OSError, pickle.PicklingError, AttributeError, TypeError, RuntimeError) as exc:
        # what pickling raises for what it cannot save (a class defined in a function: torch's
        # guards name the model's class), besides the file system's errors
        logger.warning("not saved to %s: %s; the next process compiles again", target, exc)
    else:  # the kernels tune on their first run: the file takes their picks after it
        live_graphs.after_capture_all(lambda: saved_file.add_tuning(target, digest))
    for fn in functions:
        fn.disable_guard_check()
    return functions


def _fits(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the AOT-compiled `fn`'s guards accept the call, its marked tensors checked
    unmarked as `Precompiled` checks calls (torch 2.11 saves an example's marks as absent)."""
    if fn.guard_check(*args, **kwargs):
        return True
    unmarked = without_marks(args, kwargs)
    return unmarked is not None and bool(fn.guard_check(*unmarked[0], **unmarked[1]))


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
