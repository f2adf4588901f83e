"""A precompiled model's file: a header line, then the pickled compiled functions and this
process's Inductor artifacts (`restart.precompile` compiles what goes in).

    MAGIC
    {"torch": ..., "options": digest, "examples": digest, "sources": {module: checksum}, ...}
    pickle({"functions": [{"data": torch's saved function, "modules": module globals}],
            "cache": torch.compiler.save_cache_artifacts() bytes, "cache_keys": their keys})

`load` checks the header against this process before it unpickles anything, and times each
step (`load_steps`); a file that does not fit, or that torch fails to load, is refused with one
WARNING and the reason (the caller compiles and saves again). `save` writes a whole new file
beside the old and renames it: a reader never sees half a file.

Inductor tunes a Triton kernel (picks one of its configs by timing them) on the kernel's first
run, after the file was saved; a process loading the file would time them again, in its
capture, and may pick another config (other float rounding than the saver's). `add_tuning`
puts the saver's picks into the file once its kernels have run (the first `capture_all` after
the save calls it): the file is rewritten with this process's artifacts, which now hold them.

    functions, why = load(path, options, examples, unmarked, forward)   # None, why: refused
    digest = save(path, functions, header, closure_externals(forward))
    add_tuning(path, digest)                                            # after the kernels ran
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import pickle
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cgcompile.restart import load_steps
from cgcompile.restart.compile_cache import header_differences
from cgcompile.restart.examples import Example, dynamic_first
from cgcompile.restart.portable import (
    builtins_as_globals,
    closure_externals,
    import_globals,
    module_globals,
)

logger = logging.getLogger(__name__)

MAGIC = b"cgcompile-precompiled 4\n"
"""The format's version: raised when what a file holds no longer fits this code (3: the pieces
are lazy graph modules, so the saved Inductor artifacts of format 2 would all miss; 4: a
served batch-1 graph keeps its nodes apart from its placeholders)."""


def load(
    target: Path,
    options: dict[str, Any],
    examples: list[Example],
    unmarked: list[Example] | None,
    forward: Callable[..., Any],
) -> tuple[list[Any] | None, str]:
    """(the loaded functions, "") or (None, why not); each step timed (`load_steps`).
    `unmarked`: the examples before `precompile` marked them, which a file saved with static
    batches (`"batch": "static"` in its header) was compiled for."""
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
        if isinstance(header, dict) and header.get("batch") == "static" and unmarked:
            examples = dynamic_first(unmarked)
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
        externals = closure_externals(forward)
        with builtins_as_globals():
            functions = [_load_function(f, externals) for f in saved["functions"]]
        load_steps.add("torch's loader", time.perf_counter() - start)
    except Exception as exc:  # anything torch's loader raises: compile instead, say why
        logger.debug("loading %s failed", target, exc_info=True)
        return _refuse(target, f"loading it failed with {type(exc).__name__}: {exc}")
    return functions, ""


def _refuse(target: Path, why: str) -> tuple[None, str]:
    logger.warning("%s not loaded: %s; compiling the model and saving it again", target, why)
    return None, why


def _load_function(saved: dict[str, Any], externals: dict[str, Any]) -> Any:
    fn = torch.compiler.load_compiled_function(
        io.BytesIO(saved["data"]),
        f_globals=import_globals(saved["modules"]) or None,
        **({"external_data": externals} if externals else {}),
    )
    fn.disable_guard_check()  # Precompiled checks the guards before each call
    return fn


def save(
    target: Path, functions: list[Any], header: dict[str, Any], externals: dict[str, Any]
) -> str:
    """Write the functions and this process's Inductor artifacts (replaced whole); returns the
    file's digest (`add_tuning` rewrites only the file it wrote)."""
    saved_cache = torch.compiler.save_cache_artifacts()
    payload = pickle.dumps(
        {
            "functions": [
                {"data": _serialize(fn, externals), "modules": module_globals(fn)}
                for fn in functions
            ],
            "cache": saved_cache[0] if saved_cache is not None else None,
            "cache_keys": _keys(saved_cache),
        }
    )
    data = MAGIC + json.dumps(header).encode() + b"\n" + payload
    temporary = target.with_name(target.name + ".partial")
    temporary.write_bytes(data)
    temporary.replace(target)  # a reader never sees half a file
    logger.info("saved to %s: %d bytes", target, len(payload))
    return hashlib.sha256(data).hexdigest()


def add_tuning(target: Path, digest: str) -> None:
    """Replace the Inductor artifacts of the file `save` wrote at `target` (`digest`: what
    `save` returned) with this process's, which now hold the tuning of every kernel that ran;
    the functions stay as they are. Nothing is written if the file is gone or was saved again
    since, if no kernel was tuned, or if this process no longer holds every artifact the file
    does (torch's record cleared since the save) (one INFO line each); an error (the file system's,
    torch's) is one WARNING: the file stays as saved, the next process tunes again."""
    start = time.perf_counter()
    try:  # on capture_all's thread, maybe beside a compile that records artifacts
        saved_cache = torch.compiler.save_cache_artifacts()
        tuned = len(saved_cache[1].artifacts.get("autotune", [])) if saved_cache else 0
        if not tuned:
            logger.info("%s: no Triton kernel was tuned in this process: nothing to add", target)
            return
        data = target.read_bytes() if target.exists() else b""
        if hashlib.sha256(data).hexdigest() != digest:
            logger.info("%s is gone or was saved again since: kernel tuning not added", target)
            return
        header_line, _, payload = data[len(MAGIC) :].partition(b"\n")
        saved = pickle.loads(payload)
        ours = _keys(saved_cache)
        if any(
            not set(keys) <= set(ours.get(kind, ())) for kind, keys in saved["cache_keys"].items()
        ):
            logger.info(
                "%s: this process's artifacts lack some of the file's: tuning not added", target
            )
            return
        saved["cache"], saved["cache_keys"] = saved_cache[0], ours
        temporary = target.with_name(target.name + ".partial")
        temporary.write_bytes(MAGIC + header_line + b"\n" + pickle.dumps(saved))
        temporary.replace(target)
    except Exception as exc:  # noqa: BLE001 - the file stays as saved; nothing else depends on it
        logger.warning(
            "%s: kernel tuning not added (%r); the next process tunes again", target, exc
        )
        return
    logger.info(
        "%s: the tuning of %d Triton kernels added in %.3f s",
        target,
        tuned,
        time.perf_counter() - start,
    )


def _keys(saved_cache: Any) -> dict[str, list[str]]:
    """The artifacts' keys by kind (`add_tuning` replaces the file's only with a superset)."""
    return (
        {kind: list(keys) for kind, keys in saved_cache[1].artifacts.items()} if saved_cache else {}
    )


def _serialize(fn: Any, externals: dict[str, Any]) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "fn"
        if externals:  # references to the live forward's closure, not saved
            fn.save_compiled_function(str(file), external_data=externals)
        else:
            fn.save_compiled_function(str(file))
        return file.read_bytes()
