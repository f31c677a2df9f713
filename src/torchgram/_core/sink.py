"""Collecting per-leaf blocks inside a backend, and assembling what a call returns.

# NOTE [per-leaf blocks]
Every backend computes contributions *per differentiated leaf* (DESIGN.md §1: G is the
block sum Σ_l J_l J_lᵀ). :class:`LeafBlocks` collects them the way the call asked for:

* ``per_leaf=False``: one running sum, so L leaves cost one ``[m, m]`` buffer, not L;
* ``per_leaf=True``: one buffer per leaf;
* ``diagonal=True``: ``[m]`` vectors instead of ``[m, m]`` matrices.

A leaf's contribution may arrive in several pieces, but only as Gramians of *column
blocks* of J_l (e.g. slices of a leaf too big for the memory budget), which do add up.
Gramians of the separate *uses* of a leaf do not: J_l = Σ_u J_{l,u} has cross terms.

The first piece of a slot is kept as given (no copy); a second one is added out of place
once, and in place after that, so a block the backend still uses elsewhere is never
written into. Pieces are summed in the call's ``compute_dtype`` (the widest of the output's
and the leaves' dtypes), so that a float32 leaf's block never rounds a float64 one. When
``G`` must be differentiable (NOTE [composition]) every sum is out of place: an in-place add
of a ``vmap``-batched block into an unbatched one is refused by ``vmap``.

:func:`assemble` is the sink of the pipeline (NOTE [backend results]): the one place that
puts rows in the output's order, symmetrises, casts and shapes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from torchgram._core.problem import Problem
from torchgram._core.result import BackendResult, RowOrder


class LeafBlocks:
    """Accumulates Gramian contributions, per leaf or summed (NOTE [per-leaf blocks]).

    Args:
        num_leaves: Number of differentiated leaves.
        per_leaf: Keep one block per leaf instead of their sum.
        diagonal: Contributions are diagonals (``[m]``) instead of matrices (``[m, m]``).
        dtype: The dtype blocks are kept and summed in (the widest of the call's: a block of
            a narrower leaf is cast before it is added). ``None``: promoted as they come.
        in_place: Whether sums may be made in place (not when ``G`` is differentiated).

    Example:
        >>> blocks = LeafBlocks(2, per_leaf=False, diagonal=False)
        >>> blocks.add_jacobian([0, 1], torch.ones(3, 4), [1, 3])
        >>> blocks.blocks()[0]
        tensor([[4., 4., 4.],
                [4., 4., 4.],
                [4., 4., 4.]])
    """

    def __init__(self, num_leaves: int, *, per_leaf: bool, diagonal: bool,
                 dtype: torch.dtype | None = None, in_place: bool = True) -> None:
        self.per_leaf = per_leaf
        self.diagonal = diagonal
        self.dtype = dtype
        self.in_place = in_place
        self._blocks: list[Tensor | None] = [None] * (num_leaves if per_leaf else 1)
        self._owned = [False] * len(self._blocks)

    @classmethod
    def for_problem(cls, problem: Problem) -> LeafBlocks:
        """The accumulator a call of ``problem`` needs."""
        return cls(len(problem.leaves), per_leaf=problem.per_leaf, diagonal=problem.diagonal,
                   dtype=problem.compute_dtype,
                   in_place=not problem.composition.differentiable)

    def add(self, leaf_index: int, block: Tensor) -> None:
        """Add the Gramian (or its diagonal) of a column block of leaf ``leaf_index``'s J."""
        slot = leaf_index if self.per_leaf else 0
        if self.dtype is not None:
            block = block.to(self.dtype)
        current = self._blocks[slot]
        if current is None:
            self._blocks[slot] = block
        elif self._owned[slot] and self.in_place and \
                torch.promote_types(current.dtype, block.dtype) == current.dtype:
            current.add_(block)
        else:
            self._blocks[slot] = current + block
            self._owned[slot] = True

    def add_jacobian(self, leaf_indices: Sequence[int], jacobian: Tensor,
                     widths: Sequence[int]) -> None:
        """Add the Gramian of a Jacobian block ``[m, sum(widths)]``.

        Column ``widths[i]`` wide slices belong to leaf ``leaf_indices[i]`` in order. When the
        blocks are summed, the whole block is contracted at once (one matmul).
        """
        if self.dtype is not None:
            jacobian = jacobian.to(self.dtype)
        if not self.per_leaf:
            self.add(0, gram(jacobian, self.diagonal))
            return
        for leaf_index, columns in zip(leaf_indices, jacobian.split(list(widths), dim=1),
                                       strict=True):
            self.add(leaf_index, gram(columns, self.diagonal))

    def blocks(self) -> tuple[Tensor | None, ...]:
        """The collected blocks (``None`` where nothing was added)."""
        return tuple(self._blocks)


def gram(jacobian: Tensor, diagonal: bool) -> Tensor:
    """``J Jᵀ`` of a ``[rows, columns]`` Jacobian (its diagonal with ``diagonal``)."""
    if diagonal:
        return jacobian.square().sum(dim=1)
    return jacobian @ jacobian.T


# -- the sink --------------------------------------------------------------------------------

def backend_index(problem: Problem, order: RowOrder) -> Tensor | None:
    """``index[p]``: the output row of the backend's row ``p``; ``None`` for the identity."""
    if order == "output" or problem.batch is None:
        return None
    if order == "sample_major":
        if problem.output.sample_major_is_output_order:
            return None
        return problem.sample_major_index.reshape(-1)
    if problem.samples == 1 or problem.rows_per_sample == 1:
        return backend_index(problem, "sample_major")
    return problem.sample_major_index.T.reshape(-1)


def to_output_order(problem: Problem, order: RowOrder, block: Tensor, *,
                    diagonal: bool) -> Tensor:
    """A block (``[m, m]``, or ``[m]`` with ``diagonal``) in the output's row order."""
    index = backend_index(problem, order)
    if index is None:
        return block
    inverse = torch.argsort(index)
    if diagonal:
        return block[inverse]
    return block.index_select(0, inverse).index_select(1, inverse)


def to_backend_order(problem: Problem, order: RowOrder, weights: Tensor) -> Tensor:
    """Weights ``[m]`` in the output's order, in the backend's row order."""
    index = backend_index(problem, order)
    return weights if index is None else weights[index]


def assemble(problem: Problem, result: BackendResult) -> list[Tensor]:
    """The result's blocks as the call returns them, before the ``S + S`` shaping.

    Each is ``[m, m]`` (``[m]``), in the output's row order, symmetric, in the output's dtype
    and on its device; zeros where the backend returned ``None``.
    """
    spec = problem.output
    m = spec.num_rows
    shape = (m,) if problem.diagonal else (m, m)
    assembled = []
    for block in result.blocks:
        if block is None:
            assembled.append(torch.zeros(shape, dtype=spec.dtype, device=spec.device))
            continue
        if not result.symmetric and not problem.diagonal:
            block = torch.add(block, block.mT).mul_(0.5)
        block = to_output_order(problem, result.row_order, block, diagonal=problem.diagonal)
        assembled.append(block.to(dtype=spec.dtype, device=spec.device))
    return assembled


def shape_block(problem: Problem, block: Tensor, *, diagonal: bool) -> Tensor:
    """Reshape an ``[m, m]`` (or ``[m]``) block to ``S + S`` (``S``) for a tensor output."""
    spec = problem.output
    if not spec.is_tensor:
        return block
    shape = spec.shapes[0]
    return block.reshape(shape if diagonal else (*shape, *shape))
