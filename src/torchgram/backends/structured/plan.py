"""The structured backend's plan: its trace, and one way per leaf (NOTE [structured cost model])."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from torchgram._core.problem import Problem
from torchgram.backends.structured.cost import Force, LeafPlan, Sizes, plan_leaves
from torchgram.backends.structured.passes import trace
from torchgram.backends.structured.trace import Recording, TraceMismatch, UseRecord


@dataclass(frozen=True)
class StructuredPlan:
    """What the structured backend will do for a problem (see :func:`plan_problem`).

    Attributes:
        recording: The uses found by the trace.
        sizes: Samples, rows per sample, diagonal, itemsize.
        leaves: One :class:`LeafPlan` per differentiated leaf.
        forward_flops: Rough multiply-adds of one forward of ``f`` on the whole batch.
        dense: Whether the plan is for the rows of the whole batch (no ``batch_dim``, or
            samples that interact: NOTE [per-sample]).
    """

    recording: Recording
    sizes: Sizes
    leaves: tuple[LeafPlan, ...]
    forward_flops: float
    dense: bool = False

    @property
    def contraction_cost(self) -> float:
        """Estimated multiply-adds of all leaves' contractions."""
        return sum(plan.cost for plan in self.leaves)


def _forward_flops(recording: Recording, samples: int) -> float:
    per_call = {use.tap: use.shape.forward_flops for use in recording.uses if use.role == "weight"}
    unrecognised = sum(recording.unrecognised_flops.values())
    return float(samples * (sum(per_call.values()) + unrecognised))


def plan_problem(problem: Problem, recording: Recording | None = None, *,
                 force: Force | None = None, dense: bool = False,
                 dead_positions: bool = True) -> StructuredPlan:
    """Trace ``f`` (one sample with ``batch_dim``) and plan every leaf, without computing G.

    Without ``batch_dim`` (or with ``dense``: the rows of the whole batch, NOTE
    [per-sample]) the recording is that of a run on the full inputs, and the plan is the
    one the backend makes after its own forward. ``force`` (``"ghost"``, ``"materialize"``
    or ``"sparse"``) overrides the cost model wherever that way is possible (for tests).
    ``dead_positions=False``: cost every position, for a contraction that does not drop
    the dead ones (NOTE [dead positions]; the cross kernels').
    """
    if recording is None:
        recording = trace(problem)
    dense = dense or problem.batch is None
    samples = 1 if dense else problem.samples
    rows = problem.num_rows if dense else problem.rows_per_sample
    sizes = Sizes(samples, rows, problem.diagonal, problem.itemsize)
    numels = tuple(leaf.numel() for leaf in problem.leaves)
    key = (sizes, numels, dense, problem.memory_budget, force, dead_positions)
    plan = recording.plans.get(key)
    if plan is None:
        planned = recording if dead_positions else _without_hints(recording)
        leaves = plan_leaves(numels, planned, sizes, tap_fallback_uses=dense,
                             memory_budget=problem.memory_budget, force=force)
        plan = StructuredPlan(recording, sizes, tuple(leaves),
                              _forward_flops(recording, samples), dense)
        recording.plans[key] = plan
    return plan


def _without_hints(recording: Recording) -> Recording:
    """The uses of ``recording`` with every position counted (NOTE [dead positions])."""
    if all(use.live is None for use in recording.uses):
        return recording
    return Recording(uses=[dataclasses.replace(use, live=None) for use in recording.uses],
                     unrecognised=recording.unrecognised,
                     unrecognised_flops=recording.unrecognised_flops)


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
