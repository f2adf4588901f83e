"""Where a graph's writes into its state get their positions from, for the padding rules.

A padded batch row runs like a real one: when a graph writes rows into a tensor that outlives
the call (a KV cache) at positions read from a batch input (`cache.index_copy_(0, slot, k)`,
`cache[slot] = k`), a padded row writes at its position's pad value. Without a declared pad
value that is 0, a slot an eager call never writes and later calls may read. `StateWrites`
gives `batch_rules` the `State` of one fake run of a graph: which tensors are state (inputs
without the batch dim) and, for an indexed write, which batch inputs its positions come from
(the graph's placeholders behind the index tensors) and whether each has a pad value. Of a
write at several indices (`cache[slot, :, pos] = k`), only the index that chooses the row needs
one (`StateWrites._deciding_index`): a trash slot takes every element a padded row writes.

    writes = StateWrites(placeholders, args, names, batch, batch_inputs, padded, env, current)
    check_op(func, args, kwargs, out, batch, writes.state)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from cgcompile.passes.batch_rules import BatchDims, State


class StateWrites:
    """The `State` of one fake run: state tensors by storage, positions traced to inputs."""

    def __init__(
        self,
        placeholders: Sequence[fx.Node],
        args: Sequence[Any],
        names: Sequence[str],
        batch: BatchDims,
        batch_inputs: Collection[int],
        padded: Collection[int],
        env: Callable[[], dict[fx.Node, Any]],
        current: Callable[[], fx.Node | None],
    ) -> None:
        self._index = {node: i for i, node in enumerate(placeholders)}
        self._owners = {
            StorageWeakRef(a.untyped_storage()): i
            for i, a in enumerate(args)
            if isinstance(a, torch.Tensor) and i not in batch_inputs
        }
        self._names = names
        self._batch = batch
        self._batch_inputs = set(batch_inputs)
        self._padded = set(padded)
        self._env = env
        self._current = current
        self._graph = placeholders[0].graph if placeholders else None
        self._behind: dict[fx.Node, frozenset[int]] | None = None
        self.state = State(self._is_state, self._indexed_write)

    def _is_state(self, t: torch.Tensor) -> bool:
        return StorageWeakRef(t.untyped_storage()) in self._owners

    def _indexed_write(self, dst: torch.Tensor, index: list[torch.Tensor]) -> str | None:
        state = self._names[self._owners[StorageWeakRef(dst.untyped_storage())]]
        if any(self._batch.dims(t) and not self._sources([t]) & self._batch_inputs for t in index):
            # e.g. `cache[arange(n), :, pos] = k`: no pad value can steer the padded rows
            return (
                f"writes state {state} at rows computed from the batch size (e.g. "
                f"torch.arange(n)), not read from an input: padded rows would write the rows "
                f"after the real ones, where an eager call writes nothing; pass the rows as an "
                f"input and declare its pad value with cgcompile.mark_dynamic_batch(t, "
                f"pad_value=...), e.g. a trash slot no row reads"
            )
        deciding, others = self._deciding_index(index)
        missing = sorted((self._sources(deciding) & self._batch_inputs) - self._padded)
        if not missing:
            return None
        inputs = [self._names[i] for i in missing]
        if not others:
            return (
                f"writes state {state} at rows read from {inputs}, which have no declared pad "
                f"value: padded rows would write there (at 0) where an eager call writes "
                f"nothing; declare one with cgcompile.mark_dynamic_batch(t, pad_value=...), "
                f"e.g. a slot no row reads"
            )
        ignored = sorted((self._sources(others) & self._batch_inputs) - set(missing))
        return (
            f"writes state {state} at rows chosen by an index read from {inputs}, which have "
            f"no declared pad value: padded rows would write the rows their zeros choose, where "
            f"an eager call writes nothing; declare one for {inputs} (the index that chooses the "
            f"row) with cgcompile.mark_dynamic_batch(t, pad_value=...), e.g. a trash slot no row "
            f"reads: padded rows then write only that slot, and the write's other indices (read "
            f"from {[self._names[i] for i in ignored]}) need no pad value"
        )

    def _deciding_index(
        self, index: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The index tensors of a write (in the order of the dims they index) whose pad values
        decide where its padded rows land, and the others. The first, the one that chooses the
        row (`cache[slot, :, pos] = k`), decides alone when it has the batch in every broadcast
        dim where another one has it: every element a padded row writes then takes its position
        along that index's dim from the index's padded rows, so a trash slot there keeps the
        whole write in the trash slot, whatever the other indices hold (their padded rows hold
        zeros or their pad values, which must stay in range). An outer product
        (`cache[slot[:, None], pos[None, :]]`) pairs real slots with padded positions: all decide.
        """

        def batch_dims(t: torch.Tensor) -> set[int]:  # counted from the end, as broadcast aligns
            return {t.dim() - d for d, _ in self._batch.dims(t)}

        if index and all(batch_dims(t) <= batch_dims(index[0]) for t in index[1:]):
            return index[:1], index[1:]
        return index, []

    def _sources(self, index: list[torch.Tensor]) -> set[int]:
        """Placeholders behind the index tensors: the nodes feeding the current one whose
        value is one of them, else (an index made inside the op) all of the node's inputs."""
        node = self._current()
        if node is None:
            return set(self._batch_inputs)
        storages = {StorageWeakRef(t.untyped_storage()) for t in index}
        env = self._env()
        feeding = [
            n
            for n in node.all_input_nodes
            if isinstance(env.get(n), torch.Tensor)
            and StorageWeakRef(env[n].untyped_storage()) in storages
        ]
        found: set[int] = set()
        for n in feeding or node.all_input_nodes:
            found |= self._placeholders_behind(n)
        return found

    def _placeholders_behind(self, node: fx.Node) -> frozenset[int]:
        """The batch inputs `node` depends on, for all nodes at once in graph order."""
        if self._behind is None:
            behind: dict[fx.Node, frozenset[int]] = {}
            for n in self._graph.nodes if self._graph is not None else ():
                i = self._index.get(n)
                if i is not None:
                    behind[n] = frozenset({i} & self._batch_inputs)
                else:
                    behind[n] = frozenset().union(*(behind[m] for m in n.all_input_nodes))
            self._behind = behind
        return self._behind.get(node, frozenset())
