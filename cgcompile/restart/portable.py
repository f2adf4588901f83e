"""What of a compiled function can cross into another process, and how the rest is supplied there.

Torch's AOT compile saves Dynamo's guards and bytecode by pickling the objects they name. Three
kinds of object cannot be pickled, and a model that uses them (Hugging Face transformers 5: its
decorated forwards and the `kernels` wrappers of functions such as `apply_rotary_pos_emb`)
could not be saved:

- **Guards on identity.** Without a filter torch's AOT compile drops the guards on globals and
  those of the kinds it cannot save (`UNSUPPORTED_SERIALIZATION_GUARD_TYPES`: ID_MATCH,
  FUNCTION_MATCH, CLOSURE_MATCH, ...), and fails on the rest. `portable_guards` drops the same,
  and also guards whose derived kinds are such, TYPE_MATCH on a class defined in a function
  (it exists in one process only), and every guard whose source passes through a function
  that pickle cannot find by its qualified name (a decorator's inner function: its name leads
  to the wrapper; torch would save it as missing and fail to rebuild the guard at load). What
  these guards pinned (which function, which class) is fixed by the source code, which the
  file's header checksums for every traced module; the guards on the call's values (tensors,
  shapes, constants, attributes, global state) are kept.
- **A forward's closure** holding such a function (a decorated forward closes over the
  undecorated one): `closure_externals(forward)` names them; they are saved as references
  (torch's `external_data`) and taken from the live class's forward at load.
- **Modules Dynamo installs as globals** (`___module_<name>_<id>_c<n>`, where the forward's
  code reads a module through another module's globals): `module_globals(fn)` records their
  module names at save, `import_globals` imports them at load; and on torch 2.11 the builtins
  the bytecode names (`builtins_as_globals`).

    guards = portable_guards(forward, (model, *args), kwargs)
    fn = torch.compile(forward, backend=..., options={"guard_filter_fn": guards}).aot_compile(
        ((model, *args), kwargs))
    saved = (fn.save_compiled_function(path, external_data=closure_externals(forward)),
             module_globals(fn))
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import inspect
import logging
import re
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

_MODULE_GLOBAL = re.compile(r"^___module_\w+?_(\d+)_c\d+$")
_LOCAL_TYPE_GUARDS = ("TYPE_MATCH", "BUILTIN_MATCH")


def _identity_guard_types() -> frozenset[str]:
    manager = torch._dynamo.guards.CheckFunctionManager
    return frozenset(getattr(manager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", ()))


def findable(value: Any) -> bool:
    """False for a function that pickle cannot find by its module and qualified name (a
    decorator's inner function); True for anything else. Functions defined in a function
    (`<locals>`) are saved by their code, so they count as findable."""
    if not isinstance(value, types.FunctionType) or "<locals>" in value.__qualname__:
        return True
    found: Any = sys.modules.get(value.__module__)
    for name in value.__qualname__.split("."):
        found = getattr(found, name, None)
    return found is value


def portable_guards(
    forward: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> Callable[[Sequence[Any]], list[bool]]:
    """A `guard_filter_fn` for the AOT compile of `forward(*args, **kwargs)` that keeps every
    guard a saved file can rebuild in another process (see the module doc)."""
    identity = _identity_guard_types()
    scope = frame_scope(forward, args, kwargs)
    helpers = getattr(torch._dynamo.guards, "_get_closure_vars", dict)()  # names sources use

    def keep(entries: Sequence[Any]) -> list[bool]:
        values: dict[Any, Any] = {}  # a source's value, evaluated once for all guards
        kept = [_portable(entry, identity, (scope, helpers), values) for entry in entries]
        dropped = [e.name for e, k in zip(entries, kept, strict=True) if not k]
        if dropped:
            logger.info(
                "precompile: %d of %d guards are not saved (on globals, or pinning objects of "
                "this process only: identities, local classes, decorated functions); the "
                "source checksums stand for them",
                len(dropped),
                len(entries),
            )
            logger.debug("guards not saved: %s", dropped)
        return kept

    return keep


def _portable(
    entry: Any,
    identity: frozenset[str],
    scope: tuple[dict[str, Any], dict[str, Any]],
    values: dict[Any, Any],
) -> bool:
    """Whether `entry`'s guard can be saved and rebuilt elsewhere; `scope`: the names its
    source is written in and Dynamo's helpers; `values`: sources already evaluated."""
    if getattr(entry, "is_global", False) or entry.guard_type in identity:
        return False
    if identity.intersection(getattr(entry, "derived_guard_types", None) or ()):
        return False
    if entry.guard_type in _LOCAL_TYPE_GUARDS and entry.has_value:
        if "<locals>" in type(entry.value).__qualname__:
            return False
    source = getattr(getattr(entry, "orig_guard", None), "originating_source", None)
    while (source := getattr(source, "base", None)) is not None:
        try:
            value = source.get_value(*scope, values)
        except Exception:  # a source Python cannot evaluate here: nothing known against it
            continue
        if not findable(value):
            return False
    return True


def frame_scope(
    forward: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The names Dynamo's guard sources are written in for a call `forward(*args, **kwargs)`:
    `L`, the frame's locals (its bound arguments and closure), `G`, its globals."""
    try:
        cells = zip(forward.__code__.co_freevars, forward.__closure__ or (), strict=True)
        local = {name: cell.cell_contents for name, cell in cells}
        bound = inspect.signature(forward, follow_wrapped=False).bind(*args, **kwargs)
        bound.apply_defaults()
        local.update(bound.arguments)
        found = {"L": local, "G": forward.__globals__}
    except (AttributeError, TypeError, ValueError):  # not a plain function: no sources evaluate
        found = {"L": {}, "G": {}}
    return {**found, "__builtins__": builtins.__dict__}


def closure_externals(forward: Callable[..., Any]) -> dict[str, Any]:
    """The functions in `forward`'s closure that pickle cannot find by name, keyed by their
    place: saved as references, supplied from the live `forward` when loading."""
    cells = getattr(forward, "__closure__", None) or ()
    found = {}
    for i, cell in enumerate(cells):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if not findable(value):
            found[f"closure {i}"] = value
    return found


def module_globals(fn: Any) -> dict[str, str]:
    """The modules an AOT-compiled function's bytecode reads as globals that Dynamo installed,
    by module name (only this process knows them by id)."""
    env = getattr(getattr(fn, "_artifacts", None), "runtime_env", None)
    if env is None:  # a torch that keeps no runtime environment: nothing to record
        return {}
    known = set(env.import_sources) | set(env.used_globals)
    by_id = {id(module): name for name, module in list(sys.modules.items())}
    found = {}
    for ref in sorted(set(getattr(env, "external_refs", ())) - known):
        match = _MODULE_GLOBAL.match(ref)
        if match and int(match.group(1)) in by_id:
            found[ref] = by_id[int(match.group(1))]
    return found


@contextlib.contextmanager
def builtins_as_globals() -> Iterator[None]:
    """While torch builds an AOT-compiled function (compiling or loading it), the builtins its
    bytecode names (`type`, `len`) count as its globals: torch 2.11 checks that every global
    name the bytecode reads is supplied and forgets the builtins, which torch 2.13 adds."""
    env_class = getattr(torch._dynamo.convert_frame, "GraphRuntimeEnv", None)
    original = getattr(env_class, "forward_callable", None)
    if original is None:
        yield
        return

    def forward_callable(env: Any, *args: Any, extra_globals: Any = None, **kwargs: Any) -> Any:
        names = getattr(env, "external_refs", ())
        found = {name: getattr(builtins, name) for name in names if hasattr(builtins, name)}
        return original(env, *args, extra_globals={**found, **(extra_globals or {})}, **kwargs)

    env_class.forward_callable = forward_callable
    try:
        yield
    finally:
        env_class.forward_callable = original


def import_globals(names: dict[str, str]) -> dict[str, types.ModuleType]:
    """`module_globals`' record, imported in this process."""
    return {ref: importlib.import_module(module) for ref, module in names.items()}
