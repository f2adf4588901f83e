"""What a call that ran graphs hands to its caller, and whether the caller still holds it.

A replay writes its outputs into graph memory that the previous replay of the same module
instance's graphs wrote (each instance has its own memory pool), so an output the caller still
holds at the next call would change under it, which an eager call never does. This happens when
a caller keeps outputs across calls (`outs.append(compiled(x))`) and when a model broken into
several graphs calls one graph twice in a step (keys, then values) and reads the first result
after the second. So each graphed call hands out its graph-memory outputs
(`plan.handed_outputs`) through fresh tensors and keeps weak references to them (a view of a
handed tensor keeps it alive, so a held view counts too). Before a replay the backend asks
`still_held()`, then `release()`: a held output referenced only through the tensor handed out
(`logits = compiled(x)` in a loop: the old `logits` is still bound during the next call) gets a
copy of its data moved under it (`Tensor.set_`), so the caller keeps its values and the replay
may write graph memory; one copy per held output, only when held. A held view of an output
cannot be moved: that call runs without graphs, and this instance's outputs are copied out of
graph memory from then on (`copies`), which is exact whatever the caller keeps. A caller that
drops each call's outputs before the next call, or keeps only what it derives from them
(`logits.argmax(-1)`), stays on the zero-copy path. Outputs that are views of a copied input
(`plan.buffer_outputs`) live in a static buffer the next call refills: they are always copied.

    outputs = Outputs(plan)                      # one per module instance
    if outputs.still_held() and not outputs.release():
        outputs.start_copying()                  # and run this call without graphs
    return outputs.hand_out(out, n, padded)
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from cgcompile.runtime.inputs import InputPlan


def _storage_users(t: torch.Tensor) -> int:
    """Tensors sharing `t`'s storage, views of it included, plus the storage object this
    call makes."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _has_other_users(refs: tuple[weakref.ref[Any], ...]) -> bool:
    """Whether tensors other than the live ones among `refs` (the graph's output, its root,
    the handed tensor, all sharing one storage) use that storage: a view the caller made."""
    live = {id(t): t for t in (ref() for ref in refs) if t is not None}
    return _storage_users(next(iter(live.values()))) > len(live) + 1


class Outputs:
    """Hands out one module instance's outputs; remembers the last graphed call's."""

    def __init__(self, plan: InputPlan) -> None:
        self.handed = plan.handed_outputs
        self.batch = plan.batch_outputs
        self.buffers = plan.buffer_outputs
        self.copies = False
        """Graph-memory outputs are copied (a caller held them across a call)."""
        self._held: list[tuple[weakref.ref[Any], ...]] = []
        """(handed tensor, its root, the graph's output) per output of the last call; the root
        lives while the handed tensor or any view of it does."""

    def still_held(self) -> bool:
        """Whether the caller still references an output of the last graphed call."""
        for refs in self._held:
            if refs[1]() is not None:
                return True
        return False

    def release(self) -> bool:
        """Move a copy of its data under each held output, so the next replay may write graph
        memory; False (nothing must replay) when a view of one is held, which cannot move."""
        held = [refs for refs in self._held if refs[1]() is not None]
        if any(refs[0]() is None or _has_other_users(refs) for refs in held):
            return False
        try:
            for refs in held:
                t = refs[0]()
                copy = t.clone()
                t.set_(copy.untyped_storage(), copy.storage_offset(), copy.shape, copy.stride())
        except RuntimeError:  # an inference tensor, now outside inference mode
            return False
        self._held = []
        return True

    def start_copying(self) -> None:
        self.copies = True
        self._held = []

    def hand_out(self, out: Sequence[Any], n: int, padded: int) -> list[Any]:
        """The call's outputs for the caller: batch outputs sliced to the real rows n."""
        out = list(out)
        roots = []
        if not self.copies:
            for i in self.handed:
                graph_output = out[i]
                root = out[i] = graph_output.detach()  # a tensor of its own, untracked by views
                roots.append((i, weakref.ref(root), weakref.ref(graph_output)))
        if padded != n:
            for i in self.batch:
                out[i] = out[i][:n]
        if self.copies:
            for i in self.handed:
                out[i] = out[i].clone()
        for i in self.buffers:
            out[i] = out[i].clone()
        self._held = [(weakref.ref(out[i]), root, graph_output) for i, root, graph_output in roots]
        return out
