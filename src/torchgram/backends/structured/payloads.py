"""The structured pass stopped before its contractions: what each leaf's block is made of.

# NOTE [payloads]
The structured backend contracts each leaf's factors where the pass made them. To split
that work between processes (``torchgram.distributed``, DESIGN.md §6) the same pass can
stop just before, and return per leaf a :class:`LeafPayload`:

* **factors**: for each tapped use, its two factors in the leaf's layout (NOTE [factors]):
  an activation ``[B, T, G, a]`` (an index ``[B, T]`` for an embedding) and a cotangent
  ``[R, B, T, G, c]``; a bias use has one cotangent for both;
* **a Jacobian** ``[R, B, P]``: the per-row Jacobian of the leaf, its columns in the leaf's
  row-major order (never in whatever memory order a backward produced: payloads of
  different processes must agree column by column).

A leaf with a fallback part (a per-sample carrier) only has the Jacobian; one with uses
only has both. Either has its samples on one dimension (``0`` for activations, ``1``
otherwise), so payloads of several processes concatenate along it into the payload of
their samples together, and :func:`contract_payload` forms its block with the backend's
own contractions (``ghost_block``, ``sparse_embedding_gram``, ``materialize_use`` and
``gram_of_rows``): the block of the concatenation is the block the single-process backend
forms on the concatenated batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from torchgram._core.problem import Problem
from torchgram.backends.structured.contraction import (
    Factor,
    UseFactors,
    ghost_block,
    gram_of_rows,
    materialize_use,
    pullback_use,
    sparse_embedding_gram,
)
from torchgram.backends.structured.cost import LeafPlan, Sizes, Way, plan_leaf
from torchgram.backends.structured.passes import (
    ForwardKind,
    backward_chunks,
    dense_forward,
    rows_per_pass,
    run_with_fallbacks,
)
from torchgram.backends.structured.per_sample import per_sample_forward_checked
from torchgram.backends.structured.plan import plan_problem, run_uses
from torchgram.backends.structured.trace import Recording, UseRecord


@dataclass(frozen=True)
class UsePayload:
    """One tapped use of a leaf and its factors (``first ⊗ second`` in the leaf's layout)."""

    use: UseRecord
    factors: UseFactors


@dataclass(frozen=True)
class LeafPayload:
    """What one leaf's block is made of, on the samples of one pass (NOTE [payloads]).

    Attributes:
        plan: The leaf's plan (its uses are the trace's, for the cost model).
        uses: Every tapped use with its factors (empty for a fallback leaf in the
            per-sample pass, or one the output does not reach).
        carrier: ``[R, B, P]``: the per-row Jacobian of the uses no rule covers, or of
            every use when a factor could not be kept (``None``: no such part).
    """

    plan: LeafPlan
    uses: tuple[UsePayload, ...] = ()
    carrier: Tensor | None = None

    @property
    def factored(self) -> bool:
        """Whether the block can be formed from factors alone (no Jacobian part)."""
        return self.carrier is None and bool(self.uses)

    @property
    def zero(self) -> bool:
        """Whether the leaf contributes nothing on these samples."""
        return self.carrier is None and not self.uses

    def jacobian(self, numel: int) -> Tensor | None:
        """The per-row Jacobian ``[R, B, P]`` (``None`` when zero)."""
        part = self.carrier
        for item in self.uses:
            jac = materialize_use(item.use, item.factors, numel)
            part = jac if part is None else part + jac
        return part


@dataclass(frozen=True)
class PassPayloads:
    """The payloads of one structured pass (:func:`pass_payloads`).

    Attributes:
        kind: How ``f`` ran (NOTE [structured passes]); ``"dense"``: the rows of the
            whole batch, as ``R = m`` rows of one sample.
        samples: ``B`` (``1`` for dense rows).
        rows: ``R``: rows per sample (``m`` for dense rows).
        leaves: One payload per differentiated leaf.
        outputs: ``f``'s output rows ``[m]`` in the output's order (detached).
        aux: ``f``'s aux on the whole batch, or ``NO_AUX``.
    """

    kind: ForwardKind
    samples: int
    rows: int
    leaves: tuple[LeafPayload, ...]
    outputs: Tensor
    aux: Any = field(repr=False)


def pass_payloads(problem: Problem, *, dense: bool = False) -> PassPayloads:
    """Run the structured pass of ``problem`` and return its payloads, uncontracted.

    With ``batch_dim`` (and not ``dense``) this is the backend's checked per-sample pass,
    which raises ``NotPerSample`` where it does not hold; otherwise (or with ``dense``) the
    rows of the whole batch. Rows come in the backend's ``(r, b)`` order.
    """
    return run_with_fallbacks(problem, lambda problem, _: _pass_payloads(problem, dense))[0]


def _pass_payloads(problem: Problem, dense: bool) -> PassPayloads:
    with torch.enable_grad():
        if dense or problem.batch is None:
            forward = dense_forward(problem)
            plan = plan_problem(problem, forward.recording, dense=True)
        else:
            forward, plan = per_sample_forward_checked(problem, None, None)
        uses = run_uses(plan.leaves, forward.recording)
        rows, samples = forward.rows_per_sample, forward.samples
        cots: dict[tuple[int, int], list[Tensor | None]] = {}
        carriers: dict[int, list[Tensor | None]] = {}
        chunks: list[int] = []
        carrier_leaves = set(forward.carrier_leaves)
        for start, stop, tap_cots, carrier_grads in backward_chunks(
                forward, rows_per_pass(problem, forward), vectorize=not problem.loops_only):
            chunks.append(stop - start)
            for leaf_plan in plan.leaves:
                leaf = leaf_plan.leaf
                for k, use in enumerate(uses.get(leaf, ())):
                    raw = tap_cots[use.tap]
                    act = forward.acts[use.act] if use.act is not None else None
                    cots.setdefault((leaf, k), []).append(
                        None if raw is None else use.layout.cot_factor(raw, 2, act))
                if leaf in carrier_leaves:
                    grad = carrier_grads.pop(leaf, None)
                    carriers.setdefault(leaf, []).append(
                        None if grad is None else grad.reshape(*grad.shape[:2], -1))
            del tap_cots, carrier_grads
        leaves = tuple(
            _leaf_payload(leaf_plan, uses.get(leaf_plan.leaf, ()), forward.acts, cots,
                          carriers.get(leaf_plan.leaf), chunks, samples,
                          problem.leaves[leaf_plan.leaf].numel())
            for leaf_plan in plan.leaves)
    return PassPayloads(forward.kind, samples, rows, leaves, _output_rows(problem, forward),
                        forward.aux)


def _output_rows(problem: Problem, forward: Any) -> Tensor:
    """The forward's rows ``[m]`` in the output's order."""
    rows = forward.detached_rows()
    if forward.kind in ("batched", "dense"):
        return rows.reshape(-1)
    out = rows.new_empty(problem.num_rows)
    out[problem.sample_major_index.reshape(-1)] = rows.reshape(-1)
    return out


def _leaf_payload(plan: LeafPlan, uses: Sequence[UseRecord], acts: Sequence[Tensor],
                  cots: dict[tuple[int, int], list[Tensor | None]],
                  carrier: list[Tensor | None] | None, chunks: list[int], samples: int,
                  numel: int) -> LeafPayload:
    """A leaf's factors (every chunk of every use reached) or else its Jacobian."""
    per_use: list[tuple[UseRecord, Tensor | None, list[Tensor | None]]] = []
    for k, use in enumerate(uses):
        act = None
        if use.role == "weight":
            assert use.act is not None
            act = use.layout.act_factor(acts[use.act], 1)
        per_use.append((use, act, cots.get((plan.leaf, k), [])))
    reached = [c for _, _, pieces in per_use for c in pieces if c is not None]
    reached += [c for c in carrier or [] if c is not None]
    if not reached:
        return LeafPayload(plan)
    if carrier is None and all(all(c is not None for c in pieces) for _, _, pieces in per_use):
        payloads = []
        for use, act, pieces in per_use:
            full = [c for c in pieces if c is not None]
            if not full:
                continue
            cot = Factor(full[0] if len(full) == 1 else torch.cat(full), "cot")
            payloads.append(UsePayload(use, _use_factors(use, act, cot)))
        return LeafPayload(plan, tuple(payloads))
    # some chunk of some use was not reached (or a carrier part): materialize chunk by chunk
    parts: list[Tensor] = []
    for i, count in enumerate(chunks):
        part: Tensor | None = None if carrier is None else carrier[i]
        for use, act, pieces in per_use:
            piece = pieces[i]
            if piece is None:
                continue
            jac = materialize_use(use, _use_factors(use, act, Factor(piece, "cot")), numel)
            part = jac if part is None else part + jac
        if part is None:
            part = reached[0].new_zeros(count, samples, numel)
        parts.append(part)
    return LeafPayload(plan, carrier=parts[0] if len(parts) == 1 else torch.cat(parts))


def _use_factors(use: UseRecord, act: Tensor | None, cot: Factor) -> UseFactors:
    if use.role == "bias" or act is None:
        return UseFactors(cot, cot)
    act_factor = Factor(act, "index" if use.shape.act_is_index else "act")
    return UseFactors(act_factor, cot) if use.act_first else UseFactors(cot, act_factor)


def payload_way(payload: LeafPayload, numel: int, sizes: Sizes,
                memory_budget: int | None) -> Way:
    """How to contract ``payload`` on ``sizes`` (the cost model on the trace's uses).

    ``"ghost"`` or ``"sparse"`` from factors, ``"materialize"`` otherwise (Jacobian first).
    """
    if not payload.factored:
        return "materialize"
    recording = Recording(uses=list(payload.plan.uses or (u.use for u in payload.uses)))
    plan = plan_leaf(payload.plan.leaf, numel, recording, sizes, tap_fallback_uses=False,
                     memory_budget=memory_budget)
    return plan.way if plan.way in ("ghost", "sparse") else "materialize"


def contract_payload(payload: LeafPayload, numel: int, rows: int, samples: int, *,
                     diagonal: bool, dtype: torch.dtype, way: Way) -> Tensor | None:
    """The block ``[R, B, R, B]`` (``[R, B]`` with ``diagonal``) of a (gathered) payload.

    ``way`` comes from :func:`payload_way`; ``None`` for a zero block.
    """
    if payload.zero:
        return None
    if way == "ghost" and payload.factored:
        factors = [(item.factors, _positions(item)) for item in payload.uses]
        return ghost_block(factors, rows, samples, diagonal, dtype)
    if way == "sparse" and payload.factored:
        indices, cots = [], []
        for item in payload.uses:
            first, second = item.factors.first, item.factors.second
            index, cot = (first, second) if first.kind == "index" else (second, first)
            indices.append(index.tensor)
            cots.append(cot.tensor)
        classes = payload.uses[0].use.shape.act_width
        return sparse_embedding_gram(indices, cots, classes, diagonal)
    jacobian = payload.jacobian(numel)
    return None if jacobian is None else gram_of_rows(jacobian.to(dtype), diagonal)


def _positions(item: UsePayload) -> int:
    """Positions × groups per sample of a use, from its cotangent factor ``[R, B, T, G, c]``."""
    cot = item.factors.first if item.factors.first.kind == "cot" else item.factors.second
    return math.prod(cot.tensor.shape[2:4])


def payload_pullback(payload: LeafPayload, weights: Tensor, numel: int) -> Tensor | None:
    """``Σ_{r, b} w[r, b] J[r, b]`` flattened (``weights: [R, B]``; ``None`` when zero)."""
    grad = None
    if payload.carrier is not None:
        w = weights.to(payload.carrier.dtype)
        grad = torch.einsum("rb,rbp->p", w, payload.carrier)
    for item in payload.uses:
        piece = pullback_use(item.use, item.factors, weights, numel)
        grad = piece if grad is None else grad + piece
    return grad
