"""``backend="structured"``: Gramians from layer structure, with a fallback per leaf.

DESIGN.md §1. ``f`` runs once under a ``TorchFunctionMode`` (``rules.taps``) that taps
every call a rule recognises (``F.linear``, matmuls, ``conv{1,2,3}d``, ``F.embedding``)
whose weight or bias is a parameter leaf; one backward per chunk of row cotangents
(a single one for per-sample losses, NOTE [structured passes]) gives every tap's cotangent;
each leaf's block then comes from small contractions of activations and cotangents, in
**ghost** form (never forming a Jacobian) or **materialized** per-row Jacobians, whichever
the cost model prefers (NOTE [structured cost model]), with the cross terms of leaves used
several times. A leaf used anywhere else gets its per-row (per-sample) Jacobian from the
same backward, through a per-sample copy of it: results are exact for every function; only
speed depends on the rules.

Example:
    >>> import torch, torchgram as tg
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
    ...                             torch.nn.Linear(8, 3))
    >>> fn, params = tg.functionalize(model)
    >>> x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    >>> def losses(p, x, y):
    ...     return torch.nn.functional.cross_entropy(fn(p, x), y, reduction="none")
    >>> G = tg.gramian(losses, backend="structured", batch_dim=0)(params, x, y)
    >>> reference = tg.gramian(losses, backend="jacobian", batch_dim=0)(params, x, y)
    >>> torch.allclose(G, reference, atol=1e-5)
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from torchgram._problem import GramianProblem
from torchgram.backends._cost import LeafPlan, Sizes, plan_leaves
from torchgram.backends._registry import NO_AUX, register
from torchgram.backends._sink import GramSink
from torchgram.backends._structured_gram import Contraction, to_canonical
from torchgram.backends._structured_pass import (
    Forward,
    backward_chunks,
    dense_forward,
    per_sample_forward,
    rows_per_pass,
    trace,
)
from torchgram.rules.taps import Recording, TraceMismatch


@dataclass(frozen=True)
class StructuredPlan:
    """What the structured backend will do for a problem (see :func:`plan_problem`).

    Attributes:
        recording: The uses found by the trace.
        sizes: Samples, rows per sample, diagonal, itemsize.
        leaves: One :class:`LeafPlan` per differentiated leaf.
        forward_flops: Rough multiply-adds of one forward of ``f`` on the whole batch.
    """

    recording: Recording
    sizes: Sizes
    leaves: tuple[LeafPlan, ...]
    forward_flops: float

    @property
    def contraction_cost(self) -> float:
        """Estimated multiply-adds of all leaves' contractions."""
        return sum(plan.cost for plan in self.leaves)


def _itemsize(problem: GramianProblem) -> int:
    return max(leaf.element_size() for leaf in problem.leaves)


def _forward_flops(recording: Recording, samples: int) -> float:
    per_call = {use.tap: use.shape.forward_flops for use in recording.uses if use.role == "weight"}
    unrecognised = sum(recording.unrecognised_flops.values())
    return float(samples * (sum(per_call.values()) + unrecognised))


def plan_problem(problem: GramianProblem, recording: Recording | None = None, *,
                 force: str | None = None) -> StructuredPlan:
    """Trace ``f`` (one sample with ``batch_dim``) and plan every leaf, without computing G.

    Without ``batch_dim`` the trace runs ``f`` on the full inputs and the plan is the one
    the backend would make after its own forward. ``force`` (``"ghost"`` or
    ``"materialize"``) overrides the cost model wherever that way is possible (for tests).
    """
    if recording is None:
        recording = trace(problem)
    spec = problem.output
    assert spec is not None
    samples = 1 if problem.batch is None else problem.batch.size
    sizes = Sizes(samples, spec.num_rows // samples, problem.diagonal, _itemsize(problem))
    leaves = plan_leaves([leaf.numel() for leaf in problem.leaves], recording, sizes,
                         tap_fallback_uses=problem.batch is None,
                         memory_budget=problem.memory_budget, force=force)
    return StructuredPlan(recording, sizes, tuple(leaves), _forward_flops(recording, samples))


@register("structured")
def structured_backend(problem: GramianProblem, sink: GramSink) -> Any:
    """Compute the Gramian blocks of ``problem`` with taps and rules (module docstring)."""
    return run_structured(problem, sink)


def run_structured(problem: GramianProblem, sink: GramSink, plan: StructuredPlan | None = None,
                   *, force: str | None = None) -> Any:
    """The backend, optionally reusing a plan made by :func:`plan_problem` (``auto``).

    ``force`` is passed to :func:`plan_problem` (tests use it to exercise both ways).
    """
    with torch.enable_grad():
        if problem.batch is None:
            return _dense(problem, sink, force)
        _per_sample(problem, sink, plan, force)
        return NO_AUX


def _per_sample(problem: GramianProblem, sink: GramSink, plan: StructuredPlan | None,
                force: str | None) -> None:
    if plan is None:
        plan = plan_problem(problem, force=force)
    fallback = [p.leaf for p in plan.leaves if p.way == "fallback"]
    loop = problem.chunk_size == 1
    try:
        forward = per_sample_forward(problem, plan.recording, fallback, loop=loop)
        leaf_plans: Sequence[LeafPlan] = plan.leaves
    except TraceMismatch:  # the run left its trace: everything on the fallback
        everything = Recording(unrecognised={i: ["(replay mismatch)"]
                                             for i in range(len(problem.leaves))})
        plan = plan_problem(problem, everything)
        leaf_plans = plan.leaves
        forward = per_sample_forward(problem, everything, range(len(problem.leaves)),
                                     loop=loop)
    order = problem.canonical_rows()
    rows = forward.detached_rows()
    problem.output_rows = rows.new_empty(rows.numel())
    problem.output_rows[order.reshape(-1)] = rows.reshape(-1)
    _contract(problem, sink, forward, leaf_plans, _order_or_none(problem, order))


def _order_or_none(problem: GramianProblem, order: Tensor) -> Tensor | None:
    spec = problem.output
    assert spec is not None and spec.batch_dims is not None
    if len(spec.shapes) == 1 and spec.batch_dims[0] == 0:
        return None  # row-major [B, K...]: already the output's order
    return order


def _dense(problem: GramianProblem, sink: GramSink, force: str | None) -> Any:
    forward = dense_forward(problem)
    problem.output_rows = forward.detached_rows().reshape(-1)
    plan = plan_problem(problem, forward.recording, force=force)
    _contract(problem, sink, forward, plan.leaves, None)
    return forward.aux


def _contract(problem: GramianProblem, sink: GramSink, forward: Forward,
              plans: Sequence[LeafPlan], order: Tensor | None) -> None:
    samples, rows = forward.samples, forward.rows_per_sample
    contraction = Contraction(plans, [leaf.numel() for leaf in problem.leaves], samples, rows,
                              problem.diagonal)
    contraction.set_acts(forward.acts)
    per_pass = rows_per_pass(problem, forward)
    for start, stop, tap_cots, carrier_grads in backward_chunks(
            forward, per_pass, vectorize=problem.chunk_size != 1):
        contraction.add_rows(start, stop, tap_cots, carrier_grads)
    dtype = problem.output.dtype if problem.output is not None else problem.leaves[0].dtype
    total: Tensor | None = None
    for leaf, block in contraction.blocks(dtype):
        if problem.per_leaf:
            sink.add(leaf, to_canonical(block, rows, samples, order, problem.diagonal))
        else:
            total = block if total is None else total + block
    if total is not None:
        sink.add(0, to_canonical(total, rows, samples, order, problem.diagonal))
