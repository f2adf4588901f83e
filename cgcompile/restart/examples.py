"""The example calls `precompile` compiles: which carry the batch, marked how, in which order.

An example is a call's positional arguments (a tuple) or its keyword arguments (a dict).

Examples none of which carries a mark get one on aliases (same storage, the caller's tensors
stay unmarked): dim 0 of the tensors whose dim 0 differs between examples, else of those whose
dim 0 is the first tensor's (`marked`). A model that fixes its batch (a cache allocated for one
batch size: Hugging Face's `StaticCache`) makes Dynamo raise a constraint violation on those
marks; `precompile` then compiles the examples as given, each for its own shapes. Dynamic
examples go first (`dynamic_first`), so a batch-1 graph finds the dynamic graph that serves it.

    examples, auto = marked([(tokens8, pos8), (tokens1, pos1)])
    examples = dynamic_first(examples)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from cgcompile.dynamic import mark_dynamic_batch
from cgcompile.errors import ConfigError

logger = logging.getLogger(__name__)


Example = tuple[Any, ...] | dict[str, Any]
"""A call's arguments: positional (a tuple) or by keyword (a dict, as Hugging Face models are
called)."""


def call_of(example: Example) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(positional arguments, keyword arguments) of an example."""
    return ((), dict(example)) if isinstance(example, dict) else (tuple(example), {})


def _slots(example: Example) -> dict[int | str, Any]:
    return dict(example) if isinstance(example, dict) else dict(enumerate(example))


def _replaced(example: Example, new: dict[int | str, Any]) -> Example:
    if isinstance(example, dict):
        return {k: new.get(k, v) for k, v in example.items()}
    return tuple(new.get(i, v) for i, v in enumerate(example))


def marked(examples: Sequence[Example]) -> tuple[list[Example], bool]:
    """(the examples, False) as given if one of their tensors carries a mark (the caller
    chose); else (the examples with their batch tensors (`batch_slots`) replaced by aliases
    (same storage) that `mark_dynamic_batch` marks at dim 0, True), so the caller's tensors
    stay unmarked."""
    if any(has_marks(a) for example in examples for a in _slots(example).values()):
        return list(examples), False
    slots = batch_slots(examples)
    if not slots:  # no tensor with a dim 0 in every example
        return list(examples), False
    result = []
    for example in examples:
        aliases = {k: alias(v) for k, v in _slots(example).items() if k in slots}
        mark_dynamic_batch(*aliases.values())
        result.append(_replaced(example, aliases))
    logger.info("precompile: no example was marked: dim 0 of arguments %s marked", slots)
    return result, True


def has_marks(value: Any) -> bool:
    """A tensor marked by `mark_dynamic_batch`, torch's `mark_dynamic` or `mark_static`."""
    names = vars(value) if isinstance(value, torch.Tensor) else ()
    return any(n.startswith("_dynamo_") and n.endswith("_indices") for n in names)


def alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor of `t`'s storage that marks can go on without marking `t`."""
    view = t.detach()
    return view.requires_grad_() if t.requires_grad else view


def batch_slots(examples: Sequence[Example]) -> list[int | str]:
    """The arguments (positions or keywords) whose dim 0 is the batch: the tensors whose dim 0
    differs between examples, or, where none does, those whose dim 0 is the first tensor's."""
    each = [_slots(e) for e in examples]
    tensors = [
        k
        for k in each[0]
        if all(isinstance(s.get(k), torch.Tensor) and s[k].dim() > 0 for s in each)
    ]
    varying = [k for k in tensors if len({s[k].shape[0] for s in each}) > 1]
    if not varying:
        first = each[0][tensors[0]].shape[0] if tensors else None
        return [k for k in tensors if each[0][k].shape[0] == first]
    for s in each:
        if len({s[k].shape[0] for k in varying}) > 1:
            raise ConfigError(
                f"precompile marks the batch of unmarked examples, dim 0 of the tensors whose "
                f"dim 0 differs between examples (arguments {varying}), but they disagree "
                f"within one example: shapes {[tuple(s[k].shape) for k in varying]}; "
                f"mark each example's batch tensors yourself with "
                f"cgcompile.mark_dynamic_batch(tokens, positions)"
            )
    return varying


def dynamic_first(examples: Sequence[Example]) -> list[Example]:
    """Examples with a dynamic batch before the others: a batch-1 graph is then served by the
    dynamic graph's compile, here and after a load."""

    def is_static(example: Example) -> bool:  # a marked size 1 is specialised
        tensors = [a for a in _slots(example).values() if isinstance(a, torch.Tensor)]
        return not any(
            getattr(t, "_dynamo_unbacked_indices", None)
            or any(t.shape[d] != 1 for d in getattr(t, "_dynamo_dynamic_indices", ()))
            for t in tensors
        )

    return sorted(examples, key=is_static)
