"""A streamed backward: each tap's cotangent goes to the contraction as soon as it exists.

# NOTE [streamed taps]
A plain backward frees each node's saved tensors once it has run, so its memory peaks at the
start, at about the forward's activations. Asking ``autograd.grad`` for every tap instead
returns all the taps' cotangents together at the end: at that moment the kept activations
(the factors) *and* one cotangent per tapped output are alive, and the contraction's own
temporaries come on top (measured: 1.5-3x the plain backward's peak on BERT, ResNet-18 and
recurrent nets). With one backward of all rows (``R = 1`` per sample: per-sample losses),
the cotangents are handed over while the backward runs instead:

* a tap that is an edge of the graph (NOTE [tap edges]) is read by a pre-hook of its node,
  which sees the node's complete incoming gradient just before the node runs; it is not
  asked for as an input of the backward, so autograd keeps no reference to it;
* a tap or carrier that is a leaf tensor of our own (zero taps, per-sample carriers) is an
  input; a hook on it receives its gradient and returns a zero-strided zero of the same
  shape, which is what autograd keeps and returns (its node is never run: nothing further
  reads it). Carriers' gradients are returned as they are (their leaves need them whole).

The consumer contracts a leaf as soon as all the taps of its uses are in and lets go of
every cotangent and activation no other leaf needs (:class:`Lifetimes`), so memory falls
as the backward proceeds, like the plain backward's.

A node only runs, and its pre-hook only fires, when it lies on a path to an input of the
backward. A tapped node from which no path leads to one of our own leaves (its only inputs
require gradients through the caller's tensors, a closure's or an input's) would not run:
then the pass is not streamed. The walk that checks it shares what it learns between the
taps (the graph is acyclic), so it follows about one path down the network, not the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from torchgram._core import _torch_compat
from torchgram.backends.structured.passes import Forward, per_sample_view

TapConsumer = Callable[[int, Tensor | None], None]
"""``consume(tap, cotangent [1, B, *per-sample y])``; ``None`` where the rows do not reach it."""


def can_stream(forward: Forward, *, create_graph: bool) -> bool:
    """Whether :func:`streamed_backward` applies (NOTE [streamed taps]).

    One plain backward of all rows (``R = 1``: one cotangent direction per sample), whose
    graph ends at the forward's own leaves only.
    """
    rows = forward.outputs[0]
    if not (forward.kind in ("batched", "vmap") and forward.rows_per_sample == 1
            and not create_graph and rows.requires_grad and rows.grad_fn is not None):
        return False
    inputs = _inputs(forward)
    if not inputs or not all(t.is_leaf for t in inputs):
        return False
    return _all_reach([tap.node for tap in forward.taps[0] if not isinstance(tap, Tensor)],
                      [_torch_compat.gradient_edge(t).node for t in inputs])


def streamed_backward(forward: Forward, consume: TapConsumer) -> dict[int, Tensor]:
    """One backward of every sample's rows that hands each tap's cotangent to ``consume``.

    NOTE [streamed taps]; only where :func:`can_stream` holds. Returns the carriers'
    gradients ``{leaf: [1, B, *leaf.shape]}``. A tap the rows do not reach is never passed
    to ``consume``.
    """
    rows = forward.outputs[0]
    taps: Sequence[Any] = forward.taps[0]
    inputs = _inputs(forward)
    leaf_taps = [(i, t) for i, t in enumerate(taps) if isinstance(t, Tensor)]

    def per_sample(tap: int, grad: Tensor | None) -> Tensor | None:
        if grad is None:
            return None
        grad = grad.unsqueeze(0)
        if forward.kind == "batched":
            return per_sample_view(grad, forward.tap_dims[tap], 1, forward.samples)
        return grad

    edges: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
    for i, tap in enumerate(taps):
        if not isinstance(tap, Tensor):  # a gradient edge (NOTE [tap edges])
            edges.setdefault(id(tap.node), (tap.node, []))[1].append((i, tap.output_nr))
    handles = []
    try:
        for node, outputs in edges.values():
            handles.append(node.register_prehook(_node_hook(outputs, per_sample, consume)))
        for i, tap in leaf_taps:
            handles.append(tap.register_hook(_leaf_hook(i, per_sample, consume)))
        grads = torch.autograd.grad(rows, inputs, torch.ones_like(rows), allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return {leaf: grad.unsqueeze(0)
            for leaf, grad in zip(forward.carrier_leaves, grads[len(leaf_taps):], strict=True)
            if grad is not None}


def _inputs(forward: Forward) -> list[Tensor]:
    """The backward's inputs: the taps that are tensors (zero taps), then the carriers."""
    return [t for t in forward.taps[0] if isinstance(t, Tensor)] + list(forward.carriers[0])


def _node_hook(outputs: list[tuple[int, int]],
               per_sample: Callable[[int, Tensor | None], Tensor | None],
               consume: TapConsumer) -> Callable[[tuple[Tensor | None, ...]], None]:
    def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
        for tap, output_nr in outputs:
            consume(tap, per_sample(tap, grad_outputs[output_nr]))

    return hook


def _leaf_hook(tap: int, per_sample: Callable[[int, Tensor | None], Tensor | None],
               consume: TapConsumer) -> Callable[[Tensor], Tensor]:
    def hook(grad: Tensor) -> Tensor:
        consume(tap, per_sample(tap, grad))
        # what autograd keeps for this input instead of the gradient: no memory
        return torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)

    return hook


def _all_reach(starts: Sequence[Any], ends: Sequence[Any]) -> bool:
    """Whether a path of the graph leads from each node of ``starts`` to one of ``ends``.

    Depth first, with what is known of every node visited shared between the starts (the
    graph is acyclic): typically one path down to the first layer, then a few steps per tap.
    """
    end_ids = {id(node) for node in ends}
    reaches: dict[int, bool] = {}  # False: does not, or (on the stack) not yet known
    visited: list[Any] = []  # holds every node object, so that ids stay unique during the walk
    for start in starts:
        if id(start) in end_ids or reaches.get(id(start)):
            continue
        if id(start) in reaches:
            return False
        reaches[id(start)] = False
        visited.append(start)
        stack = [(start, iter(start.next_functions))]
        while stack:
            for child, _ in stack[-1][1]:
                if child is None:
                    continue
                if id(child) in end_ids or reaches.get(id(child)):
                    for node, _ in stack:
                        reaches[id(node)] = True
                    stack = []
                    break
                if id(child) not in reaches:
                    reaches[id(child)] = False
                    visited.append(child)
                    stack.append((child, iter(child.next_functions)))
                    break
            else:
                stack.pop()  # every path from it explored: it does not reach
        if not reaches[id(start)]:
            return False
    return True
