"""Parameter events: the process-wide count after whose change a module's parameters, buffers
or submodules may be other tensors than a compiled graph last saw (`instances`).

torch's registration hooks bump it when a parameter, buffer or submodule is assigned to any
module (`module.weight = p`, `load_state_dict(assign=True)`), except a registration Dynamo
traces and one made while `ModuleList` or `Sequential` builds the container a slice returns
(`layers[:n]`, as Hugging Face forwards do: existing modules in a new container no model holds
until it is assigned to one, which is an event); `instances` bumps it when a static tensor, or
the storage one had, is freed. A per-call check compares one int: `EVENTS.count`.

    seen = EVENTS.count
    ...
    changed = EVENTS.count != seen
"""

from __future__ import annotations

import sys
from typing import Any

import torch


class ParameterEvents:
    """Counts the events after which a module's static tensors may be other tensors."""

    def __init__(self) -> None:
        self.count = 0
        """Read on every call; bumped by the hooks below and by freed static tensors."""
        for register in (
            torch.nn.modules.module.register_module_parameter_registration_hook,
            torch.nn.modules.module.register_module_buffer_registration_hook,
            torch.nn.modules.module.register_module_module_registration_hook,
        ):
            register(self._hook)

    def _hook(self, module: torch.nn.Module, name: str, value: Any) -> None:
        # Dynamo traces the hook where a forward builds a module (Hugging Face slices its
        # ModuleList of layers): counting there would guard on the count and recompile on every
        # call. A traced registration makes a temporary module of existing parameters: no event.
        if torch.compiler.is_compiling():
            return
        # The same slice in an eager forward builds a new container of existing modules, which
        # no model holds until it is assigned to one (that assignment is an event).
        if isinstance(value, torch.nn.Module) and _building_a_slice():
            return
        self.count += 1

    def bump(self) -> None:
        self.count += 1


_SLICES = frozenset(c.__getitem__.__code__ for c in (torch.nn.ModuleList, torch.nn.Sequential))


def _building_a_slice() -> bool:
    """Whether a module registration comes from `ModuleList` or `Sequential` building the
    container a slice returns (`layers[:n]`): at most six frames above the hook."""
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return False
        if frame.f_code in _SLICES:
            return True
        frame = frame.f_back
    return False


EVENTS = ParameterEvents()
"""Process-wide: a parameter assigned anywhere may be one of any compiled graph's inputs."""
