"""Kernels between two input sets on the jacobian, ntvp, graph and auto backends.

NOTE [cross kernels] says what a :class:`~torchgram._core.cross.CrossProblem` asks for; the
structured backend's way is NOTE [structured cross kernels]. Here:

* **jacobian**: per group of leaves (``memory_budget``: ``(m1 + m2) × width`` entries per
  group), the per-row Jacobian block of each side, ``J1 [R1, B1, w]`` and ``J2``, then
  :func:`~torchgram._core.cross.spec_gram` (traced rows are contracted pair by pair, never
  all against all). Without a budget ``J1`` is computed once for every right side.
* **ntvp**: ``G12[:, i] = J1 (J2ᵀ e_i)``: the vjps of a chunk of side-2 rows (per sample
  with ``batch_dim``) pushed forward through ``f`` on side 1, never a Jacobian; then the
  spec's pairs of the ``[m1, m2]`` block. A self block is the backend's own Gramian.
* **graph**: walks the autograd graph of *one* forward: a self block is its Gramian,
  reduced; a block between two input sets, the off-diagonal block of the Gramian of both
  sets joined into one batch, where that batch is checked to compute each set's rows.
* **auto**: the candidates ``auto`` ranks for the left side's Gramian, in that order, moving
  on when one declares it cannot run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor

from torchgram._core import functional
from torchgram._core.census import refusing_gradient_hooks
from torchgram._core.composition import COMPOSING_BACKENDS
from torchgram._core.cross import (
    CrossProblem,
    CrossResult,
    row_shape,
    sample_rows_view,
    spec_gram,
    spec_reduce,
)
from torchgram._core.errors import (
    BackendCannotRun,
    DifferentiatesItself,
    NotPerSample,
    OutputChanged,
    ParameterConverted,
)
from torchgram._core.per_sample import batch_rows, check_samples, check_tiles
from torchgram._core.problem import Problem, build_problem, replace_input_leaves, same_beyond
from torchgram._core.pytree import PLAIN_VALUES
from torchgram._core.result import RunReport
from torchgram._core.sink import assemble
from torchgram._core.vmap_failures import failure_key, known_failure
from torchgram.backends import jacobian as jacobian_module
from torchgram.backends import ntvp as ntvp_module
from torchgram.backends._draws_under_transforms import refuse_data_assignments
from torchgram.backends._embedding import checked_conventions, collected_conventions
from torchgram.backends._grouping import LeafGroup, group_leaves, rows_per_chunk
from torchgram.backends._registry import (
    first_that_runs,
    get_backend,
    get_cross_backend,
    register_cross,
)
from torchgram.backends._vmap_or_loop import first_that_runs_ranked_again, vmap_or_loop

# -- jacobian ------------------------------------------------------------------------------


def _group_jacobian(problem: Problem, group: LeafGroup, report: RunReport,
                    loop: bool) -> Tensor:
    """The group's per-row Jacobian ``[R, B, width]`` of one side (per sample if it holds)."""
    if problem.batch is not None:
        try:
            batch_outputs, _ = batch_rows(problem)
            _, writer = jacobian_module._per_sample_group(problem, group, report, loop,
                                                          batch_outputs)
            return sample_rows_view(writer.rows_block(), problem, "sample_major")
        except NotPerSample as why:
            note = (f"per-sample evaluation does not hold ({why.reason}): rows of the whole "
                    "batch instead")
            if note not in report.notes:
                report.notes.append(note)
    _, _, writer = jacobian_module._dense_group(problem, group, report, loop)
    return sample_rows_view(writer.rows_block(), problem, "output")


def _with_loops(problem: CrossProblem, backend: str,
                run: Callable[[bool], CrossResult]) -> CrossResult:
    """``run(loop)`` vectorized, redone with loops if ``vmap`` fails (NOTE [vmap or loop]).

    The failure is remembered for the left side's call signature (NOTE [vmap failures
    remembered]).
    """
    loop = problem.left.loops_only or any(r is not None and r.loops_only for r in problem.rights)
    key = failure_key(problem.left, backend, problem.left.batch is not None)
    return vmap_or_loop(run, loop=loop, backend=backend, key=key)


@register_cross("jacobian")
def jacobian_cross(problem: CrossProblem) -> CrossResult:
    """Kernel blocks from per-row Jacobian blocks of both sides (module docstring)."""
    refuse_data_assignments(problem.left, "jacobian")  # NOTE [data assigned to itself]
    return _with_loops(problem, "jacobian", lambda loop: _jacobian_cross(problem, loop))


def _jacobian_cross(problem: CrossProblem, loop: bool) -> CrossResult:
    left, spec = problem.left, problem.spec
    report = RunReport("jacobian", "per-row Jacobian blocks of each side, "
                       f"{'loops' if loop else 'vmap'}")
    rows = left.num_rows + max((r.num_rows for r in problem.rights if r is not None), default=0)
    groups = group_leaves([leaf.numel() for leaf in left.leaves], rows, left.itemsize,
                          left.memory_budget)
    dtype = left.compute_dtype
    shape1 = row_shape(left)
    blocks: list[Tensor | None] = [None] * len(problem.rights)

    def add(index: int, block: Tensor) -> None:
        current = blocks[index]
        blocks[index] = block if current is None else current + block

    one_group = len(groups) <= 1
    for group in groups:
        jac1 = _group_jacobian(left, group, report, loop).to(dtype)
        for index, right in enumerate(problem.rights):
            if right is None:
                add(index, spec_gram(jac1, None, spec, shape1))
            else:
                jac2 = _group_jacobian(right, group, report, loop).to(dtype)
                add(index, spec_gram(jac1, jac2, spec, shape1, row_shape(right)))
                del jac2
            if one_group:
                problem.done()
        del jac1
    if not one_group:
        for _ in problem.rights:
            problem.done()
    device = left.output.device
    return CrossResult(tuple(
        torch.zeros(problem.block_shape(i), dtype=dtype, device=device) if block is None
        else block for i, block in enumerate(blocks)), report)


# -- ntvp ------------------------------------------------------------------------------------


def _full_self_block(problem: Problem, name: str) -> tuple[Tensor, RunReport]:
    """A backend's Gramian of one side as ``[R, B, R, B]`` (from the sink's output order)."""
    result = get_backend(name)(problem)
    blocks = assemble(problem, result)
    gram = blocks[0] if len(blocks) == 1 else torch.stack(blocks).sum(0)
    return _pairs(gram, problem, problem), result.report


def _pairs(gram: Tensor, left: Problem, right: Problem) -> Tensor:
    """An ``[m1, m2]`` block (output orders) as ``[R1, B1, R2, B2]``."""
    m1, m2 = gram.shape
    rows = sample_rows_view(gram, left, "output")  # [R1, B1, m2]
    r1, b1 = rows.shape[:2]
    columns = sample_rows_view(rows.reshape(r1 * b1, m2).T, right, "output")  # [R2, B2, R1 B1]
    r2, b2 = columns.shape[:2]
    return columns.reshape(r2, b2, r1, b1).permute(2, 3, 0, 1)


@register_cross("ntvp")
def ntvp_cross(problem: CrossProblem) -> CrossResult:
    """Kernel blocks as ``J1 (J2ᵀ e_i)``, side 2's vjps pushed through side 1 (module docstring)."""
    refuse_data_assignments(problem.left, "ntvp")  # NOTE [data assigned to itself]
    ntvp_module._prepare_forward_ad(problem.left.api)
    # NOTE [gradient hooks inside f], NOTE [embedding conventions]
    with refusing_gradient_hooks(problem.left.api, "ntvp"), \
            checked_conventions(problem.left, "ntvp", write_out=True):
        return _with_loops(problem, "ntvp", lambda loop: _ntvp_cross(problem, loop))


def _ntvp_cross(problem: CrossProblem, loop: bool) -> CrossResult:
    left, spec = problem.left, problem.spec
    report = RunReport("ntvp", "side 2's vjps pushed through side 1, "
                       f"{'loops' if loop else 'vmap'}")
    dtype = left.compute_dtype
    shape1 = row_shape(left)
    blocks = []
    for right in problem.rights:
        if right is None:
            gram, self_report = _full_self_block(left, "ntvp")
            report.notes.extend(self_report.notes)
            blocks.append(spec_reduce(gram.to(dtype), spec, shape1))
        else:
            gram = _ntvp_block(left, right, report, loop).to(dtype)  # [m1, m2]
            blocks.append(spec_reduce(_pairs(gram, left, right), spec, shape1,
                                      row_shape(right)))
        problem.done()
    return CrossResult(tuple(blocks), report)


def _ntvp_block(left: Problem, right: Problem, report: RunReport, loop: bool) -> Tensor:
    """``[m1, m2]``: column ``i`` is ``J1 (J2ᵀ e_i)`` (both in output order).

    The columns are computed in chunks and joined out of place (no writes into a buffer), so
    the block is differentiable and batchable where the call is (NOTE [composition]).
    """
    m2 = right.num_rows
    width = sum(leaf.numel() for leaf in right.leaves)
    chunk = 1 if loop else rows_per_chunk(right.chunk_size, m2, width, right.itemsize,
                                          right.memory_budget)
    dtype = left.compute_dtype
    columns: list[Tensor] = []  # [count, m1] each
    rows_of_columns: list[Tensor] = []  # the output rows of side 2 they belong to

    def push(tangents: tuple[Tensor, ...]) -> Tensor:
        report.row_chunks.append((tangents[0].shape[0], sum(
            t.numel() * t.element_size() for t in tangents)))
        return ntvp_module._push_forward(left, lambda *ls: left.rows(ls)[0], left.leaves,
                                         tangents).to(dtype)

    if right.batch is not None:
        try:
            batch_outputs, _ = batch_rows(right)
            index = right.sample_major_index
            for first, count, k0, k1 in ntvp_module._sample_chunks(
                    right.samples, right.rows_per_sample, chunk):
                vjps, outputs = ntvp_module._sample_vjps(right, right.batch.narrow(first, count),
                                                         k0, k1, loop)
                check_samples(right, outputs, torch.arange(first, first + count), batch_outputs)
                rows_of_columns.append(index[first:first + count, k0:k1].reshape(-1))
                columns.append(push(vjps))
            order = torch.argsort(torch.cat(rows_of_columns))
            block = torch.cat(columns)[order].T
            # NOTE [non-finite pushes]: forward mode's NaN at a zero the backward selects
            ntvp_module.refuse_forward_mode_non_finite([block], left, right)
            return block
        except NotPerSample as why:
            report.notes.append(f"per-sample evaluation does not hold ({why.reason}): rows of "
                                "the whole batch instead")
            columns.clear()
    rows, vjp_fn = functional.vjp(lambda *ls: right.rows(ls)[0], *right.leaves)
    for start in range(0, m2, chunk):
        stop = min(start + chunk, m2)
        columns.append(push(jacobian_module.row_vjps(vjp_fn, rows, start, stop)))
    block = torch.cat(columns).T
    ntvp_module.refuse_forward_mode_non_finite([block], left, right)
    return block


# -- graph -----------------------------------------------------------------------------------


@register_cross("graph")
def graph_cross(problem: CrossProblem) -> CrossResult:
    """Self blocks from the graph backend's Gramian; a cross block from the joined batch's.

    The graph walk differentiates *one* forward: a block between two input sets is the
    off-diagonal block of the Gramian of ``f`` on both sets joined into one batch, used only
    where that batch's rows and derivatives are each set's own (:func:`_joined`). It costs
    ``(B1 + B2)²`` pairs for ``B1 · B2``: the way for an ``f`` no other backend can run (one
    that differentiates itself: NOTE [f that differentiates itself]).
    """
    left = problem.left
    self_gram: Tensor | None = None
    report = None
    blocks = []
    for right in problem.rights:
        if right is None:
            if self_gram is None:
                self_gram, report = _full_self_block(left, "graph")
            block = spec_reduce(self_gram.to(left.compute_dtype), problem.spec, row_shape(left))
        else:
            joint = _joined(left, right)
            gram, report = _full_self_block(joint, "graph")
            first = left.samples
            block = spec_reduce(gram[:, :first, :, first:].to(left.compute_dtype),
                                problem.spec, row_shape(left), row_shape(right))
            report.notes.append("a kernel between two input sets: the off-diagonal block of "
                                "the Gramian of both sets joined into one batch")
        blocks.append(block)
        problem.done()
    assert report is not None
    return CrossResult(tuple(blocks), report)


def _joined(left: Problem, right: Problem) -> Problem:
    """The call of ``f`` on ``left``'s and ``right``'s samples joined into one batch.

    Raises :class:`BackendCannotRun` unless both calls differ only in their batched inputs
    and the joined batch computes each side's rows with each side's derivatives (NOTE
    [per-sample]: samples that interact, or random draws, would not).
    """
    def cannot(why: str, fix: str = "") -> BackendCannotRun:
        return BackendCannotRun(
            left.api, "graph", "one input set, or two whose samples joined into one batch "
            "compute what each set computes alone (it walks the autograd graph of one "
            "forward)", f"a kernel between two input sets (x2) {why}",
            ("jacobian", "ntvp") if left.differentiates is not None  # NOTE [f that
            else ("structured", "jacobian", "ntvp"), fix)  # differentiates itself]

    batch1, batch2 = left.batch, right.batch
    if batch1 is None or batch2 is None:
        raise cannot("without a batch axis to join them along (vmap_axes=None)",
                     "Or pass vmap_axes (the inputs' sample axis) where the samples are "
                     "independent.")
    if batch1.positions != batch2.positions or batch1.dims != batch2.dims:
        raise cannot("whose batched inputs differ in structure")
    as_left = replace_input_leaves(right.args, right.kwargs, batch2.positions, batch1.tensors)
    both: Any = (as_left, (left.args, dict(left.kwargs)))
    others: list[Any] = optree.tree_leaves(both, none_is_leaf=True)
    half = len(others) // 2
    # plain values compared by value; anything else must be the same object on both sides
    if len(others) % 2 or any(not (a is b or (type(a) in PLAIN_VALUES and type(a) is type(b)
                                              and a == b))
                              for a, b in zip(others[:half], others[half:], strict=True)):
        raise cannot("with other arguments than their batched inputs")
    for t1, t2, dim in zip(batch1.tensors, batch2.tensors, batch1.dims, strict=True):
        if not same_beyond(t1.shape, t2.shape, dim):
            raise cannot(f"whose batched inputs differ in shape beyond the batch axis "
                         f"({tuple(t1.shape)} and {tuple(t2.shape)}): they cannot be joined")
    joined = tuple(torch.cat([t1, t2], dim) for t1, t2, dim
                   in zip(batch1.tensors, batch2.tensors, batch1.dims, strict=True))
    args, kwargs = replace_input_leaves(left.args, left.kwargs, batch1.positions, joined)
    try:
        joint = build_problem(left.options, left.f, args, kwargs, fresh=True,  # never stale
                              generators=left.draw.generators)
        check_tiles(joint, (left, right), eager=True)  # the graph walk's own autograd
    except NotPerSample as why:
        raise cannot(f"whose joined batch does not compute each set's rows ({why.reason})") \
            from why
    except (OutputChanged, BackendCannotRun):
        raise
    except Exception as error:  # noqa: BLE001 -- f fails on the joined batch, or without grad
        raise cannot(f"whose joined batch could not be checked ({type(error).__name__}: "
                     f"{str(error)[:100]})") from error
    return joint


# -- auto ------------------------------------------------------------------------------------

SELF_DIFFERENTIATING = ("graph", "jacobian", "ntvp")
"""``auto``'s order for an ``f`` that differentiates itself, which the structured backend
declines (NOTE [f that differentiates itself]): the graph walk first (exact at any order,
self blocks only), then the backends whose transforms may nest with ``f``'s own."""


def _auto_order(problem: Problem) -> tuple[str, ...]:
    """``plan_auto(problem).order``, kept with the structured plan it derives from."""
    from torchgram.backends.auto import estimate_backends, plan_auto, ranked, with_last_resort
    from torchgram.backends.structured import plan_problem

    if problem.differentiates is not None:  # NOTE [f that differentiates itself]: no trace
        return SELF_DIFFERENTIATING
    if problem.forward_tangents:  # NOTE [composition]: nor for forward-mode tangents
        return SELF_DIFFERENTIATING
    try:
        try:
            plan = plan_problem(problem, dead_positions=False)  # NOTE [dead positions]
        except NotPerSample:  # f fails on a batch of one: planned on the whole batch's rows
            return plan_auto(problem).order
    except (DifferentiatesItself, ParameterConverted, BackendCannotRun):  # only with a graph
        # (a penalty f guards by grad mode); a parameter f converts (module.to(dtype) in a
        # forward); the whole batch's plan declined (the same, sparse tensors)
        return SELF_DIFFERENTIATING
    failed = tuple(known_failure(problem, name) is not None  # NOTE [vmap failures remembered]:
                   for name in ("jacobian", "ntvp", "structured"))  # the loops' cost counted
    key = ("auto order", plan.sizes, problem.chunk_size, problem.memory_budget,
           problem.batch is None, tuple(leaf.numel() for leaf in problem.leaves), failed,
           plan.recording.not_batched)
    order = plan.recording.plans.get(key)
    if order is None:
        order = plan.recording.plans[key] = with_last_resort(
            ranked(estimate_backends(problem, plan)))
    assert isinstance(order, tuple)
    return order


@register_cross("auto")
def auto_cross(problem: CrossProblem) -> CrossResult:
    """``auto``'s candidates for the left side's Gramian, in order, until one can.

    Inside ``torch.func`` transforms nothing is traced (NOTE [composition]): the backends
    that compose, in their order.
    """
    def run(name: str) -> CrossResult:
        return get_cross_backend(name)(problem)

    if problem.left.composition.transforms:
        return first_that_runs(COMPOSING_BACKENDS, run)

    with collected_conventions():  # over the planning too (NOTE [embedding conventions])
        attempts: list[tuple[str, str]] = []
        return first_that_runs_ranked_again(lambda failures: _cross_order(problem, attempts),
                                            run, attempts)


def _cross_order(problem: CrossProblem, attempts: list[tuple[str, str]]) -> tuple[str, ...]:
    """``auto``'s candidates for a kernel, without those that declined already."""
    order = _auto_order(problem.left)
    # what the gradient-free probe could not see (a hook or a penalty f guards by grad
    # mode) may decline every planned candidate: the others are tried before giving up
    # (they declined before session 59, where tg.gramian's auto answered)
    declined = {name for name, _ in attempts}
    return tuple(name for name in (*order, *(name for name in _EVERY_CROSS if name not in order))
                 if name not in declined)


_EVERY_CROSS = ("jacobian", "graph", "ntvp", "structured")
