"""``backend="jacobian"``: per-group Jacobian blocks in row chunks, Grammed and freed.

The reference path (DESIGN.md §2). For each group of leaves that fits the memory budget
(NOTE [memory budget] in ``_grouping``):

* dense rows: one ``torch.func.vjp`` forward, then the rows' vjps in chunks of
  ``chunk_size`` basis cotangents under ``vmap`` (``chunk_size=1``: a plain loop);
* per-sample rows (``batch_dim``): ``vmap`` over samples of ``jacrev`` of the function on
  one sample (a batch of one), i.e. ``B`` single-sample passes of ``K`` rows each instead of
  ``B·K`` full-batch passes. Rows are scattered to their place among the output's rows.

With ``diagonal=True`` no block is assembled: each chunk's squared row norms are summed
and the chunk freed, so memory is one chunk of gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from torchgram._problem import GramianProblem
from torchgram.backends._grouping import LeafGroup, group_leaves, rows_per_chunk
from torchgram.backends._registry import NO_AUX, register
from torchgram.backends._sink import GramSink


@register("jacobian")
def jacobian_backend(problem: GramianProblem, sink: GramSink) -> Any:
    """Compute the Gramian blocks of ``problem`` from explicit Jacobian blocks."""
    aux = NO_AUX
    needs_shapes = problem.memory_budget is not None and not problem.diagonal
    if problem.batch is not None and problem.chunk_size is not None:
        needs_shapes = True  # the samples per pass depend on the rows per sample
    if needs_shapes:
        aux = problem.probe()
    groups = _groups(problem)
    keep_block = problem.keep_pullback and len(groups) == 1 and not problem.diagonal
    for group in groups:
        if problem.batch is None:
            group_aux, writer = _dense_group(problem, sink, group)
            aux = group_aux if aux is NO_AUX else aux
        else:
            writer = _per_sample_group(problem, sink, group)
        if keep_block and writer is not None:
            problem.pullback = _block_pullback(problem, group, writer.block)
    return aux


def _block_pullback(problem: GramianProblem, group: LeafGroup,
                    block: Tensor) -> Callable[[Tensor], tuple[Tensor, ...]]:
    """``w ↦ Jᵀ w`` from the assembled Jacobian: one matrix-vector product, no backward."""

    def pullback(weights: Tensor) -> tuple[Tensor, ...]:
        flat = block.T @ weights.to(block.dtype)
        grads = [torch.zeros(leaf.shape, dtype=leaf.dtype, device=leaf.device)
                 for leaf in problem.leaves]
        column = 0
        for piece in group.slices:
            grads[piece.leaf].view(-1)[piece.start:piece.stop] = flat[column:column + piece.width]
            column += piece.width
        return tuple(grads)

    return pullback


def new_jacobian_block(num_rows: int, width: int, like: Tensor) -> Tensor:
    """Allocate one assembled Jacobian block (a separate function so tests can count them)."""
    return torch.zeros(num_rows, width, dtype=like.dtype, device=like.device)


def replace_leaves(leaves: Sequence[Tensor], indices: Sequence[int],
                   values: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """``leaves`` with ``leaves[indices[i]]`` replaced by ``values[i]``."""
    replaced = list(leaves)
    for index, value in zip(indices, values, strict=True):
        replaced[index] = value
    return tuple(replaced)


def _itemsize(problem: GramianProblem) -> int:
    return max(leaf.element_size() for leaf in problem.leaves)


def _groups(problem: GramianProblem) -> list[LeafGroup]:
    budget = None if problem.diagonal else problem.memory_budget
    num_rows = problem.output.num_rows if problem.output is not None else 0
    return group_leaves([leaf.numel() for leaf in problem.leaves], num_rows,
                        _itemsize(problem), budget)


def _transient_width(problem: GramianProblem, group: LeafGroup) -> int:
    return sum(problem.leaves[i].numel() for i in group.leaves)


class _BlockWriter:
    """Writes row chunks of a group's gradients into its block (or diagonal sums)."""

    def __init__(self, problem: GramianProblem, group: LeafGroup, num_rows: int) -> None:
        self.group = group
        self.diagonal = problem.diagonal
        like = problem.leaves[group.slices[0].leaf]
        if self.diagonal:
            self.diagonals = {leaf: like.new_zeros(num_rows) for leaf in group.leaves}
        else:
            self.block = new_jacobian_block(num_rows, group.width, like)

    def write(self, rows: slice | Tensor, grads: dict[int, Tensor]) -> None:
        """Store ``grads[leaf]`` (``[rows, numel]``) at ``rows`` for every slice of the group."""
        column = 0
        for piece in self.group.slices:
            values = grads[piece.leaf][:, piece.start:piece.stop]
            if self.diagonal:
                self.diagonals[piece.leaf][rows] += values.square().sum(dim=1)
            else:
                self.block[rows, column:column + piece.width] = values
            column += piece.width

    def flush(self, sink: GramSink) -> None:
        """Hand the group's contribution to the sink."""
        if self.diagonal:
            for leaf, diagonal in self.diagonals.items():
                sink.add(leaf, diagonal)
        else:
            sink.add_jacobian([s.leaf for s in self.group.slices], self.block,
                              [s.width for s in self.group.slices])


def _dense_group(problem: GramianProblem, sink: GramSink,
                 group: LeafGroup) -> tuple[Any, _BlockWriter]:
    leaf_ids = group.leaves

    def rows_of_group(*values: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        return problem.rows_with_tensor_aux(replace_leaves(problem.leaves, leaf_ids, values))

    primals = [problem.leaves[i] for i in leaf_ids]
    rows, vjp_fn, aux_tensors = torch.func.vjp(rows_of_group, *primals, has_aux=True)
    problem.output_rows = rows
    num_rows = rows.numel()
    chunk = rows_per_chunk(problem.chunk_size, num_rows, _transient_width(problem, group),
                           _itemsize(problem), problem.memory_budget)
    writer = _BlockWriter(problem, group, num_rows)
    for start in range(0, num_rows, chunk):
        stop = min(start + chunk, num_rows)
        grads = _row_vjps(vjp_fn, rows, start, stop)
        writer.write(slice(start, stop), {
            leaf: grad.reshape(stop - start, -1) for leaf, grad in zip(leaf_ids, grads, strict=True)
        })
    writer.flush(sink)
    return problem.restore_aux(aux_tensors), writer


def basis_rows(start: int, stop: int, like: Tensor) -> Tensor:
    """Rows ``start..stop-1`` of the identity of size ``like.numel()`` (cotangents)."""
    count = stop - start
    basis = like.new_zeros(count, like.numel())
    basis[torch.arange(count), torch.arange(start, stop)] = 1
    return basis


def _row_vjps(vjp_fn: Callable[..., tuple[Tensor, ...]], rows: Tensor, start: int,
              stop: int) -> tuple[Tensor, ...]:
    """``Jᵀ e_i`` for rows ``start..stop-1``, each leaf's result stacked on a leading dim."""
    basis = basis_rows(start, stop, rows)
    if stop - start == 1:
        return tuple(grad.unsqueeze(0) for grad in vjp_fn(basis[0]))
    return torch.func.vmap(vjp_fn)(basis)


def _per_sample_group(problem: GramianProblem, sink: GramSink,
                      group: LeafGroup) -> _BlockWriter | None:
    batch = problem.batch
    assert batch is not None
    leaf_ids = group.leaves
    num_leaves = len(leaf_ids)
    primals = tuple(problem.leaves[i] for i in leaf_ids)

    def sample_rows(*values: Tensor) -> Tensor:
        group_values, sample_inputs = values[:num_leaves], values[num_leaves:]
        return problem.sample_rows(replace_leaves(problem.leaves, leaf_ids, group_values),
                                   sample_inputs)

    samples_per_pass, inner_chunk = batch.size, None
    if problem.output is not None:  # shapes known: size the passes
        rows_per_sample = problem.output.num_rows // batch.size
        chunk = rows_per_chunk(problem.chunk_size, problem.output.num_rows,
                               _transient_width(problem, group), _itemsize(problem),
                               problem.memory_budget)
        samples_per_pass = max(1, chunk // max(rows_per_sample, 1))
        inner_chunk = chunk if chunk < rows_per_sample else None
    writer: _BlockWriter | None = None
    canonical: Tensor | None = None
    for first in range(0, batch.size, samples_per_pass):
        count = min(samples_per_pass, batch.size - first)
        inputs = tuple(t.narrow(d, first, count) for t, d in zip(batch.tensors, batch.dims,
                                                                   strict=True))
        if problem.chunk_size == 1:
            jacobians, outputs = _sample_loop(sample_rows, primals, inputs, batch.dims)
        else:
            jacobians, outputs = _sample_vmap(sample_rows, primals, inputs, batch.dims,
                                              inner_chunk)
        if writer is None:
            assert problem.output is not None
            canonical = problem.canonical_rows()
            writer = _BlockWriter(problem, group, problem.output.num_rows)
            problem.output_rows = outputs.new_zeros(problem.output.num_rows)
        assert canonical is not None and problem.output_rows is not None
        rows = canonical[first:first + count].reshape(-1)
        problem.output_rows[rows] = outputs.reshape(-1)
        writer.write(rows, {
            leaf: jac.reshape(rows.numel(), -1) for leaf, jac in zip(leaf_ids, jacobians,
                                                                       strict=True)
        })
    if writer is not None:
        writer.flush(sink)
    return writer


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
    return torch.func.vmap(jac, in_dims=(None,) * num_leaves + dims)(*primals, *inputs)


def _sample_loop(sample_rows: Callable[..., Tensor], primals: tuple[Tensor, ...],
                 inputs: tuple[Tensor, ...],
                 dims: tuple[int, ...]) -> tuple[tuple[Tensor, ...], Tensor]:
    """The same as :func:`_sample_vmap` with plain loops over samples and rows (no vmap)."""
    per_sample: list[tuple[Tensor, ...]] = []
    outputs: list[Tensor] = []
    count = inputs[0].shape[dims[0]]
    for b in range(count):
        sample = tuple(x.narrow(d, b, 1) for x, d in zip(inputs, dims, strict=True))
        rows, vjp_fn = torch.func.vjp(functools.partial(_append_inputs, sample_rows, sample),
                                      *primals)
        outputs.append(rows)
        grads = [_row_vjps(vjp_fn, rows, k, k + 1) for k in range(rows.numel())]
        per_sample.append(tuple(
            torch.cat([g[i] for g in grads]) if grads else leaf.new_zeros(0, *leaf.shape)
            for i, leaf in enumerate(primals)
        ))
    jacobians = tuple(torch.stack([s[i] for s in per_sample]) for i in range(len(primals)))
    return jacobians, torch.stack(outputs)


def _append_inputs(fn: Callable[..., Tensor], inputs: tuple[Tensor, ...],
                   *values: Tensor) -> Tensor:
    return fn(*values, *inputs)
