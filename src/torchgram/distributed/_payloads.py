"""Payloads on the wire: describing, packing, unpacking and concatenating them.

A rank's :class:`~torchgram.backends.structured.payloads.LeafPayload` travels as a list of
tensors (:func:`wire_tensors`): the factors of every use (one cotangent for a bias), or
its Jacobian. They are described in the rank's summary (:func:`describe`) so that every
receiver knows the bytes and shapes it will get; the bytes of all the leaves a rank sends
to one owner are packed into one ``uint8`` buffer (8-byte aligned pieces). An owner
concatenates the pieces of every rank along the sample dimension, zero-padding positions
(and rows, when every rank is one "sample" of its own rows) and filling ranks that do not
reach the leaf with zeros (:func:`concatenate`): the result is the payload of all ranks'
samples together, which it contracts (NOTE [payloads]).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from torchgram.backends.structured.contraction import Factor, UseFactors
from torchgram.backends.structured.payloads import LeafPayload, UsePayload
from torchgram.distributed._agreement import LeafSummary, PayloadKind, TensorDesc


def _desc(tensor: Tensor) -> TensorDesc:
    return TensorDesc(tuple(tensor.shape), str(tensor.dtype))


def _masked(factor: Factor) -> tuple[int, ...]:
    """A factor's shape without its sample, row and position counts."""
    shape = tuple(factor.tensor.shape)
    return {"act": shape[2:], "cot": shape[3:], "index": ()}[factor.kind]


def factor_tensors(payload: LeafPayload) -> list[Tensor]:
    """The factors of every use, in travel order (one tensor for a bias's shared factor)."""
    tensors = []
    for item in payload.uses:
        first, second = item.factors.first, item.factors.second
        tensors.append(first.tensor)
        if second is not first:
            tensors.append(second.tensor)
    return tensors


def jacobian_dtype(payload: LeafPayload, leaf_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the payload's Jacobian."""
    dtype = leaf_dtype
    for tensor in [*factor_tensors(payload), payload.carrier]:
        if tensor is not None and tensor.is_floating_point():
            dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def describe(payload: LeafPayload, rows: int, samples: int, leaf: Tensor) -> LeafSummary:
    """The :class:`LeafSummary` of a rank's payload of ``leaf``."""
    if payload.zero:
        return LeafSummary(zero=True)
    jacobian = TensorDesc((rows, samples, leaf.numel()), str(jacobian_dtype(payload, leaf.dtype)))
    if not payload.factored:
        return LeafSummary(zero=False, jacobian=jacobian)
    signature = []
    for item in payload.uses:
        use, first, second = item.use, item.factors.first, item.factors.second
        signature.append((use.role, use.rule, use.act_first, use.shape.elementwise,
                          use.shape.act_is_index, use.shape.act_width, first.kind,
                          second.kind, second is first, _masked(first), _masked(second),
                          str(first.tensor.dtype), str(second.tensor.dtype)))
    factors = tuple(_desc(t) for t in factor_tensors(payload))
    return LeafSummary(zero=False, signature=tuple(signature), factors=factors,
                       jacobian=jacobian)


def wire_tensors(payload: LeafPayload, kind: PayloadKind, leaf: Tensor) -> list[Tensor]:
    """What a rank sends of a leaf: its factors or its Jacobian (nothing when zero)."""
    if kind == "zero" or payload.zero:
        return []
    if kind == "factors":
        return factor_tensors(payload)
    jacobian = payload.jacobian(leaf.numel())
    assert jacobian is not None
    return [jacobian.to(jacobian_dtype(payload, leaf.dtype))]


def wire_descs(summary: LeafSummary, kind: PayloadKind) -> tuple[TensorDesc, ...]:
    """The descriptions of what :func:`wire_tensors` sends, from the sender's summary."""
    if kind == "zero" or summary.zero:
        return ()
    if kind == "factors":
        return summary.factors
    assert summary.jacobian is not None
    return (summary.jacobian,)


def pack(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    """Tensors as one ``uint8`` buffer on ``device``, each piece padded to 8 bytes."""
    pieces = []
    for tensor in tensors:
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        pad = -raw.numel() % 8
        pieces.append(F.pad(raw, (0, pad)) if pad else raw)
    if not pieces:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat([piece.to(device) for piece in pieces])


def unpack(buffer: Tensor, descs: Sequence[TensorDesc], device: torch.device) -> list[Tensor]:
    """The tensors :func:`pack` packed, given their descriptions, on ``device``."""
    tensors = []
    offset = 0
    for desc in descs:
        dtype = _DTYPES[desc.dtype]
        count = 1
        for size in desc.shape:
            count *= size
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        piece = buffer[offset:offset + nbytes].clone()
        tensors.append(piece.view(dtype).reshape(desc.shape).to(device))
        offset += desc.nbytes
    assert offset == buffer.numel(), (offset, buffer.numel())
    return tensors


_DTYPES = {str(dtype): dtype for dtype in (torch.float64, torch.float32, torch.float16,
                                           torch.bfloat16, torch.int64, torch.int32)}


def concatenate(own: LeafPayload, kind: PayloadKind, received: Sequence[list[Tensor] | None],
                sizes: Sequence[int], rows: int, *, per_rank: bool) -> LeafPayload:
    """The payload of every rank's samples together (module docstring).

    Args:
        own: The owner's own payload of the leaf (its uses give the structure).
        kind: ``"factors"`` or ``"jacobian"``.
        received: Per rank, the tensors it sent (``None``: it does not reach the leaf).
        sizes: Per rank, its number of samples (``per_rank``: its number of rows).
        rows: ``R`` of the layout (the largest row count with ``per_rank``).
        per_rank: Every rank is one sample of its own rows (rows padded to ``rows``).
    """
    samples = [1 if per_rank else size for size in sizes]
    if kind == "jacobian":
        template = next(t[0] for t in received if t)
        parts = []
        for tensors, count in zip(received, samples, strict=True):
            if count == 0:
                continue
            if tensors:
                parts.append(_pad_dim(tensors[0], 0, rows))
            else:
                parts.append(template.new_zeros(rows, count, template.shape[-1]))
        return LeafPayload(own.plan, carrier=torch.cat(parts, dim=1))
    per_rank_factors = [None if t is None else _factors(own, t) for t in received]
    present = [f for f in per_rank_factors if f is not None]
    uses = []
    for u, item in enumerate(own.uses):
        shared = item.factors.second is item.factors.first
        firsts = [f[u].first for f in present]
        seconds = [f[u].second for f in present]
        first = _concat_factor(firsts, [f[u].first if f else None for f in per_rank_factors],
                               samples, rows)
        second = first if shared else _concat_factor(
            seconds, [f[u].second if f else None for f in per_rank_factors], samples, rows)
        uses.append(UsePayload(item.use, UseFactors(first, second)))
    return LeafPayload(own.plan, tuple(uses))


def _factors(own: LeafPayload, tensors: list[Tensor]) -> list[UseFactors]:
    """A rank's factor tensors as ``UseFactors``, in the structure of ``own``'s uses."""
    factors = []
    it = iter(tensors)
    for item in own.uses:
        first = Factor(next(it), item.factors.first.kind)
        second = first if item.factors.second is item.factors.first \
            else Factor(next(it), item.factors.second.kind)
        factors.append(UseFactors(first, second))
    return factors


def _concat_factor(present: list[Factor], per_rank: list[Factor | None], samples: list[int],
                   rows: int) -> Factor:
    """One factor of all ranks: positions padded to the longest, absent ranks zero."""
    kind = present[0].kind
    sample_dim = 1 if kind == "cot" else 0
    position_dim = sample_dim + 1
    positions = max(f.tensor.shape[position_dim] for f in present)
    template = present[0].tensor
    parts = []
    for factor, count in zip(per_rank, samples, strict=True):
        if count == 0:
            continue
        if factor is None:
            shape = list(template.shape)
            shape[sample_dim], shape[position_dim] = count, positions
            if kind == "cot":
                shape[0] = rows
            parts.append(template.new_zeros(shape))
            continue
        tensor = _pad_dim(factor.tensor, position_dim, positions)
        if kind == "cot":
            tensor = _pad_dim(tensor, 0, rows)
        parts.append(tensor)
    return Factor(torch.cat(parts, dim=sample_dim), kind)


def _pad_dim(tensor: Tensor, dim: int, size: int) -> Tensor:
    """``tensor`` zero-padded at the end of ``dim`` to ``size``."""
    missing = size - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)
