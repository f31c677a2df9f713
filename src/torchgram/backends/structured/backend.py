"""``backend="structured"``: Gramians from layer structure, with a fallback per leaf.

DESIGN.md §1. ``f`` runs once under a ``TorchFunctionMode`` (``trace``) that taps
every call a rule recognises (``F.linear``, matmuls, ``conv{1,2,3}d``, ``F.embedding``,
layer / group norm affine parameters; self-attention is rewritten into linear layers)
whose weight or bias is a parameter leaf; one backward per chunk of row cotangents
(a single one for per-sample losses, NOTE [structured passes]) gives every tap's cotangent;
each leaf's block then comes from small contractions of activations and cotangents, in
**ghost** form (never forming a Jacobian) or **materialized** per-row Jacobians, whichever
the cost model prefers (NOTE [structured cost model]), with the cross terms of leaves used
several times; an embedding table may also be contracted from its non-zero rows only. A
leaf used anywhere else gets its per-row (per-sample) Jacobian from the same backward,
through a per-sample copy of it: results are exact for every function; only speed depends
on the rules. ``torchgram.explain`` shows what happens to each leaf.

# NOTE [structured options]
* ``chunk_size``: backward directions per vectorized pass (``chunk_size // B`` of the ``K``
  rows per sample with ``batch_dim``; ``1``: loops without ``vmap``).
* ``memory_budget``: a leaf whose materialized Jacobian would exceed it is contracted in
  ghost form when its uses allow, and the rows per backward are sized to fit. The per-row
  Jacobians of fallback leaves and the kept factors are not split: for a hard bound on
  those, use the ``jacobian`` backend.
* ``diagonal=True``: only ``b = b'``, ``r = r'`` terms are formed (no ``B×B`` work).
* ``per_leaf=True``: one block per leaf (cross terms of a leaf's own uses included).
* With ``aggregated_grad``, ``Jᵀ w`` comes from the kept factors, without a second pass.

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

import torch
from torch import Tensor

from torchgram._core.composition import require_no_transforms
from torchgram._core.problem import Problem
from torchgram._core.result import BackendResult, Pullback, RunReport
from torchgram._core.sink import LeafBlocks, backend_index
from torchgram.backends._registry import register
from torchgram.backends.structured.contraction import Contraction, to_row_major
from torchgram.backends.structured.cost import Force, LeafPlan, Sizes, plan_leaves
from torchgram.backends.structured.passes import (
    Forward,
    backward_chunks,
    batched_forward,
    dense_forward,
    forget_trace,
    per_sample_forward,
    restrict,
    rows_per_pass,
    trace,
)
from torchgram.backends.structured.trace import Recording, TraceMismatch, UseRecord


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


def _forward_flops(recording: Recording, samples: int) -> float:
    per_call = {use.tap: use.shape.forward_flops for use in recording.uses if use.role == "weight"}
    unrecognised = sum(recording.unrecognised_flops.values())
    return float(samples * (sum(per_call.values()) + unrecognised))


def plan_problem(problem: Problem, recording: Recording | None = None, *,
                 force: Force | None = None) -> StructuredPlan:
    """Trace ``f`` (one sample with ``batch_dim``) and plan every leaf, without computing G.

    Without ``batch_dim`` the trace runs ``f`` on the full inputs and the plan is the one
    the backend would make after its own forward. ``force`` (``"ghost"``, ``"materialize"``
    or ``"sparse"``) overrides the cost model wherever that way is possible (for tests).
    """
    if recording is None:
        recording = trace(problem)
    samples = problem.samples
    sizes = Sizes(samples, problem.rows_per_sample, problem.diagonal, problem.itemsize)
    numels = tuple(leaf.numel() for leaf in problem.leaves)
    key = (sizes, numels, problem.batch is None, problem.memory_budget, force)
    plan = recording.plans.get(key)
    if plan is None:
        leaves = plan_leaves(numels, recording, sizes, tap_fallback_uses=problem.batch is None,
                             memory_budget=problem.memory_budget, force=force)
        plan = StructuredPlan(recording, sizes, tuple(leaves),
                              _forward_flops(recording, samples))
        recording.plans[key] = plan
    return plan


def run_uses(plans: Sequence[LeafPlan], run: Recording) -> dict[int, tuple[UseRecord, ...]]:
    """The run's records of the uses each plan contracts (same uses as planned, or raise)."""
    by_leaf: dict[int, list[UseRecord]] = {}
    for use in run.uses:
        by_leaf.setdefault(use.leaf, []).append(use)
    uses = {}
    for plan in plans:
        if not plan.uses:
            continue
        seen = tuple(by_leaf.get(plan.leaf, ()))
        if len(seen) != len(plan.uses):
            raise TraceMismatch(f"leaf {plan.leaf}: {len(seen)} uses in the run, "
                                f"{len(plan.uses)} planned")
        uses[plan.leaf] = seen
    return uses


@register("structured")
def structured_backend(problem: Problem) -> BackendResult:
    """Compute the Gramian blocks of ``problem`` with taps and rules (module docstring)."""
    return run_structured(problem)


def run_structured(problem: Problem, plan: StructuredPlan | None = None, *,
                   forward: Forward | None = None, force: Force | None = None) -> BackendResult:
    """The backend, optionally reusing a plan made by :func:`plan_problem` (``auto``).

    ``forward``: for dense rows, a tapped forward already run (by ``auto``'s planning).
    ``force`` is passed to :func:`plan_problem` (tests use it to exercise every way).
    """
    require_no_transforms(problem, "structured")
    with torch.enable_grad():
        if problem.batch is None:
            forward = dense_forward(problem) if forward is None else forward
            if plan is None or force is not None or plan.recording is not forward.recording:
                plan = plan_problem(problem, forward.recording, force=force)
            rows = forward.detached_rows().reshape(-1)
        else:
            forward, plan = _per_sample(problem, plan, force)
            rows = _row_major_rows(problem, forward)
        return _contract(problem, forward, plan, rows)


def _per_sample_forward(problem: Problem, traced: Recording) -> Forward:
    """The batched way if possible, else vmap (or a loop); all-fallback if the run diverges."""
    fallback = sorted(traced.unrecognised)
    tapped = [i for i in range(len(problem.leaves)) if i not in set(fallback)]
    expected = restrict(traced, tapped)
    loop = problem.chunk_size == 1
    try:
        if not fallback:
            forward = batched_forward(problem, expected)
            if forward is not None:
                return forward
        return per_sample_forward(problem, expected, fallback, loop=loop)
    except TraceMismatch:
        forget_trace(problem)  # the next call traces afresh
        everything = range(len(problem.leaves))
        return per_sample_forward(problem, restrict(traced, []), everything, loop=loop)


def _per_sample(problem: Problem, plan: StructuredPlan | None,
                force: Force | None) -> tuple[Forward, StructuredPlan]:
    traced = plan.recording if plan is not None else trace(problem)
    forward = _per_sample_forward(problem, traced)
    if len(forward.carrier_leaves) > len(traced.unrecognised):  # the run diverged
        traced = Recording(unrecognised={i: ["(a run that left its trace)"]
                                         for i in range(len(problem.leaves))})
        plan = None
    if plan is None or force is not None:
        plan = plan_problem(problem, traced, force=force)
    return forward, plan


def _row_major_rows(problem: Problem, forward: Forward) -> Tensor:
    """The forward's output rows in the backend's ``(r, b)`` order."""
    rows = forward.detached_rows()
    if forward.kind != "batched":  # [B, R], sample-major
        return rows.reshape(problem.samples, -1).T.reshape(-1)
    index = backend_index(problem, "row_major")  # rows are in the output's order
    return rows if index is None else rows[index]


def _contract(problem: Problem, forward: Forward, plan: StructuredPlan,
              rows: Tensor) -> BackendResult:
    samples, rows_per_sample = forward.samples, forward.rows_per_sample
    report = RunReport("structured", forward.kind,
                       leaf_ways=tuple(leaf.way for leaf in plan.leaves))
    contraction = Contraction(plan.leaves, run_uses(plan.leaves, forward.recording),
                              [leaf.numel() for leaf in problem.leaves], samples,
                              rows_per_sample, problem.diagonal, keep=problem.want_pullback,
                              dtype=problem.compute_dtype)
    contraction.set_acts(forward.acts)
    per_pass = rows_per_pass(problem, forward)
    for start, stop, tap_cots, carrier_grads in backward_chunks(
            forward, per_pass, vectorize=problem.chunk_size != 1,
            create_graph=problem.composition.create_graph):
        report.row_chunks.append((stop - start, sum(
            t.numel() * t.element_size() for t in [*tap_cots, *carrier_grads.values()]
            if t is not None)))
        contraction.add_rows(start, stop, tap_cots, carrier_grads)
        del tap_cots, carrier_grads
    blocks = LeafBlocks.for_problem(problem)
    for leaf, block in contraction.blocks(problem.compute_dtype):
        blocks.add(leaf, to_row_major(block, problem.diagonal))
    pullback = None
    if problem.want_pullback and contraction.complete:
        pullback = _pullback(problem, contraction, rows_per_sample, samples)
    return BackendResult(blocks.blocks(), report, row_order="row_major", aux=forward.aux,
                         rows=rows, pullback=pullback)


def _pullback(problem: Problem, contraction: Contraction, rows: int,
              samples: int) -> Pullback:
    """``w ↦ Jᵀ w`` from the kept factors: one contraction per use, no further pass."""

    def pullback(weights: Tensor) -> tuple[Tensor, ...]:
        grads = contraction.pullback(weights.reshape(rows, samples))
        return tuple(
            torch.zeros_like(leaf) if grad is None else grad.reshape(leaf.shape).to(leaf.dtype)
            for grad, leaf in zip(grads, problem.leaves, strict=True))

    return pullback
