"""Grouping leaves into Jacobian blocks that fit a memory budget.

# NOTE [memory budget]
``memory_budget`` caps the bytes of Jacobian a backend *assembles* at once: a block of
``m`` rows by the summed width of the leaves in a group. Leaves are packed greedily in
order. A single leaf whose ``m × numel`` Jacobian alone exceeds the budget is **split**
into column slices, each as wide as the budget allows; every slice re-runs the row passes
(more time, same bound). Besides the block, one row chunk of full-leaf gradients is
transient (``chunk × numel`` of the group's leaves); when ``chunk_size`` is not given the
chunk is chosen so that it fits the budget too, so the peak is about twice the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ColumnSlice:
    """Columns ``[start, stop)`` of leaf ``leaf``'s flattened Jacobian."""

    leaf: int
    start: int
    stop: int

    @property
    def width(self) -> int:
        """Number of columns."""
        return self.stop - self.start


@dataclass(frozen=True)
class LeafGroup:
    """Column slices whose Jacobian is assembled as one ``[m, width]`` block."""

    slices: tuple[ColumnSlice, ...]

    @property
    def leaves(self) -> tuple[int, ...]:
        """The distinct leaves this group touches, in order."""
        return tuple(dict.fromkeys(s.leaf for s in self.slices))

    @property
    def width(self) -> int:
        """Total number of columns."""
        return sum(s.width for s in self.slices)


def group_leaves(numels: Sequence[int], num_rows: int, itemsize: int,
                 memory_budget: int | None) -> list[LeafGroup]:
    """Pack leaves into groups of at most ``memory_budget`` bytes of Jacobian.

    Args:
        numels: Number of parameters of each leaf.
        num_rows: Number of Jacobian rows ``m``.
        itemsize: Bytes per Jacobian entry.
        memory_budget: Bytes allowed per block, or ``None`` for a single group.

    Returns:
        The groups, covering every column of every leaf exactly once.

    Example:
        >>> [g.width for g in group_leaves([6, 6, 20], num_rows=2, itemsize=4,
        ...                                memory_budget=2 * 4 * 12)]
        [12, 12, 8]
    """
    everything = [ColumnSlice(i, 0, n) for i, n in enumerate(numels) if n > 0]
    if memory_budget is None:
        return [LeafGroup(tuple(everything))] if everything else []
    max_width = max(1, memory_budget // max(1, num_rows * itemsize))
    groups: list[LeafGroup] = []
    current: list[ColumnSlice] = []
    current_width = 0
    for piece in everything:
        if current and current_width + piece.width > max_width:
            groups.append(LeafGroup(tuple(current)))
            current, current_width = [], 0
        if piece.width > max_width:
            for start in range(piece.start, piece.stop, max_width):
                groups.append(LeafGroup((ColumnSlice(piece.leaf, start,
                                                     min(start + max_width, piece.stop)),)))
            continue
        current.append(piece)
        current_width += piece.width
    if current:
        groups.append(LeafGroup(tuple(current)))
    return groups


def rows_per_chunk(chunk_size: int | None, num_rows: int, transient_width: int, itemsize: int,
                   memory_budget: int | None) -> int:
    """Rows per vectorized pass: ``chunk_size``, or what the budget allows, or all rows."""
    if chunk_size is not None:
        return min(chunk_size, max(num_rows, 1))
    if memory_budget is None:
        return max(num_rows, 1)
    fitting = memory_budget // max(1, transient_width * itemsize)
    return int(min(max(fitting, 1), max(num_rows, 1)))
