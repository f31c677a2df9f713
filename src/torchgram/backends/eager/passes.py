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

# NOTE [freeing from a vectorized pass]
An engine pass asked to free the graph (``retain_graph=False``, the last pass) frees it as
``torch.autograd.grad`` does: the nodes it runs release their saved tensors, and a later
backward through them raises torch's "Trying to backward through the graph a second time".
With several seeds vmapped in one pass (``is_grads_batched``), that pass must keep the
graph: if ``vmap`` fails on a node half-way (NOTE [vmap fallback]), the nodes it ran would
already be freed and the seeds' loop could not run. So all seeds but the last are vmapped
with the graph kept, and the last seed runs alone, freeing it: the same work as one pass
of all the seeds, and the graph is freed exactly where a plain pass would free it (one
``retain_graph=True`` pass of all the seeds, as before, left it whole while the Gramian
reported it freed: a later ``backward`` went through).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from torchgram._core import _torch_compat
from torchgram._core.functional import stack_grads
from torchgram.backends.graph.nodes import Edge, NodeCaller
from torchgram.backends.graph.walk import WalkPlan


def engine_cotangents(outputs: Sequence[Tensor], slots: Sequence[Edge],
                      seeds: Sequence[Tensor], *, retain_graph: bool,
                      vectorize: bool = True) -> list[Tensor | None]:
    """``[c, *slot]`` cotangents at ``slots`` for ``c`` seeds ``[c, *output]`` per output.

    Several seeds are vmapped (``is_grads_batched``) when ``vectorize``, else (or when
    ``vmap`` cannot run the backward) looped. ``None`` where no output reaches a slot. Without
    ``retain_graph`` the pass frees the graph (NOTE [freeing from a vectorized pass]).
    """
    edges = [GradientEdge(node, nr) for node, nr in slots]
    count = seeds[0].shape[0]
    if count == 1 or not vectorize:
        per_seed = [torch.autograd.grad(list(outputs), edges, [s[i] for s in seeds],
                                        retain_graph=retain_graph or i + 1 < count,
                                        allow_unused=True)
                    for i in range(count)]
        return [stack_grads([grads[j] for grads in per_seed]) for j in range(len(edges))]
    vmapped = count if retain_graph else count - 1  # NOTE [freeing from a vectorized pass]
    try:
        grads = torch.autograd.grad(list(outputs), edges, [s[:vmapped] for s in seeds],
                                    retain_graph=True, allow_unused=True,
                                    is_grads_batched=True)
    except Exception:  # noqa: BLE001 -- NOTE [vmap fallback]: a backward vmap cannot batch
        return engine_cotangents(outputs, slots, seeds, retain_graph=retain_graph,
                                 vectorize=False)
    if retain_graph:
        return list(grads)
    last = torch.autograd.grad(list(outputs), edges, [s[-1] for s in seeds],
                               retain_graph=False, allow_unused=True)
    return [_appended(batched, one, vmapped) for batched, one in zip(grads, last, strict=True)]


def _appended(batched: Tensor | None, last: Tensor | None, count: int) -> Tensor | None:
    """``[count + 1, *slot]``: the ``count`` vmapped seeds' cotangents, then the last one's."""
    if batched is None and last is None:
        return None
    if last is None:
        assert batched is not None
        last = torch.zeros_like(batched[0])
    if batched is None:
        batched = last.new_zeros(count, *last.shape)
    return torch.cat([batched, last.unsqueeze(0)])


def walk_cotangents(outputs: Sequence[Tensor], slots: Sequence[Edge], seeds: Sequence[Tensor],
                    caller: NodeCaller) -> list[Tensor | None]:
    """Like :func:`engine_cotangents`, by walking the graph (no hook runs)."""
    edges = [_torch_compat.gradient_edge(out) for out in outputs]
    plan = WalkPlan([edge.node for edge in edges], slots)
    found: dict[Edge, Tensor | None] = {}

    def on_target(slot: Edge, jacobian: Tensor | None) -> None:
        found[slot] = jacobian

    with torch.no_grad():
        plan.run([((edge.node, edge.output_nr), seed) for edge, seed in zip(edges, seeds,
                                                                             strict=True)],
                 on_target, caller)
    return [found.get(slot) for slot in slots]

