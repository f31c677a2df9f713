"""Freeing a walked graph when ``retain_graph=False``.

# NOTE [releasing the graph]
The walk calls nodes directly (NOTE [calling nodes directly] in ``_graph_nodes``), which
never releases their saved tensors, and no public API releases them from Python: only the
autograd engine does, for each node it executes without ``retain_graph``. So with
``retain_graph=False`` the graph is freed the way autograd frees it, by the engine: one
``torch.autograd.grad`` pass with zero cotangents from the outputs to every leaf of the
graph (gradients are captured and dropped, never accumulated into ``.grad``). It costs
one ordinary backward pass. Like any ``torch.autograd.grad`` call it runs the hooks on its
path (tensor hooks, ``retain_grad``, module backward hooks) with those zero cotangents;
keep the default ``retain_graph=True`` when hooks must not run, and drop the references
to the outputs to free the graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from torchgram._core import _torch_compat
from torchgram.backends.graph.walk import WalkPlan


def release_graph(outputs: Sequence[Tensor], plan: WalkPlan) -> None:
    """Release the saved tensors of the graph below ``outputs`` (see NOTE above)."""
    leaves = [GradientEdge(node, 0) for node in plan.children
              if _torch_compat.is_leaf_accumulator(node)]
    if not leaves:
        return  # the outputs are leaves themselves: nothing is saved
    torch.autograd.grad(list(outputs), leaves, [torch.zeros_like(out) for out in outputs],
                        retain_graph=False, allow_unused=True)
