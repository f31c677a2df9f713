"""Cross Gramians ``J(x1) J(x2)ᵀ`` between two evaluations of ``f``, reduced pair by pair.

# NOTE [cross kernels]
A kernel between two input sets (``torchgram.ntk``) is the off-diagonal block
``J(x1) J(x2)ᵀ`` of the Gramian of the concatenated batch, computed without concatenating:
a :class:`CrossProblem` holds one :class:`~torchgram._core.problem.Problem` per side (the
same ``f`` and parameters, other inputs), and each backend computes the block from its own
per-side pieces (Jacobian blocks, ``vjp``/``jvp`` pushes, or factors: ``X1 X2ᵀ ⊙ G1 G2ᵀ``).
``right=None`` is the kernel of ``left`` with itself (one side's work, symmetric).

Which pairs of output entries a kernel keeps is a :class:`PairSpec`, one mode per output
axis of ``f`` (neural-tangents' ``trace_axes`` / ``diagonal_axes``):

* ``"free"``: every pair ``(i, j)`` of the axis is kept (the axis appears twice);
* ``"diagonal"``: only ``i == j`` (the axis appears once; both sides need its size);
* ``"trace"``: only ``i == j``, summed (the axis disappears; the ``ntk`` layer divides by the
  size: neural-tangents' *mean*).

Backends never form pairs a spec drops: a traced logit axis of size ``K`` costs ``K`` times
less in every Gram product, a diagonal batch axis pairs each sample with itself only.

Every backend returns the block in one **canonical layout**, ``[Bd, D, F1, B1, F2, B2]``:
the rows of a side are ``(r, b)`` (``R`` rows per sample × ``B`` samples, as the structured
backend orders them; ``B = 1`` without per-sample structure), ``r`` split into its free
(``F``), diagonal (``D``) and traced axes; ``Bd`` is the batch axis when it is diagonal,
``B1``/``B2`` when it is free (both are 1 otherwise), and traced axes are summed. Each group
keeps the output's axis order. :func:`spec_gram` contracts two sides' per-row Jacobians
into that layout, :func:`spec_reduce` a full cross Gramian.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from torchgram._core.problem import Problem
from torchgram._core.result import RunReport

AxisMode = Literal["free", "diagonal", "trace"]
"""What a kernel keeps of one output axis's pairs (NOTE [cross kernels])."""


@dataclass(frozen=True)
class PairSpec:
    """Which pairs of output entries of two evaluations a kernel keeps (NOTE [cross kernels]).

    Attributes:
        modes: One mode per axis of ``f``'s output (``"free"``, ``"diagonal"``, ``"trace"``).
        batch_axis: The output axis indexing samples when the sides have per-sample
            structure (``batch_dim``), else ``None``.

    Example:
        >>> spec = PairSpec(("free", "trace"), batch_axis=0)  # NT's default on logits
        >>> spec.row_modes, spec.batch_mode
        (('trace',), 'free')
        >>> spec.row_groups((10,))
        (1, 1, 10)
    """

    modes: tuple[AxisMode, ...]
    batch_axis: int | None = None

    @property
    def row_modes(self) -> tuple[AxisMode, ...]:
        """The modes of the axes that index a sample's rows (all axes without a batch)."""
        return tuple(m for i, m in enumerate(self.modes) if i != self.batch_axis)

    @property
    def batch_mode(self) -> AxisMode:
        """The batch axis's mode (``"free"`` without per-sample structure: one sample)."""
        return "free" if self.batch_axis is None else self.modes[self.batch_axis]

    def row_groups(self, row_shape: Sequence[int]) -> tuple[int, int, int]:
        """``(F, D, T)``: rows of free, diagonal and traced axes for a sample's row shape."""
        return _row_groups(self, tuple(row_shape))[:3]

    def row_permutation(self) -> tuple[int, ...]:
        """The row axes in ``(free, diagonal, traced)`` order (each group in axis order)."""
        modes = self.row_modes
        return tuple(i for group in ("free", "diagonal", "trace")
                     for i, m in enumerate(modes) if m == group)

    @property
    def traced_everything(self) -> bool:
        """Whether no pair is kept apart (every axis traced): a scalar kernel."""
        return all(m == "trace" for m in self.modes)


@functools.lru_cache(maxsize=256)
def _row_groups(spec: PairSpec, row_shape: tuple[int, ...]) -> tuple[int, int, int, bool]:
    """``(F, D, T, whether the row axes need a permutation)``, computed once per shape."""
    sizes: dict[str, int] = {"free": 1, "diagonal": 1, "trace": 1}
    for size, mode in zip(row_shape, spec.row_modes, strict=True):
        sizes[mode] *= size
    perm = spec.row_permutation()
    return sizes["free"], sizes["diagonal"], sizes["trace"], list(perm) != sorted(perm)


def group_rows(x: Tensor, spec: PairSpec, row_shape: Sequence[int]) -> Tensor:
    """``x [R, ...]`` with its rows (of shape ``row_shape``) as ``[F, D, T, ...]``.

    Example:
        >>> spec = PairSpec(("free", "trace", "free"), batch_axis=0)
        >>> rows = torch.arange(6.0).reshape(6, 1)  # row r = 3 i + j: i traced, j free
        >>> group_rows(rows, spec, (2, 3))[:, 0, :, 0]  # [F = 3, T = 2]
        tensor([[0., 3.],
                [1., 4.],
                [2., 5.]])
    """
    rest = x.shape[1:]
    f, d, t, permute = _row_groups(spec, tuple(row_shape))
    if permute:
        perm = spec.row_permutation()
        x = x.reshape(*row_shape, *rest)
        x = x.permute(*perm, *range(len(row_shape), x.dim()))
    return x.reshape(f, d, t, *rest)


def spec_gram(x: Tensor, y: Tensor | None, spec: PairSpec, row_shape1: Sequence[int],
              row_shape2: Sequence[int] | None = None) -> Tensor:
    """The kernel block ``[Bd, D, F1, B1, F2, B2]`` of per-row Jacobians (NOTE [cross kernels]).

    Matrix products batched over the diagonal and traced row groups, on the ``[R, B, P]``
    layout the backward passes produce (no copy when the rows are already grouped), then a
    sum over the traced rows.

    Args:
        x: Side 1's per-row Jacobians ``[R1, B1, P]`` (rows ``(r, b)``).
        y: Side 2's ``[R2, B2, P]`` (``None``: ``x`` itself).
        spec: The pairs kept.
        row_shape1: The shape of a sample's rows on side 1 (``R1`` entries).
        row_shape2: The same on side 2 (``None``: ``row_shape1``).

    Example:
        >>> x = torch.randn(4, 3, 5)  # rows: 4 logits × 3 samples
        >>> spec = PairSpec(("free", "trace"), batch_axis=0)
        >>> block = spec_gram(x, None, spec, (4,))
        >>> block.shape
        torch.Size([1, 1, 1, 3, 1, 3])
        >>> dense = torch.einsum("kbp,kcp->bc", x, x)
        >>> torch.allclose(block.reshape(3, 3), dense)
        True
    """
    xg = group_rows(x.reshape(x.shape[0], x.shape[1], -1), spec, row_shape1)  # [F1, D, T, B1, P]
    yg = xg if y is None else group_rows(y.reshape(y.shape[0], y.shape[1], -1), spec,
                                         row_shape2 or row_shape1)
    f1, d, t, b1, p = xg.shape
    f2, b2 = yg.shape[0], yg.shape[3]
    mode = spec.batch_mode
    if mode == "free":
        # [D, T, F1 B1, P] @ [D, T, P, F2 B2], summed over T
        xm = (xg.reshape(d * t, b1, p) if f1 == 1 else
              xg.permute(1, 2, 0, 3, 4).reshape(d * t, f1 * b1, p))
        ym = xm if y is None else (yg.reshape(d * t, b2, p) if f2 == 1 else
                                   yg.permute(1, 2, 0, 3, 4).reshape(d * t, f2 * b2, p))
        out = torch.bmm(xm, ym.transpose(1, 2)).reshape(d, t, f1, b1, f2, b2)
        out = out[:, 0] if t == 1 else out.sum(1)
        return out.unsqueeze(0)  # [1, D, F1, B1, F2, B2]
    # the same sample on both sides: [B, D, T, F1, P] @ [B, D, T, P, F2]
    xm = xg.permute(3, 1, 2, 0, 4).reshape(b1 * d * t, f1, p)
    ym = xm if y is None else yg.permute(3, 1, 2, 0, 4).reshape(b2 * d * t, f2, p)
    out = torch.bmm(xm, ym.transpose(1, 2)).reshape(b1, d, t, f1, f2).sum(2)
    if mode == "trace":
        out = out.sum(0, keepdim=True)
    return out.unsqueeze(3).unsqueeze(5)  # [Bd, D, F1, 1, F2, 1]


def spec_reduce(gram: Tensor, spec: PairSpec, row_shape1: Sequence[int],
                row_shape2: Sequence[int] | None = None) -> Tensor:
    """The kernel block ``[Bd, D, F1, B1, F2, B2]`` of a full cross Gramian ``[R1, B1, R2, B2]``.

    The same as :func:`spec_gram` of the Jacobians whose Gramian ``gram`` is.

    Example:
        >>> x, y = torch.randn(4, 3, 5).double(), torch.randn(4, 2, 5).double()
        >>> spec = PairSpec(("free", "trace"), batch_axis=0)
        >>> gram = torch.einsum("rbp,scp->rbsc", x, y)
        >>> torch.allclose(spec_reduce(gram, spec, (4,)), spec_gram(x, y, spec, (4,)))
        True
    """
    shape2 = row_shape2 or row_shape1
    r1, b1, r2, b2 = gram.shape
    left = group_rows(gram.reshape(r1, b1 * r2 * b2), spec, row_shape1)  # [F1, D, T, ...]
    f1, d, t = left.shape[:3]
    left = left.reshape(f1 * d * t * b1, r2, b2).transpose(0, 1)  # [R2, (F1 D T B1), B2]
    both = group_rows(left, spec, shape2)  # [F2, D, T, F1 D T B1, B2]
    f2 = both.shape[0]
    both = both.reshape(f2, d, t, f1, d, t, b1, b2)
    mode = spec.batch_mode
    if mode == "free":
        out = torch.einsum("gdtfdtbc->dfbgc", both)
        return out.unsqueeze(0)
    if mode == "diagonal":
        out = torch.einsum("gdtfdtbb->bdfg", both)
        return out.unsqueeze(3).unsqueeze(5)
    out = torch.einsum("gdtfdtbb->dfg", both)
    return out.unsqueeze(0).unsqueeze(3).unsqueeze(5)


def mirror(block: Tensor) -> Tensor:
    """The block of the swapped sides: ``[Bd, D, F2, B2, F1, B1]`` (kernels are symmetric)."""
    return block.permute(0, 1, 4, 5, 2, 3)


def row_shape(problem: Problem) -> tuple[int, ...]:
    """The shape of a sample's rows: the output without its batch dim (all of it without).

    Only for problems whose ``f`` returns one tensor (kernels need that).
    """
    spec = problem.output
    shape = tuple(spec.shapes[0])
    if spec.batch_dims is None:
        return shape
    dim = spec.batch_dims[0]
    return shape[:dim] + shape[dim + 1:]


def sample_rows_view(rows: Tensor, problem: Problem, order: str) -> Tensor:
    """Per-row values ``[m, ...]`` as ``[R, B, ...]``.

    ``order``: the rows' order, ``"output"`` or ``"sample_major"`` (NOTE [backend results]).
    """
    rest = rows.shape[1:]
    samples = problem.samples
    if problem.batch is None:
        return rows.reshape(rows.shape[0], 1, *rest)
    if order == "output":
        spec = problem.output
        assert spec.batch_dims is not None
        shape = tuple(spec.shapes[0])
        dim = spec.batch_dims[0]
        view = rows.reshape(*shape, *rest).movedim(dim, 0)  # [B, *row shape, ...]
        return view.reshape(samples, -1, *rest).transpose(0, 1)
    return rows.reshape(samples, -1, *rest).transpose(0, 1)


@dataclass(frozen=True)
class CrossProblem:
    """A kernel between ``left``'s inputs and each of ``rights`` (NOTE [cross kernels]).

    Attributes:
        left: Side 1 (its inputs are ``x1``, or one tile of them).
        rights: Side 2 for each block wanted: a problem (``x2`` or a tile), or ``None`` for
            ``left`` itself (a symmetric block, one side's work).
        spec: The pairs kept.
        on_block: Called after each block (progress bars).
    """

    left: Problem
    rights: tuple[Problem | None, ...]
    spec: PairSpec
    on_block: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    def done(self) -> None:
        """Report one finished block."""
        if self.on_block is not None:
            self.on_block()

    def right_rows(self, index: int) -> tuple[int, ...]:
        """The row shape of block ``index``'s side 2."""
        right = self.rights[index]
        return row_shape(self.left if right is None else right)

    def block_shape(self, index: int) -> tuple[int, ...]:
        """The canonical shape ``[Bd, D, F1, B1, F2, B2]`` of block ``index``."""
        right = self.rights[index] or self.left
        f1, d, _ = self.spec.row_groups(row_shape(self.left))
        f2, _, _ = self.spec.row_groups(row_shape(right))
        mode = self.spec.batch_mode
        b1, b2 = self.left.samples, right.samples
        if mode == "free":
            return (1, d, f1, b1, f2, b2)
        return (b1 if mode == "diagonal" else 1, d, f1, 1, f2, 1)


@dataclass(frozen=True)
class CrossResult:
    """A backend's kernel blocks, one per right side, canonical layout, summed over traces.

    Attributes:
        blocks: ``[Bd, D, F1, B1, F2, B2]`` per right side.
        report: What the backend did (as for :class:`~torchgram._core.result.BackendResult`).
    """

    blocks: tuple[Tensor, ...]
    report: RunReport


def traced_size(spec: PairSpec, shape: Sequence[int]) -> int:
    """The number of entries summed per kept pair (the product of the traced axes' sizes)."""
    return math.prod(size for size, mode in zip(shape, spec.modes, strict=True)
                     if mode == "trace")


def blocks_dtype(problem: Problem) -> torch.dtype:
    """The dtype kernel blocks are summed in (the widest of the output's and the leaves')."""
    return problem.compute_dtype
