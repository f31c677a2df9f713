"""Where backends put their per-leaf Gramian blocks.

# NOTE [per-leaf blocks]
Every backend reports contributions *per differentiated leaf* (DESIGN.md §1: G is the
block sum Σ_l J_l J_lᵀ). The sink turns them into what the call asked for:

* ``per_leaf=False``: one running sum, so L leaves cost one ``[m, m]`` buffer, not L;
* ``per_leaf=True``: one buffer per leaf;
* ``diagonal=True``: ``[m]`` vectors instead of ``[m, m]`` matrices.

A leaf's contribution may arrive in several pieces, but only as Gramians of *column
blocks* of J_l (e.g. slices of a leaf too big for the memory budget), which do add up.
Gramians of the separate *uses* of a leaf do not: J_l = Σ_u J_{l,u} has cross terms.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class GramSink:
    """Accumulates Gramian contributions, per leaf or summed.

    Args:
        num_leaves: Number of differentiated leaves.
        per_leaf: Keep one block per leaf instead of their sum.
        diagonal: Contributions are diagonals (``[m]``) instead of matrices (``[m, m]``).
    """

    def __init__(self, num_leaves: int, *, per_leaf: bool, diagonal: bool) -> None:
        self.num_leaves = num_leaves
        self.per_leaf = per_leaf
        self.diagonal = diagonal
        self._blocks: list[Tensor | None] = [None] * (num_leaves if per_leaf else 1)

    def add(self, leaf_index: int, block: Tensor) -> None:
        """Add the Gramian (or its diagonal) of a column block of leaf ``leaf_index``'s J."""
        slot = leaf_index if self.per_leaf else 0
        current = self._blocks[slot]
        if current is None:
            self._blocks[slot] = block.clone()  # owned: later pieces are added in place
        else:
            current.add_(block.to(current.dtype))

    def add_jacobian(self, leaf_indices: Sequence[int], jacobian: Tensor,
                     widths: Sequence[int]) -> None:
        """Add the Gramian of a Jacobian block ``[m, sum(widths)]``.

        Column ``widths[i]`` wide slices belong to leaf ``leaf_indices[i]`` in order. When the
        blocks are summed, the whole block is contracted at once (one matmul).
        """
        if not self.per_leaf:
            self.add(0, _gram(jacobian, self.diagonal))
            return
        for leaf_index, columns in zip(leaf_indices, jacobian.split(list(widths), dim=1),
                                       strict=True):
            self.add(leaf_index, _gram(columns, self.diagonal))

    def result(self, num_rows: int, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
        """The blocks (zeros where nothing was added), cast to ``dtype``."""
        shape = (num_rows,) if self.diagonal else (num_rows, num_rows)
        return [
            torch.zeros(shape, dtype=dtype, device=device) if block is None
            else block.to(dtype=dtype, device=device)
            for block in self._blocks
        ]


def _gram(jacobian: Tensor, diagonal: bool) -> Tensor:
    if diagonal:
        return jacobian.square().sum(dim=1)
    return jacobian @ jacobian.T
