"""Where every rank's rows go among the rows of the whole batch.

With ``batch_dim`` the whole batch is every rank's samples concatenated in rank order
along the batch dimension of every output leaf: the global output has the per-sample
shapes with ``B = Σ_r B_r`` there, and its ``M`` rows are its leaves flattened row-major,
as ``torchgram.gramian`` orders them. Without ``batch_dim``, the rows are every rank's
``m_r`` rows (its output flattened) one rank after the other.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from torchgram.distributed._agreement import Agreement, OutputDesc


def global_shapes(output: OutputDesc, batches: tuple[int | None, ...]) -> tuple[
        tuple[int, ...], ...] | None:
    """The shapes of the whole batch's output leaves (``None`` without ``batch_dim``)."""
    if output.batch_dims is None:
        return None
    total = sum(b or 0 for b in batches)
    return tuple(shape[:d] + (total,) + shape[d + 1:]
                 for shape, d in zip(output.shapes, output.batch_dims, strict=True))


def num_global_rows(agreement: Agreement) -> int:
    """``M``: the rows of the whole batch."""
    shapes = global_shapes(agreement.output, agreement.batches)
    if shapes is None:
        return sum(agreement.sizes) if agreement.mode == "ranks" else 0
    return sum(math.prod(shape) for shape in shapes)


def local_to_global(agreement: Agreement, rank: int, device: torch.device) -> Tensor:
    """``[m_r]``: the global row of each of ``rank``'s rows (in its output's order)."""
    output = agreement.output
    shapes = global_shapes(output, agreement.batches)
    if shapes is None:
        assert agreement.mode == "ranks"
        offset = sum(agreement.sizes[:rank])
        return torch.arange(offset, offset + agreement.sizes[rank], device=device)
    assert output.batch_dims is not None
    start = sum(b or 0 for b in agreement.batches[:rank])
    count = agreement.batches[rank] or 0
    pieces = []
    offset = 0
    for shape, dim in zip(shapes, output.batch_dims, strict=True):
        numel = math.prod(shape)
        index = torch.arange(offset, offset + numel, device=device).reshape(shape)
        pieces.append(index.narrow(dim, start, count).reshape(-1))
        offset += numel
    return torch.cat(pieces)


def sample_major_index(agreement: Agreement, device: torch.device) -> Tensor:
    """``[B, K]`` over all ranks' samples: the global row of row ``k`` of sample ``b``."""
    output = agreement.output
    shapes = global_shapes(output, agreement.batches)
    assert shapes is not None and output.batch_dims is not None
    total = sum(b or 0 for b in agreement.batches)
    columns = []
    offset = 0
    for shape, dim in zip(shapes, output.batch_dims, strict=True):
        numel = math.prod(shape)
        index = torch.arange(offset, offset + numel, device=device).reshape(shape)
        columns.append(index.movedim(dim, 0).reshape(total, -1))
        offset += numel
    return torch.cat(columns, dim=1)


def layout_index(agreement: Agreement, device: torch.device) -> Tensor:
    """``[R · total]``: the global row of each row ``(r, s)`` of the exchange's layout.

    ``-1`` marks padding (rows beyond a rank's count when every rank is one "sample").
    """
    if agreement.mode == "samples":
        return sample_major_index(agreement, device).T.reshape(-1)
    rows = agreement.rows
    index = torch.full((rows, len(agreement.sizes)), -1, dtype=torch.long, device=device)
    for rank, count in enumerate(agreement.sizes):
        if count:
            index[:count, rank] = local_to_global(agreement, rank, device)
    return index.reshape(-1)


def to_global_order(block: Tensor, index: Tensor, *, diagonal: bool) -> Tensor:
    """A layout block (``[n, n]`` or ``[n]``) as ``[M, M]`` (``[M]``) in the global order."""
    valid = torch.nonzero(index >= 0).reshape(-1)
    order = valid[torch.argsort(index[valid])]
    if diagonal:
        return block[order]
    return block.index_select(0, order).index_select(1, order)


def shape_global(block: Tensor, agreement: Agreement, *, diagonal: bool) -> Tensor:
    """``[M, M]`` (``[M]``) as ``S + S`` (``S``) when ``f`` returns one tensor with batch_dim."""
    shapes = global_shapes(agreement.output, agreement.batches)
    if shapes is None or agreement.output.treespec.num_leaves != 1 \
            or agreement.output.treespec.num_nodes != 1:
        return block
    shape = shapes[0]
    return block.reshape(shape if diagonal else (*shape, *shape))
