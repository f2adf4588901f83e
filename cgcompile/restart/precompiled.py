"""What `cgcompile.precompile` returns: a model's AOT-compiled functions, called in place of
the model (`restart/precompile.py` builds them).

A call checks the guards of the function that served the last call first, then the others
(a few us each: torch's `guard_check` binds the arguments in Python), and runs the first that
fits. A call whose `mark_dynamic_batch` marks the guards reject (torch 2.11 saves a dynamic
example's marks as absent) is checked again on unmarked aliases of those tensors (same
storage), with one WARNING. A call that fits none is compiled just in time by `torch.compile`
with the same options, with one WARNING.

    logits = precompiled(tokens, positions)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)


class Precompiled:
    """The model's compiled functions, one per example call, and where they came from."""

    def __init__(
        self,
        model: Callable[..., Any],
        options: dict[str, Any],
        functions: list[Any],
        loaded: bool,
        why_compiled: str | None,
        seconds: float,
        load_steps: dict[str, float] | None = None,
    ) -> None:
        self.model = model
        self.options = options
        self.functions = functions
        self.loaded = loaded
        """Whether the functions came from the file (no Dynamo trace, no Inductor compile)."""
        self.why_compiled = why_compiled
        """Why the file was not loaded (None when it was)."""
        self.seconds = seconds
        """Time to load, or to compile and save."""
        self.load_steps = load_steps or {}
        """A load's seconds per step (`restart.load_steps`: read, header, unpickle, Inductor
        artifacts, graph unpickle, rebuild and its pieces, torch's loader); empty if compiled."""
        self._prefix = (model,) if isinstance(model, torch.nn.Module) else ()
        self._jit: Callable[..., Any] | None = None
        self._warned_marks = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        full = (*self._prefix, *args)
        functions = self.functions
        for i, fn in enumerate(functions):
            if fn.guard_check(*full, **kwargs):
                if i:  # the next call most likely has the same kind: check this one first
                    functions.insert(0, functions.pop(i))
                return fn(*full, **kwargs)
        return self._call_unfitted(args, kwargs)

    def _call_unfitted(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call no function's guards accept: retried without `mark_dynamic_batch`'s marks
        (Dynamo guards on them: a batch-1 example's are dropped when traced), else compiled
        just in time."""
        unmarked = without_marks(args, kwargs)
        if unmarked is not None:
            bare_args, bare_kwargs = unmarked
            for fn in self.functions:
                if fn.guard_check(*self._prefix, *bare_args, **bare_kwargs):
                    if not self._warned_marks:
                        self._warned_marks = True
                        logger.warning(
                            "a precompiled model's calls need no mark_dynamic_batch (it marks "
                            "the examples only): marked inputs are checked twice, a few us "
                            "per call; drop the marks from the calls"
                        )
                    return fn(*self._prefix, *bare_args, **bare_kwargs)
        if self._jit is None:
            logger.warning(
                "a call fits none of the %d precompiled functions (%s): compiling it just in "
                "time with torch.compile; add an example like it to precompile() to have it "
                "saved",
                len(self.functions),
                self._why_unfitted(args, kwargs),
            )
            self._compile_just_in_time()
        return self._jit(*args, **kwargs)

    def _why_unfitted(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The failing guards of the first function (torch's own words), if torch says."""
        if not self.functions:
            return "none was saved"
        fn = self.functions[0]
        try:
            f_locals = fn.prepare_f_locals(*self._prefix, *args, **kwargs)
            parts = fn._artifacts.guard_manager.check_verbose(f_locals).verbose_code_parts
        except (AttributeError, TypeError):  # a torch without these internals
            return "its shapes, dtypes or grad mode differ from every example's"
        failed = "; ".join(part.split("#")[0].strip() for part in parts)  # no source comments
        return f"failing guards: {failed[:300]}" if parts else "a guard failed"

    def _compile_just_in_time(self) -> Callable[..., Any]:
        self._jit = torch.compile(self.model, backend="cudagraph_modes", options=self.options)
        return self._jit

    def __repr__(self) -> str:
        how = "loaded" if self.loaded else f"compiled ({self.why_compiled})"
        return f"Precompiled({len(self.functions)} functions, {how} in {self.seconds:.2f}s)"


def without_marks(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """`args` and `kwargs` with each marked tensor replaced by an unmarked alias of the same
    storage (what Dynamo's guards see of a call without marks), or None when none is marked."""
    if not any(map(_is_marked, (*args, *kwargs.values()))):
        return None
    bare = lambda a: a.detach() if _is_marked(a) else a  # noqa: E731
    return tuple(map(bare, args)), {k: bare(v) for k, v in kwargs.items()}


def _is_marked(value: Any) -> bool:
    """A tensor that carries Dynamo's dim marks (`mark_dynamic` and kin: attributes named
    `_dynamo_*` on torch 2.11, plus `_has_dynamo_dim_marking` on newer torch)."""
    if not isinstance(value, torch.Tensor) or value.requires_grad:
        return False
    return any(name.startswith(("_dynamo_", "_has_dynamo_")) for name in vars(value))
