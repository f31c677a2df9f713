"""Pushing row-Jacobians through an existing autograd graph, in topological order.

# NOTE [frontier walk]
The walk starts from *seeds* — row-Jacobians placed at input slots of the outputs' nodes —
and ends at *targets* — ``(node, input_nr)`` slots whose row-Jacobian is wanted (a leaf's
``AccumulateGrad`` slot 0, or the slot of a non-leaf tensor's ``grad_fn`` at its
``output_nr``). It is the autograd engine's algorithm with ``[rows, ...]`` cotangents:

* **planning** (:class:`WalkPlan`, once per graph): collect the nodes reachable from the
  seeds, keep those from which some target is reachable ("needed"), and count for each
  needed node the edges coming into it from needed nodes (its dependencies). Nodes off every
  path to a target are never called.
* **running** (:meth:`WalkPlan.run`): a node is taken from the ready heap only when all
  its dependencies have delivered, so the row-Jacobian in its slots is *complete* — summed
  over every path into it (``a + a``, tied weights, a module called twice). Then its target
  slots are handed out, it is called once (``_graph_nodes``) if it leads to a target, its
  gradients are added into its children's slots, and its own slots are dropped. What is
  alive at any time is the *frontier*: the slots filled but not yet consumed.
* **order**: among ready nodes, ``AccumulateGrad`` first (a leaf's Jacobian is handed out
  and freed as soon as it is complete), then the most recently created node first (the
  engine's ``sequence_nr`` priority), which follows the forward in reverse and keeps the
  frontier to about one layer's activations.

The walk is iterative (no recursion limit on deep graphs) and never touches the graph:
no hook runs, no ``.grad`` is written, no saved tensor is released.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import Tensor

from torchgram._core import _torch_compat
from torchgram.backends.graph.nodes import Edge, Node, input_slots

OnTarget = Callable[[Edge, Tensor | None], None]
"""Receives a target slot and its complete row-Jacobian (``None``: nothing reached it)."""

NodeApply = Callable[[Node, Sequence[Tensor | None], Sequence[Edge | None]],
                     list[Tensor | None]]
"""Calls a node on row-batched cotangents (see ``_graph_nodes.NodeCaller``)."""


class WalkPlan:
    """The part of a graph between ``roots`` and ``targets``, with dependency counts.

    Args:
        roots: The nodes where seeds will be placed (the outputs' nodes).
        targets: The slots ``(node, input_nr)`` whose complete row-Jacobian is wanted.

    Example:
        >>> import torch
        >>> x = torch.randn(2, requires_grad=True)
        >>> y = x * x  # MulBackward0 -> AccumulateGrad twice: one dependency per edge
        >>> edge = torch.autograd.graph.get_gradient_edge(x)
        >>> plan = WalkPlan([y.grad_fn], [(edge.node, 0)])
        >>> plan.dependencies[edge.node]
        2
    """

    def __init__(self, roots: Iterable[Node], targets: Iterable[Edge]) -> None:
        self.targets: dict[Node, list[int]] = {}
        for node, input_nr in targets:
            self.targets.setdefault(node, [])
            if input_nr not in self.targets[node]:
                self.targets[node].append(input_nr)
        self.roots = list(dict.fromkeys(roots))
        self.children = _children(self.roots)
        self.needed = _needed(self.roots, self.children, self.targets)
        self.dependencies: dict[Node, int] = dict.fromkeys(self.needed, 0)
        for node in self.needed:
            for child, _ in self._wanted_edges(node):
                self.dependencies[child] += 1

    def _wanted_edges(self, node: Node) -> list[Edge]:
        return [edge for edge in self.children[node] if edge is not None and edge[0] in self.needed]

    def run(self, seeds: Iterable[tuple[Edge, Tensor]], on_target: OnTarget,
            apply: NodeApply) -> int:
        """Propagate ``seeds`` to the targets; hand each target's row-Jacobian to ``on_target``.

        Args:
            seeds: ``((node, input_nr), rows)`` pairs; seeds at the same slot are summed.
                Every node must be one of the plan's roots.
            on_target: Called once per target slot, as soon as its row-Jacobian is complete.
            apply: Calls a node on row-batched cotangents.

        Returns:
            The peak number of live row-Jacobian entries (the frontier's size).
        """
        frontier = _Frontier()
        for (node, input_nr), rows in seeds:
            if node in self.needed:
                frontier.accumulate(node, input_nr, rows)
        remaining = dict(self.dependencies)
        counter = itertools.count()
        ready = [(_priority(node), next(counter), node)
                 for node in self.roots if node in self.needed and remaining[node] == 0]
        heapq.heapify(ready)
        while ready:
            node = heapq.heappop(ready)[2]
            grads = frontier.pop(node)
            for input_nr in self.targets.get(node, ()):
                on_target((node, input_nr), None if grads is None else grads[input_nr])
            wanted = self._wanted_edges(node)
            if wanted and grads is not None and any(g is not None for g in grads):
                edges = [edge if edge is not None and edge[0] in self.needed else None
                         for edge in self.children[node]]
                outs = apply(node, grads, edges)
                del grads  # the node's slots are consumed: NOTE [frontier walk]
                for edge, out in zip(edges, outs, strict=True):
                    if edge is not None and out is not None:
                        frontier.accumulate(edge[0], edge[1], out)
                del outs
            for child, _ in wanted:
                remaining[child] -= 1
                if remaining[child] == 0:
                    heapq.heappush(ready, (_priority(child), next(counter), child))
        return frontier.peak


class _Frontier:
    """The filled, not yet consumed slots of the walk, with their size and its peak."""

    def __init__(self) -> None:
        self.slots: dict[Node, list[Tensor | None]] = {}
        self.size = 0
        self.peak = 0

    def accumulate(self, node: Node, input_nr: int, rows: Tensor) -> None:
        """Add ``rows`` into slot ``input_nr`` of ``node``."""
        buffer = self.slots.get(node)
        if buffer is None:
            buffer = self.slots[node] = [None] * input_slots(node)
        current = buffer[input_nr]
        if current is None:
            buffer[input_nr] = rows
            self.size += rows.numel()
            self.peak = max(self.peak, self.size)
        else:  # out of place: a node may return the same tensor for several edges (AddBackward0)
            buffer[input_nr] = current + rows

    def pop(self, node: Node) -> list[Tensor | None] | None:
        """Take ``node``'s slots out of the frontier."""
        grads = self.slots.pop(node, None)
        if grads is not None:
            self.size -= sum(g.numel() for g in grads if g is not None)
        return grads


def _priority(node: Node) -> int:
    # heapq pops the smallest: AccumulateGrad has the largest sequence_nr (2**64 - 1).
    return -_torch_compat.creation_order(node)


def _children(roots: list[Node]) -> dict[Node, list[Edge | None]]:
    """Every node reachable from ``roots``, with its next edges by position.

    Position ``k`` is ``None`` where ``next_functions[k]`` leads nowhere (an input that does
    not require grad); positions match the gradients a node call returns.
    """
    children: dict[Node, list[Edge | None]] = {}
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in children:
            continue
        edges = [None if child is None else (child, nr) for child, nr in node.next_functions]
        children[node] = edges
        stack.extend(edge[0] for edge in edges if edge is not None and edge[0] not in children)
    return children


def _needed(roots: list[Node], children: dict[Node, list[Edge | None]],
            targets: dict[Node, Any]) -> set[Node]:
    """The nodes from which a target is reachable (targets included), iteratively."""
    needed: set[Node] = set()
    done: set[Node] = set()
    for root in roots:
        stack: list[tuple[Node, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in done:
                continue
            if not expanded:
                stack.append((node, True))
                stack.extend((edge[0], False) for edge in children[node]
                             if edge is not None and edge[0] not in done)
                continue
            done.add(node)
            if node in targets or any(edge is not None and edge[0] in needed
                                      for edge in children[node]):
                needed.add(node)
    return needed
