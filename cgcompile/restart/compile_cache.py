"""Warm restart: save what this process compiled, load it in a new process before compiling.

`save_compile_cache(path)` writes the artifacts torch's compile caches hold from this process
(`torch.compiler.save_cache_artifacts()`: Inductor's FX-graph and AOTAutograd cache entries,
with their Triton kernels, and Dynamo's dynamic-shape profiles) behind a header that names the
torch and cgcompile versions and the device. `load_compile_cache(path)`, in a new process before
the first call, puts them into the local caches, so compiling each piece becomes a cache lookup.
Dynamo still traces the model, cgcompile still splits it and captures its graphs.

`precompile_header` and `header_differences` are the same check for `cgcompile.precompile`'s
files, which also name the options, the examples and the model's source files.

Nothing is loaded wrong: a file from another torch, cgcompile or device is refused with one
WARNING and the process compiles as usual; the caches are keyed by graph, options and
configuration, so a changed model or option finds no entry and compiles anew, which the first
compile after such a load reports once at WARNING (`backend.inductor_cache.note_compiled`).

    cgcompile.save_compile_cache("llama.cgcache")   # after the first calls
    cgcompile.load_compile_cache("llama.cgcache")   # next process, before the first call
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch

from cgcompile.backend.inductor_cache import note_loaded
from cgcompile.config import CompilationConfig
from cgcompile.errors import CGCompileError
from cgcompile.graphs import device_name

logger = logging.getLogger(__name__)

MAGIC = b"cgcompile-compile-cache 1\n"


def _version() -> str:
    try:
        return importlib.metadata.version("cgcompile")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout on PYTHONPATH
        return "checkout"


def process_header() -> dict[str, str]:
    """What must match between the saving and the loading process."""
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    return {
        "torch": torch.__version__,
        "cgcompile": _version(),
        "python": python,
        "device": device_name(),
    }


def precompile_header(
    options: dict[str, Any],
    examples: list[tuple[Any, ...] | dict[str, Any]],
    sources: dict[str, str],
) -> dict[str, Any]:
    """A precompiled file's header (`restart.precompile`): `process_header`, digests of the
    options and of the examples (with the grad mode), and the checksums of the source files
    Dynamo traced (`sources`, by module name)."""
    config = repr(CompilationConfig.from_options(options))
    return {
        **process_header(),
        "options": _digest(config),
        "examples": _digest(repr([_describe(e) for e in examples] + [torch.is_grad_enabled()])),
        "sources": sources,
    }


def header_differences(
    saved: dict[str, Any], options: dict[str, Any], examples: list[tuple[Any, ...] | dict[str, Any]]
) -> list[str]:
    """How the process that saved a precompiled file differs from this one (empty: it fits)."""
    ours = precompile_header(options, examples, {})
    differ = [
        f"{k} {saved.get(k)!r} (here {v!r})"
        for k, v in ours.items()
        if k != "sources" and saved.get(k) != v
    ]
    for module, checksum in saved.get("sources", {}).items():
        if source_checksum(module) != checksum:
            differ.append(f"the source of {module} changed")
    return differ


def source_checksum(module_name: str) -> str | None:
    """A digest of a module's source, None where it has none (a built-in, a missing file)."""
    try:
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
        source = inspect.getsource(module)
    except (ImportError, OSError, TypeError):
        return None
    return _digest(source)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _describe(example: tuple[Any, ...] | dict[str, Any]) -> Any:
    """What the example calls' guards depend on, per argument (`_describe_value`)."""
    return _describe_value(example)


def _describe_value(value: Any) -> Any:
    """A tensor's dtype, device, grad flag, shape (marked dims as -1) and whether it is an
    inference tensor (made under `torch.inference_mode()`: its dispatch keys differ); a plain
    value itself; a list, tuple or dict item by item; any other object its class (its repr
    may name its address, which differs in every process)."""
    if isinstance(value, torch.Tensor):
        dynamic = getattr(value, "_dynamo_dynamic_indices", set())
        shape = [-1 if d in dynamic else n for d, n in enumerate(value.shape)]
        flags = (value.requires_grad, value.is_inference())
        return (str(value.dtype), value.device.type, *flags, shape)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, *(_describe_value(v) for v in value)]
    if isinstance(value, dict):
        return {repr(k): _describe_value(v) for k, v in value.items()}
    return f"{type(value).__module__}.{type(value).__qualname__}"


def save_compile_cache(path: str | os.PathLike[str]) -> Path:
    """Write this process's compiled artifacts to `path` (replaced whole, never half written).
    `CGCompileError` if nothing was compiled yet. Returns the path."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        raise CGCompileError(
            "save_compile_cache: this process has compiled nothing yet; call the compiled model "
            "(every batch kind you serve) first, then save"
        )
    payload, info = saved
    target = Path(path)
    temporary = target.with_name(target.name + ".partial")
    temporary.write_bytes(MAGIC + json.dumps(process_header()).encode() + b"\n" + payload)
    temporary.replace(target)  # a reader never sees half a file
    kinds = {kind: len(keys) for kind, keys in info.artifacts.items() if keys}
    logger.info("compile cache saved to %s: %d bytes, artifacts %s", target, len(payload), kinds)
    return target


def load_compile_cache(path: str | os.PathLike[str]) -> bool:
    """Put the artifacts saved at `path` into this process's compile caches; call it before the
    first call of a compiled model. False, and the process compiles as usual, when there is no
    file (INFO) or it does not fit this process (one WARNING saying why)."""
    target = Path(path)
    if not target.exists():
        logger.info("no compile cache at %s: compiling as usual", target)
        return False
    header, payload = _read(target)
    if header is None:
        logger.warning("%s is not a cgcompile compile cache: compiling as usual", target)
        return False
    ours = process_header()
    differ = [f"{k} {header.get(k)!r} (here {v!r})" for k, v in ours.items() if header.get(k) != v]
    if differ:
        logger.warning(
            "compile cache %s was saved with %s: not loaded, compiling as usual",
            target,
            "; ".join(differ),
        )
        return False
    info = torch.compiler.load_cache_artifacts(payload)
    kinds = {kind: len(keys) for kind, keys in info.artifacts.items() if keys} if info else {}
    note_loaded(str(target))
    logger.info("compile cache loaded from %s: artifacts %s", target, kinds)
    return True


def _read(target: Path) -> tuple[dict[str, str] | None, bytes]:
    data = target.read_bytes()
    if not data.startswith(MAGIC):
        return None, b""
    line, _, payload = data[len(MAGIC) :].partition(b"\n")
    try:
        header = json.loads(line)
    except ValueError:
        return None, b""
    return (header if isinstance(header, dict) else None), payload
