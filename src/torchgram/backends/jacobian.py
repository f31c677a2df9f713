"""``backend="jacobian"``: per-group Jacobian blocks in row chunks, Grammed and freed.

The reference path (DESIGN.md §2). For each group of leaves that fits the memory budget
(NOTE [memory budget] in ``_grouping``):

* dense rows: one ``torch.func.vjp`` forward, then the rows' vjps in chunks of
  ``chunk_size`` basis cotangents under ``vmap`` (``chunk_size=1``: a plain loop);
* per-sample rows (``batch_dim``): ``vmap`` over samples of ``jacrev`` of the function on
  one sample (a batch of one), i.e. ``B`` single-sample passes of ``K`` rows each instead of
  ``B·K`` full-batch passes. Rows come out sample by sample (``"sample_major"``).

With ``diagonal=True`` no block is assembled: each chunk's squared row norms are summed
and the chunk freed, so memory is one chunk of gradients.

The backend composes (NOTE [composition]): with leaves that are not detached, its
``torch.func`` products are differentiable by, and batchable under, the transforms around the
call and by eager autograd; blocks are then concatenated rather than written in place.
Blocks are assembled in the call's ``compute_dtype`` (mixed-dtype leaves: the widest).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from torchgram._core import functional
from torchgram._core.errors import BackendCannotRun, NotPerSample, OutputChanged
from torchgram._core.per_sample import batch_rows, check_samples, fails_alone
from torchgram._core.problem import Problem, TensorAux
from torchgram._core.progress import Progress
from torchgram._core.result import NO_AUX, BackendResult, Pullback, RowOrder, RunReport
from torchgram._core.sink import LeafBlocks
from torchgram.backends._draws_under_transforms import refuse_data_assignments, refuse_draws
from torchgram.backends._grouping import LeafGroup, group_leaves, rows_per_chunk
from torchgram.backends._registry import register
from torchgram.backends._vmap_or_loop import per_sample_or_batch


@register("jacobian")
def jacobian_backend(problem: Problem) -> BackendResult:
    """Compute the Gramian blocks of ``problem`` from explicit Jacobian blocks."""
    refuse_data_assignments(problem, "jacobian")  # NOTE [data assigned to itself]
    return per_sample_or_batch(
        problem, "jacobian", lambda loop, per_sample: _run(problem, loop, per_sample=per_sample))


def _run(problem: Problem, loop: bool, *, per_sample: bool) -> BackendResult:
    way = "per-sample" if per_sample else "rows of the batch"
    report = RunReport("jacobian", f"{way}, {'loops' if loop else 'vmap'}")
    blocks = LeafBlocks.for_problem(problem)
    groups = _groups(problem)
    keep_block = problem.want_pullback and len(groups) == 1 and not problem.diagonal
    order: RowOrder = "sample_major" if per_sample else "output"
    aux, rows, pullback = NO_AUX, None, None
    batch_outputs = None
    if per_sample:  # the batch's outputs, to check the samples run alone against
        batch_outputs, aux = batch_rows(problem)
    with Progress(problem.options.progress, 0, "jacobian row chunks") as bar:
        for group in groups:
            if batch_outputs is None:
                group_aux, group_rows, writer = _dense_group(problem, group, report, loop, bar)
                aux = group_aux if aux is NO_AUX else aux
            else:
                group_rows, writer = _per_sample_group(problem, group, report, loop,
                                                       batch_outputs, bar)
            rows = group_rows if rows is None else rows
            writer.flush(blocks)
            if keep_block:
                pullback = _block_pullback(problem, group, writer.block)
    return BackendResult(blocks.blocks(), report, row_order=order, aux=aux, rows=rows,
                         pullback=pullback)


def _block_pullback(problem: Problem, group: LeafGroup, block: Tensor) -> Pullback:
    """``w ↦ Jᵀ w`` from the assembled Jacobian: one matrix-vector product, no backward."""

    def pullback(weights: Tensor) -> tuple[Tensor, ...]:
        flat = block.T @ weights.to(block.dtype)
        grads = [torch.zeros(leaf.shape, dtype=leaf.dtype, device=leaf.device)
                 for leaf in problem.leaves]
        column = 0
        for piece in group.slices:  # one group: every piece is a whole leaf
            leaf = problem.leaves[piece.leaf]
            grads[piece.leaf] = flat[column:column + piece.width].reshape(leaf.shape).to(leaf.dtype)
            column += piece.width
        return tuple(grads)

    return pullback


def replace_leaves(leaves: Sequence[Tensor], indices: Sequence[int],
                   values: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """``leaves`` with ``leaves[indices[i]]`` replaced by ``values[i]``."""
    replaced = list(leaves)
    for index, value in zip(indices, values, strict=True):
        replaced[index] = value
    return tuple(replaced)


def _groups(problem: Problem) -> list[LeafGroup]:
    budget = None if problem.diagonal else problem.memory_budget
    return group_leaves([leaf.numel() for leaf in problem.leaves], problem.num_rows,
                        problem.itemsize, budget)


def _transient_width(problem: Problem, group: LeafGroup) -> int:
    return sum(problem.leaves[i].numel() for i in group.leaves)


class _BlockWriter:
    """Writes row chunks of a group's gradients into its block (or diagonal sums).

    When ``G`` must be differentiable (NOTE [composition]) the chunks are kept and
    concatenated at :meth:`flush` instead: ``vmap`` refuses in-place writes of batched values
    into a fresh buffer.
    """

    def __init__(self, problem: Problem, group: LeafGroup, report: RunReport) -> None:
        self.group = group
        self.diagonal = problem.diagonal
        self.report = report
        num_rows = problem.num_rows
        dtype = self.dtype = problem.compute_dtype
        device = problem.leaves[group.slices[0].leaf].device
        self.chunks: list[dict[int, Tensor]] | None = None
        if problem.composition.differentiable:
            self.chunks = []
            if not self.diagonal:
                report.jacobian_blocks.append((num_rows, group.width))
        elif self.diagonal:
            self.diagonals = {leaf: torch.zeros(num_rows, dtype=dtype, device=device)
                              for leaf in group.leaves}
        else:
            self.block = torch.zeros(num_rows, group.width, dtype=dtype, device=device)
            report.jacobian_blocks.append((num_rows, group.width))

    def write(self, rows: slice, grads: dict[int, Tensor]) -> None:
        """Store ``grads[leaf]`` (``[rows, numel]``) at ``rows`` for every slice of the group."""
        self.report.row_chunks.append((
            rows.stop - rows.start,
            sum(grad.numel() * grad.element_size() for grad in grads.values())))
        if self.chunks is not None:
            pieces = {}
            for piece in self.group.slices:
                values = grads[piece.leaf][:, piece.start:piece.stop].to(self.dtype)
                pieces[piece.leaf] = values.square().sum(dim=1) if self.diagonal else values
            self.chunks.append(pieces)
            return
        column = 0
        for piece in self.group.slices:
            values = grads[piece.leaf][:, piece.start:piece.stop].to(self.dtype)
            if self.diagonal:
                self.diagonals[piece.leaf][rows] += values.square().sum(dim=1)
            else:
                self.block[rows, column:column + piece.width] = values
            column += piece.width

    def flush(self, blocks: LeafBlocks) -> None:
        """Hand the group's contribution to the accumulator."""
        if self.chunks is not None:
            self._concatenate()
        if self.diagonal:
            for leaf, diagonal in self.diagonals.items():
                blocks.add(leaf, diagonal)
        else:
            blocks.add_jacobian([s.leaf for s in self.group.slices], self.block,
                                [s.width for s in self.group.slices])

    def rows_block(self) -> Tensor:
        """The group's block ``[rows, width]`` as written (the kept chunks joined, if any)."""
        if self.chunks is not None:
            self._concatenate()
        return self.block

    def _concatenate(self) -> None:
        """The kept row chunks as the block (or the diagonals), out of place."""
        assert self.chunks is not None
        columns = {piece.leaf: [chunk[piece.leaf] for chunk in self.chunks]
                   for piece in self.group.slices}
        self.chunks = None
        if self.diagonal:
            self.diagonals = {leaf: torch.cat(pieces) for leaf, pieces in columns.items()}
        else:
            self.block = torch.cat([torch.cat(columns[piece.leaf]) for piece in self.group.slices],
                                   dim=1)


def _dense_group(problem: Problem, group: LeafGroup, report: RunReport, loop: bool,
                 bar: Progress | None = None) -> tuple[object, Tensor, _BlockWriter]:
    leaf_ids = group.leaves
    aux_parts = TensorAux()

    def rows_of_group(*values: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        rows, aux = problem.rows(replace_leaves(problem.leaves, leaf_ids, values))
        return rows, aux_parts.split(aux)

    primals = [problem.leaves[i] for i in leaf_ids]
    rows, vjp_fn, aux_tensors = functional.vjp_with_aux(rows_of_group, *primals)
    refuse_draws(problem, "jacobian")  # NOTE [draws under torch.func]
    num_rows = rows.numel()
    chunk = 1 if loop else rows_per_chunk(problem.chunk_size, num_rows,
                                          _transient_width(problem, group), problem.itemsize,
                                          problem.memory_budget)
    writer = _BlockWriter(problem, group, report)
    if bar is not None:
        bar.extend(-(-num_rows // chunk))
    for start in range(0, num_rows, chunk):
        stop = min(start + chunk, num_rows)
        grads = row_vjps(vjp_fn, rows, start, stop)
        writer.write(slice(start, stop), {
            leaf: grad.reshape(stop - start, -1) for leaf, grad in zip(leaf_ids, grads, strict=True)
        })
        if bar is not None:
            bar.update()
    return aux_parts.join(aux_tensors), rows.detach(), writer


def basis_rows(start: int, stop: int, like: Tensor) -> Tensor:
    """Rows ``start..stop-1`` of the identity of size ``like.numel()`` (cotangents)."""
    count = stop - start
    basis = like.new_zeros(count, like.numel())
    basis[torch.arange(count), torch.arange(start, stop)] = 1
    return basis


def row_vjps(vjp_fn: Callable[..., tuple[Tensor, ...]], rows: Tensor, start: int,
             stop: int) -> tuple[Tensor, ...]:
    """``Jᵀ e_i`` for rows ``start..stop-1``, each leaf's result stacked on a leading dim."""
    basis = basis_rows(start, stop, rows)
    if stop - start == 1:
        return tuple(grad.unsqueeze(0) for grad in functional.with_grad(lambda: vjp_fn(basis[0])))
    return functional.with_grad(lambda: torch.func.vmap(vjp_fn)(basis))


def _per_sample_group(problem: Problem, group: LeafGroup, report: RunReport, loop: bool,
                      batch_outputs: Tensor,
                      bar: Progress | None = None) -> tuple[Tensor, _BlockWriter]:
    batch = problem.batch
    assert batch is not None
    leaf_ids = group.leaves
    num_leaves = len(leaf_ids)
    primals = tuple(problem.leaves[i] for i in leaf_ids)

    def sample_rows(*values: Tensor) -> Tensor:
        group_values, sample_inputs = values[:num_leaves], values[num_leaves:]
        return problem.sample_rows(replace_leaves(problem.leaves, leaf_ids, group_values),
                                   sample_inputs)

    rows_per_sample = problem.rows_per_sample
    chunk = rows_per_chunk(problem.chunk_size, problem.num_rows,
                           _transient_width(problem, group), problem.itemsize,
                           problem.memory_budget)
    samples_per_pass = max(1, chunk // max(rows_per_sample, 1))
    inner_chunk = chunk if chunk < rows_per_sample else None
    writer = _BlockWriter(problem, group, report)
    outputs = []
    if bar is not None:
        bar.extend(-(-batch.size // samples_per_pass))
    for first in range(0, batch.size, samples_per_pass):
        count = min(samples_per_pass, batch.size - first)
        inputs = batch.narrow(first, count)
        if loop:
            try:
                jacobians, sample_outputs = _sample_loop(sample_rows, primals, inputs,
                                                         batch.dims)
            except (BackendCannotRun, OutputChanged, NotPerSample):
                raise
            except Exception as error:  # the batch ran: f fails on a batch of one
                raise fails_alone(error) from error
        else:
            jacobians, sample_outputs = _sample_vmap(sample_rows, primals, inputs, batch.dims,
                                                     inner_chunk)
        check_samples(problem, sample_outputs, torch.arange(first, first + count),
                      batch_outputs)
        outputs.append(sample_outputs.detach().reshape(-1))
        rows = slice(first * rows_per_sample, (first + count) * rows_per_sample)
        writer.write(rows, {
            leaf: jac.reshape(count * rows_per_sample, -1)
            for leaf, jac in zip(leaf_ids, jacobians, strict=True)
        })
        if bar is not None:
            bar.update()
    return torch.cat(outputs), writer


def _sample_vmap(sample_rows: Callable[..., Tensor], primals: tuple[Tensor, ...],
                 inputs: tuple[Tensor, ...], dims: tuple[int, ...],
                 inner_chunk: int | None) -> tuple[tuple[Tensor, ...], Tensor]:
    """Per-sample Jacobians ``[count, K, *leaf.shape]`` by vmap over samples of jacrev.

    Also returns the samples' output rows ``[count, K]``, which come for free.
    """
    num_leaves = len(primals)

    def one_sample(*values: Tensor) -> tuple[Tensor, Tensor]:
        sample = tuple(x.unsqueeze(d) for x, d in zip(values[num_leaves:], dims, strict=True))
        rows = sample_rows(*values[:num_leaves], *sample)
        return rows, rows

    jac = torch.func.jacrev(one_sample, argnums=tuple(range(num_leaves)), has_aux=True,
                            chunk_size=inner_chunk)
    return functional.with_grad(  # NOTE [backward under no_grad]
        lambda: torch.func.vmap(jac, in_dims=(None,) * num_leaves + dims)(*primals, *inputs))


def _sample_loop(sample_rows: Callable[..., Tensor], primals: tuple[Tensor, ...],
                 inputs: tuple[Tensor, ...],
                 dims: tuple[int, ...]) -> tuple[tuple[Tensor, ...], Tensor]:
    """The same as :func:`_sample_vmap` with plain loops over samples and rows (no vmap)."""
    per_sample: list[tuple[Tensor, ...]] = []
    outputs: list[Tensor] = []
    count = inputs[0].shape[dims[0]]
    for b in range(count):
        sample = tuple(x.narrow(d, b, 1) for x, d in zip(inputs, dims, strict=True))
        rows, vjp_fn = functional.vjp(functools.partial(_append_inputs, sample_rows, sample),
                                      *primals)
        outputs.append(rows)
        grads = [row_vjps(vjp_fn, rows, k, k + 1) for k in range(rows.numel())]
        per_sample.append(tuple(
            torch.cat([g[i] for g in grads]) if grads else leaf.new_zeros(0, *leaf.shape)
            for i, leaf in enumerate(primals)
        ))
    jacobians = tuple(torch.stack([s[i] for s in per_sample]) for i in range(len(primals)))
    return jacobians, torch.stack(outputs)


def _append_inputs(fn: Callable[..., Tensor], inputs: tuple[Tensor, ...],
                   *values: Tensor) -> Tensor:
    return fn(*values, *inputs)
