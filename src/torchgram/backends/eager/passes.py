"""Backward passes of the imperative Gramian: cotangents at chosen slots of an eager graph.

# NOTE [eager taps]
The cotangents ``∂out/∂y`` at the recorded outputs ``y`` of recognised calls come from
backward passes from the outputs, seeded per row direction (NOTE [structured passes]), two
ways:

* **engine** (the fast way): one ``torch.autograd.grad(outputs, [GradientEdge(node, nr),
  ...], seeds, retain_graph=True)``; autograd computes only what leads to those slots (no
  parameter gradient, nothing below the lowest one) and writes no ``.grad``. Like any
  ``torch.autograd.grad`` it runs the hooks on its path, so it is used only when the graph
  has none that torchgram can see: no module backward hook in the graph, no
  ``Tensor.register_hook`` / ``retain_grad`` called inside the ``record()`` block;
* **walk** (otherwise): the graph walk of ``torchgram.autograd.gramian`` (NOTE [frontier
  walk]) with the slots as targets: no hook runs, nothing is written.

Hooks registered on tensors or nodes of the recorded graph *after* the ``record()`` block
cannot be seen (autograd gives no way to ask a node for its hooks): they run during an engine
pass, as they would in ``torch.autograd.grad``, and a tensor that called ``retain_grad()``
after the block receives a ``.grad`` (the pass's cotangent). Documented in
``tg.autograd.gramian`` and ``tg.autograd.record``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge

from torchgram._core.functional import stack_grads
from torchgram.backends.graph.nodes import Edge, NodeCaller
from torchgram.backends.graph.walk import WalkPlan


def engine_cotangents(outputs: Sequence[Tensor], slots: Sequence[Edge],
                      seeds: Sequence[Tensor], *, retain_graph: bool,
                      vectorize: bool = True) -> list[Tensor | None]:
    """``[c, *slot]`` cotangents at ``slots`` for ``c`` seeds ``[c, *output]`` per output.

    Several seeds are vmapped (``is_grads_batched``) when ``vectorize``, else (or when
    ``vmap`` cannot run the backward) looped. ``None`` where no output reaches a slot.
    """
    edges = [GradientEdge(node, nr) for node, nr in slots]
    count = seeds[0].shape[0]
    if count == 1 or not vectorize:
        per_seed = [torch.autograd.grad(list(outputs), edges, [s[i] for s in seeds],
                                        retain_graph=retain_graph or i + 1 < count,
                                        allow_unused=True)
                    for i in range(count)]
        return [stack_grads([grads[j] for grads in per_seed]) for j in range(len(edges))]
    try:
        grads = torch.autograd.grad(list(outputs), edges, list(seeds), retain_graph=True,
                                    allow_unused=True, is_grads_batched=True)
    except Exception:  # noqa: BLE001 -- NOTE [vmap fallback]: a backward vmap cannot batch
        return engine_cotangents(outputs, slots, seeds, retain_graph=retain_graph,
                                 vectorize=False)
    return list(grads)


def walk_cotangents(outputs: Sequence[Tensor], slots: Sequence[Edge], seeds: Sequence[Tensor],
                    caller: NodeCaller) -> list[Tensor | None]:
    """Like :func:`engine_cotangents`, by walking the graph (no hook runs)."""
    edges = [get_gradient_edge(out) for out in outputs]
    plan = WalkPlan([edge.node for edge in edges], slots)
    found: dict[Edge, Tensor | None] = {}

    def on_target(slot: Edge, jacobian: Tensor | None) -> None:
        found[slot] = jacobian

    with torch.no_grad():
        plan.run([((edge.node, edge.output_nr), seed) for edge, seed in zip(edges, seeds,
                                                                             strict=True)],
                 on_target, caller)
    return [found.get(slot) for slot in slots]

