"""One pass over an eager graph: its nodes by sequence number, the edges into its leaves.

The imperative Gramian walks the graph below the outputs once, before any differentiation,
to find the nodes a recording tapped (NOTE [eager recording]: by sequence number, and only
among the nodes it owns, NOTE [recorded nodes]), every
node holding an edge into a leaf's ``AccumulateGrad`` (to check that the recording saw every
use of a leaf), and what makes the fast pass impossible: module backward hooks (their
``BackwardHookFunction`` nodes) and reentrant checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

from torchgram._core import _torch_compat
from torchgram._core._torch_compat import Node
from torchgram._core.watched_calls import CHECKED_NODES

if TYPE_CHECKING:
    from torchgram.backends.eager.record import Recording


@dataclass
class GraphIndex:
    """The graph below some outputs (see module docstring).

    Attributes:
        by_seq: Every node but the leaves' accumulators, by sequence number (several for a
            number: nodes of different threads, NOTE [recorded nodes]).
        into: For each leaf (by ``id`` of the tensor), the nodes with an edge into its
            ``AccumulateGrad``.
        module_hooks: Whether a module backward hook sits in the graph.
        reentrant: Whether a reentrant checkpoint sits in the graph.
        size: Number of nodes.
        every: Every node but the leaves' accumulators, duplicated numbers included.
        checked: The nodes whose backward torch gets wrong at some values
            (``watched_calls.check_node``).
    """

    by_seq: dict[int, list[Node]] = field(default_factory=dict)
    into: dict[int, list[Node]] = field(default_factory=dict)
    module_hooks: bool = False
    reentrant: bool = False
    size: int = 0
    every: list[Node] = field(default_factory=list)
    checked: list[Node] = field(default_factory=list)
    _parents: dict[Node, list[Node]] | None = field(default=None, repr=False)
    _leaf_only: dict[tuple[Node, int], bool] = field(default_factory=dict, repr=False)

    def node(self, seq: int, name: str, recording: Recording) -> Node | None:
        """The node of ``recording`` with sequence number ``seq`` and name ``name``, if any.

        Only a node the recording owns is found (NOTE [recorded nodes]): another thread's
        node with the same number and name is not the one it recorded.
        """
        for node in self.by_seq.get(seq, ()):
            if node.name() == name and recording.owns(node):
                return node
        return None

    def nodes(self) -> list[Node]:
        """Every node but the leaves' accumulators, in creation order."""
        return sorted(self.every, key=_torch_compat.creation_order)

    def parents(self) -> dict[Node, list[Node]]:
        """For each node, the nodes of the graph with an edge into it (made on first use)."""
        if self._parents is None:
            self._parents = {}
            for parent in self.every:
                for child, _ in parent.next_functions:
                    if child is not None:
                        self._parents.setdefault(child, []).append(parent)
        return self._parents

    def of_leaf_only(self, node: Node, leaf: Tensor) -> bool:
        """Whether ``node`` depends on ``leaf`` alone (``W.T``, a view of ``W``)."""
        key = (node, id(leaf))
        known = self._leaf_only.get(key)
        if known is None:
            children = [child for child, _ in node.next_functions if child is not None]
            known = bool(children) and all(
                _torch_compat.leaf_of(child) is leaf if _torch_compat.is_leaf_accumulator(child)
                else self.of_leaf_only(child, leaf) for child in children)
            self._leaf_only[key] = known
        return known

    def holders(self, leaf: Tensor, recording: Recording) -> set[int] | None:
        """Sequence numbers of the nodes with an edge into ``leaf``'s accumulator.

        ``None`` if one of them is not ``recording``'s (NOTE [recorded nodes]): that use of
        the leaf is one the recording did not see, whatever its number.
        """
        nodes = self.into.get(id(leaf), ())
        if not all(recording.owns(node) for node in nodes):
            return None
        return {_torch_compat.creation_order(node) for node in nodes}


def index_graph(outputs: Sequence[Tensor]) -> GraphIndex:
    """Index the graph below ``outputs`` (each requiring grad), iteratively."""
    index = GraphIndex()
    stack = [_torch_compat.gradient_edge(out).node for out in outputs]
    seen: set[Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if _torch_compat.is_leaf_accumulator(node):
            continue
        seq = _torch_compat.creation_order(node)
        index.every.append(node)
        index.by_seq.setdefault(seq, []).append(node)
        if _torch_compat.is_reentrant_checkpoint(node):
            index.reentrant = True
        if _torch_compat.is_module_hook_node(node):
            index.module_hooks = True
        if type(node).__name__ in CHECKED_NODES:
            index.checked.append(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            if _torch_compat.is_leaf_accumulator(child):
                index.into.setdefault(id(_torch_compat.leaf_of(child)), []).append(node)
            if child not in seen:
                stack.append(child)
    index.size = len(seen)
    return index
