"""Where a graph's writes into its state get their positions from, for the padding rules.

A padded batch row runs like a real one: when a graph writes rows into a tensor that outlives
the call (a KV cache) at positions read from a batch input (`cache.index_copy_(0, slot, k)`,
`cache[slot] = k`), a padded row writes at its position's pad value. Without a declared pad
value that is 0, a slot an eager call never writes and later calls may read. `StateWrites`
gives `batch_rules` the `State` of one fake run of a graph: which tensors are state (inputs
without the batch dim) and, for an indexed write, which batch inputs its positions come from
(the graph's placeholders behind the index tensors) and whether each has a pad value.

    writes = StateWrites(placeholders, args, names, batch_inputs, padded, env, current_node)
    check_op(func, args, kwargs, out, batch, writes.state)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from cgcompile.passes.batch_rules import State


class StateWrites:
    """The `State` of one fake run: state tensors by storage, positions traced to inputs."""

    def __init__(
        self,
        placeholders: Sequence[fx.Node],
        args: Sequence[Any],
        names: Sequence[str],
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
        sources = self._sources(index) & self._batch_inputs
        missing = sorted(sources - self._padded)
        if not missing:
            return None
        state = self._names[self._owners[StorageWeakRef(dst.untyped_storage())]]
        inputs = [self._names[i] for i in missing]
        return (
            f"writes state {state} at rows read from {inputs}, which have no declared pad "
            f"value: padded rows would write there (at 0) where an eager call writes nothing; "
            f"declare one with cgcompile.mark_dynamic_batch(t, pad_value=...), e.g. a slot no "
            f"row reads"
        )

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
