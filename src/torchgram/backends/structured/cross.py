"""The structured backend's kernels between two input sets (NOTE [cross kernels]).

# NOTE [structured cross kernels]
Each side (``x1``, and ``x2`` unless it is ``x1``) runs the backend's usual passes once: a
tapped forward (per-sample when it holds, NOTE [per-sample]) and the backwards of every row
direction. What the side keeps is a :class:`Side`: for every leaf either its **factors**
(ghost: activations ``[B, T, G, a]`` and cotangents ``[R, B, T, G, c]`` per use) or its
**per-row Jacobian** ``[R, B, P]`` (materialize, fallback: the same pieces the self Gramian
builds). Then, for a leaf with factors on both sides, the ghost form between the sides::

    ⟨J_u(x1)[r, b], J_v(x2)[s, c]⟩ = Σ_{t, w, g} ⟨act_u[b, t, g], act_v[c, w, g]⟩ ·
                                                ⟨cot_u[r, b, t, g], cot_v[s, c, w, g]⟩

over every ordered pair of uses ``(u, v)`` (cross terms of tied weights included), and
``spec_gram(J1, J2)`` otherwise. The pair spec is applied **inside** the cotangent Gram:
rows ``r = (f, d, τ)`` meet rows ``s = (f', d, τ)`` only, summed over the traced ``τ``
(``K`` times fewer products for a traced logit axis), and a diagonal batch axis pairs ``b``
with ``c = b`` only. A linear layer's bias shares its weight's cotangent Gram (``T = 1``:
the bias block *is* that Gram), so weight and bias cost one product.

Both sides use the left side's ways; a side whose per-sample passes do not hold (its rows
come from the whole batch) materializes every leaf, and a ghost leaf meeting such a side is
materialized from its factors for that pair. Ghost needs every use of the leaf in the same
orientation (activation first or cotangent first) with dense activations, or all index
activations (embeddings); any other leaf is materialized (always exact).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from torchgram._core.composition import require_no_forward_tangents, require_no_transforms
from torchgram._core.cross import (
    CrossProblem,
    CrossResult,
    PairSpec,
    group_rows,
    mirror,
    row_shape,
    sample_rows_view,
    spec_gram,
)
from torchgram._core.errors import NotPerSample
from torchgram._core.per_sample import even_odd, separating_groups
from torchgram._core.problem import Problem
from torchgram._core.result import RunReport
from torchgram.backends._embedding import checked_conventions
from torchgram.backends._registry import register_cross
from torchgram.backends.structured.contraction import (
    Factor,
    UseFactors,
    centered,
    materialize_use,
)
from torchgram.backends.structured.cost import LeafPlan
from torchgram.backends.structured.passes import (
    Forward,
    backward_chunks,
    batched_forward,
    dense_forward,
    forget_trace,
    per_sample_view,
    raise_hooked,
    redone_note,
    restrict,
    row_grads,
    rows_per_pass,
    run_with_fallbacks,
    trace,
    with_row_loops,
)
from torchgram.backends.structured.per_sample import (
    _check_batched,
    check_leaks,
    group_directions,
    left_its_trace,
    per_sample_forward_checked,
)
from torchgram.backends.structured.plan import StructuredPlan, plan_problem, run_uses
from torchgram.backends.structured.selections import opened_nodes
from torchgram.backends.structured.trace import Recording, TraceMismatch, UseRecord

MAX_PAIR_ELEMENTS = 2**25
"""Entries of one ghost pair's cotangent Gram before it is split over side-1 samples."""


@dataclass
class Side:
    """One evaluation's pieces for cross contractions (NOTE [structured cross kernels]).

    Attributes:
        problem: The side's problem.
        ways: Per leaf: ``"ghost"`` (factors kept), ``"materialize"`` (per-row Jacobian
            kept) or ``"unused"``.
        samples: ``B`` (1 when the rows are those of the whole batch).
        row_shape: The shape of a sample's rows (``R`` entries).
        factors: Ghost leaves: per use, its record and factors (cotangents of every row).
        jacobians: Materialized leaves: ``[R, B, P]``.
        bias_taps: Materialized leaves whose Jacobian is one tap's cotangent (a bias without
            positions): the key of that tap, so that its Gram is shared with the weight's.
        kind: How the forward ran (``"batched"``, ``"vmap"``, ``"loop"``, ``"dense"``).
        notes: Anything worth reporting.
    """

    problem: Problem
    ways: dict[int, str]
    samples: int
    row_shape: tuple[int, ...]
    factors: dict[int, list[tuple[UseRecord, UseFactors]]] = field(default_factory=dict)
    jacobians: dict[int, Tensor] = field(default_factory=dict)
    bias_taps: dict[int, Any] = field(default_factory=dict)
    kind: str = ""
    notes: list[str] = field(default_factory=list)

    def jacobian(self, leaf: int) -> Tensor | None:
        """Leaf ``leaf``'s per-row Jacobian ``[R, B, P]`` (materialized from factors if needed)."""
        jac = self.jacobians.get(leaf)
        if jac is not None or leaf not in self.factors:
            return jac
        numel = self.problem.leaves[leaf].numel()
        total: Tensor | None = None
        for use, factors in self.factors[leaf]:
            part = materialize(use, factors, numel)
            total = part if total is None else total + part
        return total


MAX_ROW_LOOP = 64
"""Rows up to which a use with positions is materialized row by row (no expanded copies)."""


def materialize(use: UseRecord, factors: UseFactors, numel: int) -> Tensor:
    """A use's per-row Jacobian ``[R, B, numel]`` in the leaf's layout.

    For a dense use with positions (a convolution, a linear layer on a sequence) and one
    group, row by row: ``J[r, b] = cot[r, b]ᵀ act[b]`` is one matrix product per sample,
    batched over the samples, without the ``R``-fold copy of the activations a broadcasting
    product would make; everything else as ``contraction.materialize_use``.
    """
    first, second = factors.first, factors.second
    if (use.role == "bias" or use.shape.elementwise or first.kind == "index"
            or second.kind == "index"):
        return materialize_use(use, factors, numel)
    cot, act, cot_first = ((first, second, True) if first.kind == "cot"
                           else (second, first, False))
    rows, samples, positions, groups, width = cot.tensor.shape
    if groups != 1 or positions == 1 or rows > MAX_ROW_LOOP or act.tensor.dim() != 4:
        return materialize_use(use, factors, numel)
    # f's activations and cotangents may differ in dtype (an autocast region inside f)
    dtype = torch.promote_types(cot.tensor.dtype, act.tensor.dtype)
    acts = act.tensor.reshape(samples, positions, -1).to(dtype)  # [B, T, a]
    cot_rows = cot.tensor.to(dtype)
    if torch.is_grad_enabled() and (acts.requires_grad or cot_rows.requires_grad):
        # a differentiable kernel (NOTE [composition]): autograd refuses out= products
        return torch.stack([_row_product(cot_rows[r].reshape(samples, positions, width),
                                         acts, cot_first).reshape(samples, numel)
                            for r in range(rows)])
    out = cot_rows.new_empty(rows, samples, numel)
    for r in range(rows):
        cots = cot_rows[r].reshape(samples, positions, width)  # [B, T, c]
        _row_product(cots, acts, cot_first, out=out[r].view(samples, numel))
    return out


def _row_product(cots: Tensor, acts: Tensor, cot_first: bool, *,
                 out: Tensor | None = None) -> Tensor:
    """One row's per-sample ``cotᵀ act`` (``[B, c, a]``) or ``actᵀ cot`` (``[B, a, c]``)."""
    if cot_first:
        first, second = cots.transpose(1, 2), acts
    else:
        first, second = acts.transpose(1, 2), cots
    if out is None:
        return torch.bmm(first, second)
    return torch.bmm(first, second, out=out.view(first.shape[0], first.shape[1], -1))


def cross_ways(plan: StructuredPlan) -> dict[int, str]:
    """The way of every leaf in a cross kernel, from a self-Gramian plan."""
    ways = {}
    for leaf in plan.leaves:
        if leaf.way == "unused":
            ways[leaf.leaf] = "unused"
        elif leaf.way in ("ghost", "sparse") and _ghost_pairs_ok(leaf):
            ways[leaf.leaf] = "ghost"
        else:
            ways[leaf.leaf] = "materialize"
    return ways


def _ghost_pairs_ok(plan: LeafPlan) -> bool:
    uses = plan.uses
    if not uses or any(use.role != "weight" or use.shape.elementwise for use in uses):
        return False
    orientation = {(use.act_first, use.shape.act_is_index) for use in uses}
    return len(orientation) == 1


def _batched(problem: Problem) -> tuple[Forward, StructuredPlan] | None:
    """The per-sample forward on the whole batch, unchecked (NOTE [derivative check]).

    ``None`` when the batched way does not apply (a leaf on the fallback, tapped calls
    whose shapes do not show the samples, a run that left its trace).
    """
    traced = trace(problem)
    if traced.coupling:
        raise NotPerSample(f"f calls {traced.coupling[0]}: its samples interact")
    if traced.unrecognised:
        return None
    tapped = tuple(range(len(problem.leaves)))
    key = ("restricted", tapped)
    expected = traced.plans.get(key)
    if expected is None:
        expected = traced.plans[key] = restrict(traced, tapped)
    try:
        forward = batched_forward(problem, expected)
    except TraceMismatch:
        forget_trace(problem)
        return None
    if forward is None:
        return None
    if forward.recording.coupling:
        raise NotPerSample(f"f calls {forward.recording.coupling[0]}: its samples interact")
    return forward, plan_problem(problem, traced, dead_positions=False)


VALUE_CHECK_FIXED = 1.5e7
"""Cost of evaluating ``f`` once more (the value check), in multiply-adds (Python and
dispatch; the same units as NOTE [auto cost model])."""
BACKWARD_PER_DIRECTION = 0.5
"""A backward direction's cost as a fraction of the forward's (activations' gradients only)."""


def derivative_check_cheaper(forward_flops: float, samples: int) -> bool:
    """Whether two more backward directions cost less than one more evaluation of ``f``.

    Example:
        >>> derivative_check_cheaper(1e7, 16), derivative_check_cheaper(3e8, 512)
        (True, False)
    """
    derivative = 2 * BACKWARD_PER_DIRECTION * forward_flops
    value = VALUE_CHECK_FIXED + 2 * forward_flops / max(1, samples)
    return samples > 1 and derivative < value


# NOTE [derivative check]
# The batched way reads sample b's factors from the rows of sample b of every tap, which is
# exact if and only if no output row of sample b has a non-zero cotangent on another
# sample's rows of a tap: then J(out[b]) = Σ_taps cot[b] ⊗ act[b], however the activations
# were computed from the inputs (even if the inputs were mixed before the first tap). So
# instead of evaluating f again on samples run apart (what tg.gramian's batched way does),
# kernels check exactly that, in the same backward: two more directions, the rows of the
# even-numbered samples and those of the odd-numbered ones (NaN weights, group_directions;
# not in a differentiable backward, where they run apart: NOTE [opened selections]), whose
# cotangents must be exactly zero on every sample of the other
# group at every tap (an interaction through the graph makes them non-zero). Until session
# 24 the two directions were the first sample's rows and the last one's: a kernel hunt found
# x - x.mean(0) before a relu that had zeroed both their outputs, the check saw nothing and
# the kernel was 0.64 off (relative); tg.gramian's derivative check had the same blind spot
# (session 23) and the same remedy. Samples that interact only within their group (0 and 2
# alone) are not seen by these two: the first check of a trace uses groups that separate
# every pair of samples instead (separating_groups, about log2 B directions; session 28: a
# fuzz case exchanging samples 0 and 2, the same where they met, was 1.57 off), since a
# coupling is mostly a property of the code -- and again whenever the index tensors that
# route the batched graph's cotangents change (NOTE [routing values]: f(p, x) =
# model(x)[x[:, 0].argsort()], sorted on the first call, was 0.34-0.95 off on later calls
# exchanging samples 0 and 2) or the kinds of the graph's nodes (code that adds a node mixing
# the samples after the first call; each routing once, Recording.checked_routings). The
# thorough check's pass has the graph's selections opened (NOTE [opened selections]). A
# failed check means the rows of the whole batch (NOTE [per-sample]). Two directions cost
# about a forward of the batch, so for large batches (where one more evaluation of f on two
# samples is cheaper) the value check of tg.gramian's batched way runs instead:
# derivative_check_cheaper compares the two from the plan's forward cost. Later calls of a
# checked trace and routing run the even and odd directions only where f draws random numbers
# or its run rewrote a call outside rules.SETTLED_PER_TRACE; otherwise none (session 42: NOTE
# [when the values are compared] in per_sample.py says why the thorough check's verdict holds
# for them).


def _checked_chunks(problem: Problem, forward: Forward, recording: Recording,
                    per_pass: int) -> Iterator[tuple[int, int, list[Tensor | None]]]:
    """Batched backwards with the derivative check in the first (NOTE [derivative check])."""
    raise_hooked(forward.recording, streamed=False)  # NOTE [hooks on taps]
    rows = forward.outputs[0]
    if not rows.requires_grad:
        return
    taps: Any = forward.taps[0]  # tensors and gradient edges (NOTE [tap edges])
    total, samples = forward.rows_per_sample, forward.samples
    routing = forward.routing
    # groups separating every pair: once per trace and routing (NOTE [derivative check])
    thorough = routing not in recording.checked_routings
    # later calls of a checked trace and routing: none for an f that draws nothing and whose
    # run rewrote nothing the trace does not settle (NOTE [when the values are compared])
    later = len(even_odd(samples)) if problem.draw.random or forward.recheck_values else 0
    checks = len(separating_groups(samples)) if thorough else later
    for start in range(0, total, per_pass):
        stop = min(start + per_pass, total)
        extra = checks if start == 0 else 0
        cot, others = _directions(problem, recording, rows, start, stop, extra, thorough)
        first = stop - start
        create_graph = problem.composition.create_graph
        # the thorough check's pass opens the selections (the rows' cotangents are finite:
        # unchanged); NOTE [opened selections]
        opened = forward.selections if others is not None and thorough else ()
        if others is not None and create_graph:  # NaN directions stay out of a graph that a
            # backward of G goes through (0 · NaN there)
            with opened_nodes(opened):
                check_leaks(row_grads(rows, taps, cot[first:], batched=True,
                                      retain_graph=True, create_graph=False),
                            forward, others)
            cot, opened = cot[:first], ()
        batched = cot.shape[0] > 1
        with opened_nodes(opened):
            raw = row_grads(rows, taps, cot, batched=batched, retain_graph=stop < total,
                            create_graph=create_graph)
        grads = [None if g is None else
                 per_sample_view(g if batched else g.unsqueeze(0), dim, 1, samples)
                 for g, dim in zip(raw, forward.tap_dims, strict=True)]
        del raw
        if others is not None:
            if not create_graph:
                check_leaks([None if g is None else g[first:] for g in grads], forward,
                            others, viewed=True)
            if thorough:
                recording.note_checked(routing)
        yield start, stop, [None if g is None else g[:first] for g in grads]



def _directions(problem: Problem, recording: Recording, rows: Tensor, start: int, stop: int,
                checks: int, thorough: bool = False) -> tuple[Tensor, Tensor | None]:
    """The cotangents of rows ``start:stop`` and of ``checks`` check directions (or none).

    The check directions are :func:`group_directions`'s (``thorough``: of groups separating
    every pair of samples; otherwise the even- and the odd-numbered), returned with where
    they must vanish. The same for every call of a signature: kept with its trace.
    """
    key = ("cross directions", rows.shape, rows.dtype, rows.device, start, stop, checks,
           thorough, torch.is_anomaly_enabled())  # NaN or finite weights (check_weights)
    cached = recording.plans.get(key)
    if cached is None:
        index = problem.sample_major_index  # [B, K]: output rows of each sample
        count = stop - start + checks
        cot = rows.new_zeros(count, rows.numel())
        span = torch.arange(stop - start, device=rows.device)
        cot[span[:, None], index[:, start:stop].T] = 1
        others = None
        if checks:
            cot[stop - start:], others = group_directions(
                rows, index, problem.samples,
                separating_groups(problem.samples) if thorough else None)
        cached = recording.plans[key] = (cot.reshape(count, *rows.shape), others)
    return cached


def _plan_side(problem: Problem, ways: dict[int, str] | None, *, whole_batch: bool
               ) -> tuple[Forward, dict[int, str], StructuredPlan, bool]:
    """The side's forward, its ways and plan, and whether it runs the derivative check."""
    if whole_batch:
        forward = dense_forward(problem)
        plan = plan_problem(problem, forward.recording, force="materialize", dense=True)
        return forward, {p.leaf: ("unused" if p.way == "unused" else "materialize")
                         for p in plan.leaves}, plan, False
    if problem.batch is None:
        forward = dense_forward(problem)
        plan = plan_problem(problem, forward.recording, dense=True)
        return forward, ways or cross_ways(plan), plan, False
    batched = None if problem.loops_only else _batched(problem)
    if batched is not None:
        forward, plan = batched
        derivative = derivative_check_cheaper(plan.forward_flops, forward.samples)
        # samples run apart (NOTE [per-sample]); merged sample dims always: their order is
        # checked there (NOTE [checking the batched pass]), and the batched way dropped if wrong
        if (not derivative or forward.merged_acts) and \
                not _check_batched(problem, forward, plan.recording):
            batched = None
    if batched is not None:
        return forward, ways or cross_ways(plan), plan, derivative
    forward, plan = per_sample_forward_checked(problem, None, None)
    if left_its_trace(plan.recording):
        # a later sample left the trace (an early exit, a route through other weights): the
        # kernel's per-sample pieces came out zero for the leaves it used (auto and structured
        # 1.0 off; session 67's hunt), where the rows of the whole batch are exact
        raise NotPerSample("its samples take other paths through f than the first one")
    return forward, ways or cross_ways(plan), plan, False



def compute_side(problem: Problem, ways: dict[int, str] | None = None, *,
                 coupled: NotPerSample | None = None) -> Side:
    """Run ``problem``'s passes once and keep its factors / Jacobians (NOTE above).

    ``ways``: those of the other side (so that both keep the same pieces); ``None``: this
    side's own plan. Where the per-sample passes do not hold, the side's rows are those of
    the whole batch, every leaf materialized (NOTE [per-sample]); ``coupled``: they were
    already found not to hold (why), and are not tried again.
    """
    with torch.enable_grad():
        if problem.batch is None:
            return _compute_side(problem, ways, whole_batch=False)
        why = coupled
        if why is None:
            try:
                return _compute_side(problem, ways, whole_batch=False)
            except NotPerSample as error:
                why = error
        side = _compute_side(problem, ways, whole_batch=True)
        side.notes.append(f"per-sample passes do not hold ({why.reason}): rows of the whole "
                          "batch")
        return side


def _compute_side(problem: Problem, ways: dict[int, str] | None, *, whole_batch: bool) -> Side:
    """:func:`compute_side` one way (the rows of the whole batch with ``whole_batch``)."""
    side, chunks = _side_chunks(problem, ways, whole_batch=whole_batch)
    parts = [part for _, _, part in chunks]
    merged = _merge_rows(side, parts)
    if whole_batch:  # [m, 1, P] in output order -> [R, B, P]
        merged.jacobians = {
            leaf: sample_rows_view(jac.reshape(jac.shape[0], -1), problem, "output")
            for leaf, jac in merged.jacobians.items()}
        merged.samples = problem.samples
        merged.row_shape = row_shape(problem)
        merged.bias_taps.clear()
    return merged


def _side_chunks(problem: Problem, ways: dict[int, str] | None, *, whole_batch: bool,
                 pass_bytes: int | None = None) -> tuple[Side, Iterator[tuple[int, int, Side]]]:
    """The side without pieces, and the side of each backward's rows ``start:stop``.

    Each part holds the factors and Jacobians of its rows only (``row_shape`` their count);
    :func:`_merge_rows` joins them. ``pass_bytes`` caps the cotangents of one backward
    (NOTE [streamed cross kernels]).
    """
    forward, ways, plan, derivative_check = _plan_side(problem, ways, whole_batch=whole_batch)
    side = Side(problem, dict(ways), forward.samples, row_shape(problem) if not whole_batch
                else (forward.rows_per_sample,), kind=forward.kind)
    per_pass = rows_per_pass(problem, forward)
    if pass_bytes is not None:
        per_pass = max(1, min(per_pass, pass_bytes // max(1, _direction_bytes(problem, forward))))
    chunks: Iterator[tuple[int, int, list[Tensor | None], dict[int, Tensor]]] = (
        ((start, stop, cots, {}) for start, stop, cots
         in _checked_chunks(problem, forward, plan.recording, per_pass)) if derivative_check
        else backward_chunks(forward, per_pass, vectorize=not problem.loops_only,
                             create_graph=problem.composition.create_graph))
    return side, _chunk_parts(side, forward, plan, chunks)


def _direction_bytes(problem: Problem, forward: Forward) -> int:
    """Bytes of the tap cotangents one backward direction makes (every sample)."""
    count = sum(math.prod(record.shape) for record in forward.recording.taps)
    return count * problem.itemsize


def _chunk_parts(side: Side, forward: Forward, plan: StructuredPlan,
                 chunks: Iterator[tuple[int, int, list[Tensor | None], dict[int, Tensor]]]
                 ) -> Iterator[tuple[int, int, Side]]:
    """One :class:`Side` per backward chunk: the pieces of its rows."""
    problem, samples = side.problem, forward.samples
    uses = run_uses(plan.leaves, forward.recording)
    acts = forward.acts
    numels = [leaf.numel() for leaf in problem.leaves]
    planned = {p.leaf: p for p in plan.leaves}

    act_factors: dict[tuple[int, int], Factor] = {}  # the same objects in every chunk

    def act_factor(use: UseRecord) -> Factor:
        assert use.act is not None
        key = (use.act, id(use.layout))
        factor = act_factors.get(key)
        if factor is None:
            factor = act_factors[key] = Factor(use.layout.act_factor(acts[use.act], 1),
                                               "index" if use.shape.act_is_index else "act")
        return factor

    def cot_tensor(use: UseRecord, tap_cots: Sequence[Tensor | None]) -> Tensor | None:
        raw = tap_cots[use.tap]
        if raw is None:
            return None
        return use.layout.cot_factor(raw, 2, acts[use.act] if use.act is not None else None)

    def use_factors(use: UseRecord, cot: Tensor) -> UseFactors:
        cot_factor = Factor(cot, "cot", (use.tap, id(use.layout)))
        if use.role == "bias":
            return UseFactors(cot_factor, cot_factor)
        act = act_factor(use)
        return UseFactors(act, cot_factor) if use.act_first else UseFactors(cot_factor, act)

    def single_bias(leaf: int) -> bool:
        leaf_uses = uses.get(leaf, ())
        return (len(leaf_uses) == 1 and leaf_uses[0].role == "bias"
                and bool(planned[leaf].uses) and planned[leaf].uses[0].shape.positions == 1
                and leaf_uses[0].shape.groups == 1)

    for start, stop, tap_cots, carrier_grads in chunks:
        count = stop - start
        part = Side(problem, side.ways, samples, (count,), kind=side.kind)
        for leaf, way in side.ways.items():
            leaf_uses = uses.get(leaf, ())
            if way == "unused":
                continue
            if way == "ghost":
                kept = []
                for use in leaf_uses:
                    cot = cot_tensor(use, tap_cots)
                    if cot is not None:
                        kept.append((use, use_factors(use, cot)))
                if kept:
                    part.factors[leaf] = kept
                continue
            jac: Tensor | None = carrier_grads.pop(leaf, None)
            if jac is not None:
                jac = jac.reshape(*jac.shape[:2], -1)
            elif single_bias(leaf):
                cot = cot_tensor(leaf_uses[0], tap_cots)
                if cot is not None:
                    part.jacobians[leaf] = cot.reshape(count, samples, -1)
                    part.bias_taps[leaf] = (leaf_uses[0].tap, id(leaf_uses[0].layout))
                continue
            for use in leaf_uses:
                cot = cot_tensor(use, tap_cots)
                if cot is None:
                    continue
                piece = materialize(use, use_factors(use, cot), numels[leaf])
                jac = piece if jac is None else jac + piece
            if jac is not None:
                part.jacobians[leaf] = jac
        del tap_cots, carrier_grads
        yield start, stop, part


def _merge_rows(side: Side, parts: Sequence[Side]) -> Side:
    """``side`` with the pieces of ``parts`` (consecutive rows) joined along the rows."""
    if not parts:
        return side
    first = parts[0]
    for leaf, kept in first.factors.items():
        side.factors[leaf] = [
            (use, UseFactors(_join([p.factors[leaf][k][1].first for p in parts]),
                             _join([p.factors[leaf][k][1].second for p in parts])))
            for k, (use, _) in enumerate(kept)]
    for leaf, jac in first.jacobians.items():
        side.jacobians[leaf] = jac if len(parts) == 1 else torch.cat(
            [p.jacobians[leaf] for p in parts])
    side.bias_taps.update(first.bias_taps)
    return side


def _join(factors: Sequence[Factor]) -> Factor:
    """One factor from the same factor of consecutive row chunks (cotangents are joined)."""
    first = factors[0]
    if first.kind != "cot" or len(factors) == 1:
        return first
    return Factor(torch.cat([f.tensor for f in factors]), "cot", first.key)


# -- contractions ----------------------------------------------------------------------------

def _cot_gram(x: Tensor, y: Tensor, spec: PairSpec, shape1: Sequence[int],
              shape2: Sequence[int]) -> Tensor:
    """Cotangents ``[R, B, 1, 1, c]`` of two sides: their kernel block (one position)."""
    return spec_gram(x.reshape(x.shape[0], x.shape[1], -1),
                     y.reshape(y.shape[0], y.shape[1], -1), spec, shape1, shape2)


def _act_gram(x: Factor, y: Factor, mode: str, dtype: torch.dtype) -> Tensor:
    """``⟨act_x[b, t, g], act_y[c, w, g]⟩`` of two sides' activations.

    ``[B1, T1, G, B2, T2]`` for a free batch axis, ``[B, T1, G, T2]`` (same sample) otherwise.
    """
    same = mode != "free"
    if x.kind == "index":  # [B, T] indices: equality (one group)
        a, b = x.tensor, y.tensor
        if same:
            return (a[:, :, None] == b[:, None, :]).to(dtype).unsqueeze(2)
        return (a[:, :, None, None] == b[None, None]).to(dtype).unsqueeze(2)
    if same:
        return torch.einsum("btgz,bwgz->btgw", x.tensor, y.tensor)
    return torch.einsum("btgz,cwgz->btgcw", x.tensor, y.tensor)


def _split(factors: UseFactors) -> tuple[Factor, Factor]:
    """``(activation, cotangent)`` of a weight use."""
    if factors.first.kind == "cot":
        return factors.second, factors.first
    return factors.first, factors.second


def ghost_pair(u: UseFactors, v: UseFactors, spec: PairSpec, shape1: Sequence[int],
               shape2: Sequence[int], dtype: torch.dtype,
               cot_grams: dict[Any, Tensor] | None = None,
               max_elements: int = MAX_PAIR_ELEMENTS) -> Tensor:
    """``⟨J_u(x1), J_v(x2)⟩`` in the canonical layout, from the factors (NOTE above)."""
    act_u, cot_u = _split(u)
    act_v, cot_v = _split(v)
    mode = spec.batch_mode
    positions = cot_u.tensor.shape[2] * cot_u.tensor.shape[3]
    positions_v = cot_v.tensor.shape[2] * cot_v.tensor.shape[3]
    if positions == 1 and positions_v == 1 and act_u.kind == "act":
        # the batch pairs (or the same sample, summed later for a traced batch)
        pair_spec = spec if mode != "trace" else dataclasses.replace(
            spec, modes=_diagonal_batch(spec))
        key = (cot_u.key, cot_v.key, pair_spec.batch_mode)
        gram = None if cot_grams is None else cot_grams.get(key)
        if gram is None:
            gram = _cot_gram(cot_u.tensor, cot_v.tensor, pair_spec, shape1, shape2)
            if cot_grams is not None:
                cot_grams[key] = gram
        a_u = act_u.tensor.reshape(act_u.tensor.shape[0], -1)
        a_v = act_v.tensor.reshape(act_v.tensor.shape[0], -1)
        if mode == "free":  # [1, D, F1, B1, F2, B2]
            return gram * (a_u @ a_v.T)[None, None, None, :, None, :]
        acts = (a_u * a_v).sum(-1)[:, None, None, None, None, None]  # [B]
        return gram * acts if mode == "diagonal" else (gram * acts).sum(0, keepdim=True)
    return _ghost_general(act_u, cot_u, act_v, cot_v, spec, shape1, shape2, dtype, max_elements)


def _diagonal_batch(spec: PairSpec) -> tuple[Any, ...]:
    modes = list(spec.modes)
    assert spec.batch_axis is not None
    modes[spec.batch_axis] = "diagonal"
    return tuple(modes)


def _ghost_general(act_u: Factor, cot_u: Factor, act_v: Factor, cot_v: Factor, spec: PairSpec,
                   shape1: Sequence[int], shape2: Sequence[int], dtype: torch.dtype,
                   max_elements: int) -> Tensor:
    """Ghost pair with positions or groups: chunked over side-1 samples."""
    mode = spec.batch_mode
    x = group_rows(cot_u.tensor, spec, shape1)  # [F1, D, X, B1, T1, G, c]
    y = group_rows(cot_v.tensor, spec, shape2)  # [F2, D, X, B2, T2, G, c]
    f1, d = x.shape[:2]
    samples1, t1, groups = x.shape[3:6]
    f2, samples2, t2 = y.shape[0], y.shape[3], y.shape[4]
    per_sample = d * f1 * t1 * groups * f2 * t2 * (samples2 if mode == "free" else 1)
    step = max(1, min(samples1, max_elements // max(1, per_sample)))
    pieces = []
    for b0 in range(0, samples1, step):
        bs = slice(b0, min(b0 + step, samples1))
        xu = x[:, :, :, bs]
        au = Factor(act_u.tensor[bs], act_u.kind)
        if mode == "free":
            acts = _act_gram(au, act_v, mode, x.dtype)  # [b, t, g, c, w]
            cots = torch.einsum("fdxbtgz,hdxcwgz->dfbtghcw", xu, y)
            pieces.append(torch.einsum("dfbtghcw,btgcw->dfbhc", cots, acts))
        else:
            av = Factor(act_v.tensor[bs], act_v.kind)
            acts = _act_gram(au, av, mode, x.dtype)  # [b, t, g, w]
            cots = torch.einsum("fdxbtgz,hdxbwgz->bdftghw", xu, y[:, :, :, bs])
            pieces.append(torch.einsum("bdftghw,btgw->bdfh", cots, acts))
    if mode == "free":
        return torch.cat(pieces, dim=2).unsqueeze(0)  # [1, D, F1, B1, F2, B2]
    out = torch.cat(pieces, dim=0)[:, :, :, None, :, None]  # [B, D, F1, 1, F2, 1]
    return out if mode == "diagonal" else out.sum(0, keepdim=True)


def _one_position(factors: UseFactors) -> bool:
    """A weight use without positions or groups and with a dense activation (an MLP layer)."""
    act, cot = _split(factors)
    return act.kind == "act" and cot.tensor.shape[2] == 1 and cot.tensor.shape[3] == 1


@dataclass
class _TapTerms:
    """The one-position terms of a pair of taps: ``cot Gram ⊙ (Σ act Grams + biases)``."""

    cot1: Tensor
    cot2: Tensor
    acts: Tensor | None = None
    biases: int = 0


def contract(left: Side, right: Side | None, spec: PairSpec, dtype: torch.dtype,
             act_grams: dict[tuple[int, int], Tensor] | None = None) -> Tensor:
    """The kernel block between two sides (``None``: ``left`` with itself), canonical layout.

    One-position uses (linear layers on vectors, their biases) are grouped by the pair of
    taps they read their cotangents from: each pair costs one cotangent Gram, multiplied by
    the sum of its weight uses' activation Grams plus one per bias (NOTE above).
    ``act_grams`` keeps those activation Grams between calls on the same activations (the
    chunks of a streamed side).
    """
    symmetric = right is None
    other = left if right is None else right
    shape1, shape2 = left.row_shape, other.row_shape
    mode = spec.batch_mode
    taps: dict[Any, _TapTerms] = {}
    blocks: list[Tensor] = []

    def tap_terms(key: Any, cot1: Tensor, cot2: Tensor) -> _TapTerms:
        terms = taps.get(key)
        if terms is None:
            terms = taps[key] = _TapTerms(cot1.reshape(cot1.shape[0], cot1.shape[1], -1),
                                          cot2.reshape(cot2.shape[0], cot2.shape[1], -1))
        return terms

    for leaf, way in left.ways.items():
        if way == "unused" or other.ways.get(leaf) == "unused":
            continue
        if leaf in left.factors and leaf in other.factors:
            # NOTE [centered positions]: each use once (one-position uses are kept as they are)
            uses1 = [centered(u, 0)[0] for _, u in left.factors[leaf]]
            uses2 = uses1 if symmetric else [centered(v, 0)[0] for _, v in other.factors[leaf]]
            for i, u in enumerate(uses1):
                for j, v in enumerate(uses2):
                    if _one_position(u) and _one_position(v):
                        act_u, cot_u = _split(u)
                        act_v, cot_v = _split(v)
                        terms = tap_terms((cot_u.key, cot_v.key), cot_u.tensor, cot_v.tensor)
                        pair = (id(act_u.tensor), id(act_v.tensor))
                        act = None if act_grams is None else act_grams.get(pair)
                        if act is None:
                            a_u = act_u.tensor.reshape(act_u.tensor.shape[0], -1)
                            a_v = act_v.tensor.reshape(act_v.tensor.shape[0], -1)
                            act = a_u @ a_v.T if mode == "free" else (a_u * a_v).sum(-1)
                            if act_grams is not None:
                                act_grams[pair] = act
                        terms.acts = act if terms.acts is None else terms.acts + act
                        continue
                    if symmetric and j < i:
                        continue
                    block = ghost_pair(u, v, spec, shape1, shape2, dtype)
                    if symmetric and j > i:
                        block = block + mirror(block)
                    blocks.append(block)
            continue
        key1, key2 = left.bias_taps.get(leaf), other.bias_taps.get(leaf)
        if key1 is not None and key2 is not None:
            tap_terms((key1, key2), left.jacobians[leaf], other.jacobians[leaf]).biases += 1
            continue
        jac1 = left.jacobian(leaf)
        jac2 = jac1 if symmetric else other.jacobian(leaf)
        if jac1 is None or jac2 is None:
            continue
        blocks.append(spec_gram(jac1, None if symmetric else jac2, spec, shape1, shape2))
    pair_spec = spec if mode != "trace" else dataclasses.replace(
        spec, modes=_diagonal_batch(spec))
    for terms in taps.values():
        same = symmetric and terms.cot1 is terms.cot2
        gram = spec_gram(terms.cot1, None if same else terms.cot2, pair_spec, shape1, shape2)
        weight: Tensor | float = float(terms.biases)
        if terms.acts is not None:
            weight = terms.acts + terms.biases if terms.biases else terms.acts
            weight = (weight[None, None, None, :, None, :] if mode == "free"
                      else weight[:, None, None, None, None, None])
        block = gram * weight
        blocks.append(block.sum(0, keepdim=True) if mode == "trace" else block)
    if not blocks:
        raise _NoBlock
    total = blocks[0].to(dtype)
    for block in blocks[1:]:
        total = total + block.to(dtype)
    return total


class _NoBlock(Exception):
    """No leaf contributed (``f`` does not depend on its parameters): a zero block."""


# NOTE [streamed cross kernels]
# A kernel between a small x1 and a large x2 spends its time in x2's backwards: one per row
# direction, each covering every sample of x2 (B2 × width per tap). Run as one vectorized
# backward over all directions, every intermediate is R2 times that size (tens of MB for an
# MLP on 512 inputs, gigabytes for 10⁴): each op streams it through memory, and each freshly
# allocated buffer costs the page faults of its first touch. So where the rows are one axis
# (logits), x2's backwards run a few directions at a time (at most STREAM_PASS_BYTES of tap
# cotangents per backward), and each chunk's pieces are contracted with x1's at once and
# dropped: rows of a free axis fill their columns of the block, traced or diagonal rows meet
# the same rows of x1 (summed, or in their slot). Nothing of x2 is kept but one chunk (the
# larger side is the streamed one: with x1 the larger, the sides swap and the block is
# mirrored). On the benchmark's MLP (16 × 512 inputs, traced logits), 16 MB chunks were
# about 6% faster than one backward, smaller ones slower (a chunk costs a contraction's
# Python); the peak memory of x2's pieces drops from all its rows to one chunk.
STREAM_PASS_BYTES = 2**24
"""Bytes of tap cotangents per backward of a streamed side (NOTE [streamed cross kernels])."""


def _streamed_block(left: Side, right_problem: Problem, spec: PairSpec, dtype: torch.dtype,
                    shape: tuple[int, ...]) -> Tensor | None:
    """The block between ``left`` and ``right_problem`` with the right side streamed.

    ``None`` where streaming does not apply (rows of more than one axis, no per-sample
    structure): the caller computes the side. Raises ``NotPerSample`` where the samples
    interact (before any chunk is contracted).
    """
    if (right_problem.batch is None or right_problem.loops_only or len(left.row_shape) != 1
            or len(row_shape(right_problem)) != 1):
        return None
    with torch.enable_grad():
        _, chunks = _side_chunks(right_problem, left.ways, whole_batch=False,
                                 pass_bytes=STREAM_PASS_BYTES)
        mode = spec.row_modes[0]
        block = torch.zeros(shape, dtype=dtype, device=right_problem.output.device)
        act_grams: dict[tuple[int, int], Tensor] = {}
        for start, stop, part in chunks:
            rows = left if mode == "free" else _take_rows(left, start, stop)
            try:
                piece = contract(rows, part, spec, dtype, act_grams)
            except _NoBlock:
                continue
            if mode == "free":
                block[:, :, :, :, start:stop] = piece
            elif mode == "diagonal":
                block[:, start:stop] = piece
            else:
                block += piece
            del part, piece
    return block


def _take_rows(side: Side, start: int, stop: int) -> Side:
    """``side`` restricted to its rows ``start:stop`` (one row axis)."""
    rows = slice(start, stop)
    factors = {leaf: [(use, UseFactors(*(Factor(f.tensor[rows], f.kind, f.key)
                                         if f.kind == "cot" else f
                                         for f in (pair.first, pair.second))))
                      for use, pair in kept] for leaf, kept in side.factors.items()}
    return dataclasses.replace(side, row_shape=(stop - start,), factors=factors,
                               jacobians={leaf: jac[rows] for leaf, jac in side.jacobians.items()},
                               bias_taps=dict(side.bias_taps))


@register_cross("structured")
def structured_cross(problem: CrossProblem) -> CrossResult:
    """The structured backend's kernel blocks (NOTE [structured cross kernels])."""
    with checked_conventions(problem.left, "structured", write_out=False):
        result, redone = run_with_fallbacks(problem.left, lambda left, redo: _structured_cross(
            problem if left is problem.left else _with_row_loops(problem, left)))
    if redone is not None:
        result.report.notes.append(redone_note(redone))
    return result


def _with_row_loops(problem: CrossProblem, left: Problem) -> CrossProblem:
    """Both sides with one row per backward (NOTE [batched backwards that fail])."""
    return dataclasses.replace(problem, left=left, rights=tuple(
        None if side is None else with_row_loops(side) for side in problem.rights))


def _structured_cross(problem: CrossProblem) -> CrossResult:
    right_problem = problem.rights[0]
    if (len(problem.rights) == 1 and right_problem is not None and problem.left.batch is not None
            and right_problem.batch is not None
            and problem.left.samples > right_problem.samples):
        # the larger side is the streamed one (NOTE [streamed cross kernels]): swap, mirror
        swapped = _structured_cross(dataclasses.replace(problem, left=right_problem,
                                                        rights=(problem.left,)))
        return CrossResult((mirror(swapped.blocks[0]),), swapped.report)
    require_no_transforms(problem.left, "structured")
    for side in (problem.left, *problem.rights):
        if side is not None:  # (None: the left side again)
            require_no_forward_tangents(side, "structured")
    spec = problem.spec
    dtype = problem.left.compute_dtype
    left = compute_side(problem.left)
    report = RunReport("structured", left.kind, leaf_ways=tuple(
        left.ways[i] for i in range(len(problem.left.leaves))))
    report.notes.extend(left.notes)
    blocks = []
    for index, right_problem in enumerate(problem.rights):
        streamed, coupled = None, None
        if right_problem is not None:
            try:
                streamed = _streamed_block(left, right_problem, spec, dtype,
                                           problem.block_shape(index))
            except NotPerSample as why:  # the side's rows are the whole batch's
                coupled = why
        if streamed is not None:
            blocks.append(streamed)
            problem.done()
            continue
        right = None if right_problem is None else compute_side(right_problem, left.ways,
                                                                coupled=coupled)
        if right is not None:
            report.notes.extend(note for note in right.notes if note not in report.notes)
        try:
            block = contract(left, right, spec, dtype)
        except _NoBlock:
            block = torch.zeros(problem.block_shape(index), dtype=dtype,
                                device=problem.left.output.device)
        blocks.append(block)
        del right
        problem.done()
    return CrossResult(tuple(blocks), report)
