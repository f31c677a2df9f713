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

import torch
from torch import Tensor

from torchgram._core import _torch_compat
from torchgram._core.composition import require_no_forward_tangents, require_no_transforms
from torchgram._core.errors import (
    NotPerSample,
    OutputChanged,
    selective_checkpoint_refused,
    self_differentiation_refused,
)
from torchgram._core.problem import Problem
from torchgram._core.progress import Progress
from torchgram._core.result import BackendResult, Pullback, RowOrder, RunReport
from torchgram._core.sink import LeafBlocks, backend_index
from torchgram.backends._embedding import checked_conventions
from torchgram.backends._registry import register
from torchgram.backends.structured.contraction import Contraction, to_row_major
from torchgram.backends.structured.cost import Force
from torchgram.backends.structured.passes import (
    Forward,
    backward_chunks,
    dense_forward,
    raise_hooked,
    redone_note,
    rows_per_pass,
    run_with_fallbacks,
)
from torchgram.backends.structured.per_sample import per_sample_forward_checked, refused_per_sample
from torchgram.backends.structured.plan import StructuredPlan, plan_problem, run_uses
from torchgram.backends.structured.stream import can_stream, streamed_backward


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
    require_no_forward_tangents(problem, "structured")
    if problem.differentiates is not None:  # NOTE [f that differentiates itself]
        if problem.probe_cached:  # a cached probe's word: f may have stopped since (a flag
            raise OutputChanged("f differentiated itself when probed: probe afresh")  # off)
        raise self_differentiation_refused(problem.api, "structured", problem.differentiates)
    # NOTE [embedding conventions]: the taps write lookups out; checked after the run
    try:
        with checked_conventions(problem, "structured", write_out=False):
            result, redone = run_with_fallbacks(problem, lambda problem, redo: _run_structured(
                problem, None if redo else plan, None if redo else forward, force))
    except RuntimeError as error:  # its dense rows go back through f's graph once per chunk
        if not _torch_compat.is_selective_checkpoint_error(error):
            raise
        raise selective_checkpoint_refused(problem.api, "structured", ()) from error
    if redone is not None:
        result.report.notes.append(redone_note(redone))
    return result


def _run_structured(problem: Problem, plan: StructuredPlan | None, forward: Forward | None,
                    force: Force | None) -> BackendResult:
    with torch.enable_grad():
        if problem.batch is None:
            return _dense(problem, plan, forward, force)
        if plan is not None and plan.dense and force is None:
            # auto planned the rows of the whole batch: samples interact, or f fails alone
            # (its tapped forward reused where the planning ran one: NOTE [dense rows
            # planned once] in auto.py)
            result = _dense(problem, plan, forward, force)
            coupling = plan.recording.coupling
            refused = refused_per_sample(plan.recording)  # NOTE [refused per-sample passes]
            why = (f"f calls {coupling[0]}: its samples interact" if coupling
                   else "f draws random numbers (dropout, ...) and a leaf needs the per-sample "
                   "fallback" if problem.draw.random else refused if refused is not None
                   else "f fails on a batch of one")
            result.report.notes.append(f"per-sample passes do not hold ({why}): rows of the "
                                       "whole batch instead")
            return result
        try:
            forward, plan = per_sample_forward_checked(problem, plan, force)
        except NotPerSample as why:  # NOTE [per-sample]: the same matrix from the whole batch
            result = _dense(problem, None, None, force)
            result.report.notes.append(f"per-sample passes do not hold ({why.reason}): rows of "
                                       "the whole batch instead")
            return result
        return _contract(problem, forward, plan, _row_major_rows(problem, forward),
                         "row_major")


def _dense(problem: Problem, plan: StructuredPlan | None, forward: Forward | None,
           force: Force | None) -> BackendResult:
    """One tapped forward of the whole batch; its ``m`` rows as ``R = m`` rows of one sample."""
    forward = dense_forward(problem) if forward is None else forward
    if plan is None or force is not None or plan.recording is not forward.recording:
        plan = plan_problem(problem, forward.recording, force=force, dense=True)
    return _contract(problem, forward, plan, forward.detached_rows().reshape(-1), "output")


def _row_major_rows(problem: Problem, forward: Forward) -> Tensor:
    """The forward's output rows in the backend's ``(r, b)`` order."""
    rows = forward.detached_rows()
    if forward.kind != "batched":  # [B, R], sample-major
        return rows.reshape(problem.samples, -1).T.reshape(-1)
    index = backend_index(problem, "row_major")  # rows are in the output's order
    return rows if index is None else rows[index]


def _contract(problem: Problem, forward: Forward, plan: StructuredPlan, rows: Tensor,
              order: RowOrder) -> BackendResult:
    samples, rows_per_sample = forward.samples, forward.rows_per_sample
    report = RunReport("structured", forward.kind,
                       leaf_ways=tuple(leaf.way for leaf in plan.leaves))
    contraction = Contraction(plan.leaves, run_uses(plan.leaves, forward.recording),
                              [leaf.numel() for leaf in problem.leaves], samples,
                              rows_per_sample, problem.diagonal, keep=problem.want_pullback,
                              dtype=problem.compute_dtype, consume=True)
    contraction.set_acts(forward.take_acts())  # the contraction lets them go when done
    per_pass = rows_per_pass(problem, forward)
    create_graph = problem.composition.create_graph
    if contraction.consume and can_stream(forward, create_graph=create_graph):
        raise_hooked(forward.recording, streamed=True)  # NOTE [hooks on taps]
        contraction.start_stream(len(forward.taps[0]), forward.carrier_leaves)
        carrier_grads = streamed_backward(forward, contraction.add_tap)  # NOTE [streamed taps]
        report.row_chunks.append((rows_per_sample, contraction.streamed_bytes + sum(
            t.numel() * t.element_size() for t in carrier_grads.values())))
        contraction.finish_stream(carrier_grads)
        return _result(problem, forward, contraction, report, rows, order)
    with Progress(problem.options.progress, -(-rows_per_sample // per_pass),
                  "structured row chunks") as bar:
        for start, stop, tap_cots, carrier_grads in backward_chunks(
                forward, per_pass, vectorize=not problem.loops_only,
                create_graph=create_graph):
            report.row_chunks.append((stop - start, sum(
                t.numel() * t.element_size() for t in [*tap_cots, *carrier_grads.values()]
                if t is not None)))
            contraction.add_rows(start, stop, tap_cots, carrier_grads)
            del tap_cots, carrier_grads
            bar.update()
    return _result(problem, forward, contraction, report, rows, order)


def _result(problem: Problem, forward: Forward, contraction: Contraction, report: RunReport,
            rows: Tensor, order: RowOrder) -> BackendResult:
    """The contraction's blocks (and pullback) as the backend's result."""
    samples, rows_per_sample = forward.samples, forward.rows_per_sample
    blocks = LeafBlocks.for_problem(problem)
    for leaf, block in contraction.blocks(problem.compute_dtype):
        blocks.add(leaf, to_row_major(block, problem.diagonal))
    pullback = None
    if problem.want_pullback and contraction.complete:
        pullback = _pullback(problem, contraction, rows_per_sample, samples)
    return BackendResult(blocks.blocks(), report, row_order=order, aux=forward.aux,
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
