"""``backend="graph"``: run ``f`` eagerly on leaves that require grad, then walk its graph.

The functional front of the engine behind :func:`torchgram.autograd.gramian` (DESIGN.md §2):
``f`` is evaluated once, on the full batch, with fresh leaves (detached aliases of the
parameters, never the user's tensors) that require grad; the row-Jacobians are pushed from
the output through the recorded autograd graph to those leaves (NOTE [frontier walk] in
``walk``) and each leaf's block is Grammed as soon as its Jacobian is complete.

Options:

* ``chunk_size``: rows per vectorized node call; with ``diagonal=True`` the walk runs once
  per chunk of rows, which also bounds the live frontier to ``chunk_size`` rows.
* ``diagonal``, ``per_leaf``, ``has_aux`` (the aux of the single full-batch evaluation,
  detached from the walked graph): supported.
* ``batch_dim`` / ``in_dims``: accepted and validated, and the result is the same matrix,
  but the walk does not use the per-sample structure: the row-Jacobians at an activation
  are held densely (``m × numel``) even where the structure says most entries are zero.
  A backend that works per sample (``jacobian`` with ``batch_dim``) is cheaper there.
* ``memory_budget``: ignored. The memory of this backend is the frontier of live
  row-Jacobians (``m`` times the size of the activations between two layers), set by the
  graph, not by grouping leaves; reduce it with fewer rows, or with ``chunk_size`` in
  diagonal mode.

# NOTE [module backward hooks]
Module backward hooks (``register_full_backward_hook``, ``register_full_backward_pre_hook``)
run in torch's backward, and may change the gradients that pass (a hook returning
``grad_input * 3``). torch's autograd runs them, and so does ``torch.func.jacrev`` (the
oracle) and the structured backend's backward to its taps; the walk calls each node itself
and runs none (NOTE [calling nodes directly]): with a hook that changes gradients it computed the
Gramian of another Jacobian (0.8 off, relative; session 26). Hooks cannot be asked what they
do, so a graph with any module backward hook (its ``BackwardHookFunction`` nodes) is declined
here, naming ``structured``; ``auto`` goes on to it. ``torchgram.autograd.gramian`` keeps its
documented walk, which runs no hook.

Composition (NOTE [composition]): with eager leaves or inputs that require grad, ``f`` runs on
aliases of the user's leaves (views, so the graph reaches them) and the walk calls the nodes
under grad mode, like a backward with ``create_graph=True``: ``G`` carries the graph. Inside
``torch.func`` transforms the backend declares it cannot run (it walks an eager graph).
"""

from __future__ import annotations

import torch

from torchgram._core import _torch_compat
from torchgram._core.census import refusing_gradient_hooks
from torchgram._core.composition import graph_leaf, require_no_transforms
from torchgram._core.errors import BackendCannotRun, gradient_hooks_refused
from torchgram._core.problem import Problem
from torchgram._core.pytree import detach_tree
from torchgram._core.result import BackendResult, RunReport
from torchgram._core.sink import LeafBlocks
from torchgram.backends._registry import register
from torchgram.backends.graph.gramian import graph_gramian, plan_graph
from torchgram.backends.graph.walk import WalkPlan


def _refuse_module_hooks(problem: Problem, plan: WalkPlan) -> None:
    """Decline a graph with module backward hooks (NOTE [module backward hooks])."""
    if any(_torch_compat.is_module_hook_node(node) for node in plan.children):
        raise BackendCannotRun(
            problem.api, "graph", "a graph without module backward hooks (the walk calls each "
            "node itself and runs no hook, where torch's autograd and torch.func run them)",
            "module backward hooks (register_full_backward_hook or "
            "register_full_backward_pre_hook) in f's graph", ("structured",),
            "Or remove the hooks while computing the Gramian.")


@register("graph")
def graph_backend(problem: Problem) -> BackendResult:
    """Evaluate ``f`` once with leaves that require grad, then walk the graph it recorded."""
    require_no_transforms(problem, "graph")
    create_graph = problem.composition.create_graph
    report = RunReport("graph", "walk of one full-batch forward"
                       + (", create-graph" if create_graph else ""))
    blocks = LeafBlocks.for_problem(problem)
    if problem.evaluation is not None:  # the probe ran f with autograd: NOTE [probing]
        leaves, rows, aux = (problem.evaluation.leaves, problem.evaluation.rows,
                             problem.evaluation.aux)
        if problem.evaluation.hooks:  # the walk runs none: NOTE [gradient hooks inside f]
            raise gradient_hooks_refused(problem.api, "graph")
    else:
        leaves = tuple(graph_leaf(leaf) for leaf in problem.leaves)
        with torch.enable_grad(), refusing_gradient_hooks(problem.api, "graph"):
            rows, aux = problem.rows(leaves)
    if rows.requires_grad:  # otherwise f does not depend on the leaves: G = 0
        plan = plan_graph([rows], leaves)
        _refuse_module_hooks(problem, plan)
        graph_gramian(problem.api, [rows], leaves, blocks, chunk_size=problem.chunk_size,
                      diagonal=problem.diagonal, plan=plan, report=report,
                      create_graph=create_graph, backend="graph")
    return BackendResult(blocks.blocks(), report, aux=aux if create_graph else detach_tree(aux),
                         rows=rows.detach())

