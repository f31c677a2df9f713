"""The Gram block of one materialized use, its Jacobian formed a slice of rows at a time.

# NOTE [streamed Gram]
A leaf materialized from one dense use with one group and one row per sample (a linear
layer's or a convolution's weight over ``T`` positions, with per-sample losses) has the
per-sample Jacobians ``J[b] = left[b] @ right[b]`` (``[i, T] @ [T, j]``), and its block is
the Gram of ``J`` flattened to ``[B, i·j]``. Forming all of ``J`` writes ``B·i·j`` fresh
entries that the Gram then reads once (ResNet-18's last convolutions: ``16 × 147456``,
9.4 MB): on a CPU, the first touch of that much new memory (page faults) was measured to
cost as much as the product itself (``[16, 128, 16] @ [16, 16, 1152]``: 1.5 ms into
memory used before, 6 ms into fresh memory). The Gram is a sum over columns, so ``J`` is
formed a slice of its rows ``i`` at a time (about :data:`STREAM_ELEMENTS` entries for all
samples), into one buffer (:class:`Workspace`) that every such leaf of a contraction
reuses, and the slices' Gram matrices are added: the same multiply-adds, no Jacobian held,
one buffer's memory. Where the product must be differentiable (``create_graph``) each
slice is a new tensor instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

STREAM_ELEMENTS = 2**19
"""Entries (all samples together) of one slice of the Jacobian (2 MiB in float32)."""


class Workspace:
    """One flat buffer, grown on demand, lent to the slices of every streamed Gram."""

    def __init__(self) -> None:
        self._buffer: Tensor | None = None

    def take(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """A contiguous tensor of ``shape`` (contents undefined), ``like``'s dtype and device."""
        numel = 1
        for size in shape:
            numel *= size
        buffer = self._buffer
        if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype \
                or buffer.device != like.device:
            buffer = self._buffer = like.new_empty(numel)
        return buffer[:numel].view(shape)


def streamed_gram(left: Tensor, right: Tensor, diagonal: bool,
                  workspace: Workspace) -> Tensor:
    """The Gram ``[1, B, 1, B]`` (``[1, B]`` when ``diagonal``) of ``J[b] = left[b] @ right[b]``.

    NOTE [streamed Gram]. ``left``: ``[B, i, T]``, ``right``: ``[B, T, j]``.

    Example:
        >>> import torch
        >>> left, right = torch.randn(3, 5, 4), torch.randn(3, 4, 6)
        >>> jac = torch.bmm(left, right).reshape(3, -1)
        >>> gram = streamed_gram(left, right, False, Workspace())
        >>> torch.allclose(gram.reshape(3, 3), jac @ jac.T, atol=1e-5)
        True
    """
    samples, rows, _ = left.shape
    width = right.shape[2]
    step = max(1, min(rows, STREAM_ELEMENTS // max(1, samples * width)))
    differentiable = torch.is_grad_enabled() and (left.requires_grad or right.requires_grad)
    gram: Tensor | None = None
    for start in range(0, rows, step):
        part = left[:, start:start + step]
        if differentiable:
            jac = torch.bmm(part, right)
        else:
            jac = torch.bmm(part, right,
                            out=workspace.take((samples, part.shape[1], width), left))
        flat = jac.reshape(samples, -1)
        if diagonal:
            piece = torch.bmm(flat.unsqueeze(1), flat.unsqueeze(2)).reshape(samples)
        elif gram is not None and not differentiable:
            gram.addmm_(flat, flat.T)
            continue
        else:
            piece = flat @ flat.T
        gram = piece if gram is None else gram + piece
    if gram is None:  # no rows: a leaf without entries
        gram = left.new_zeros((samples,) if diagonal else (samples, samples))
    return gram.reshape(1, samples) if diagonal else gram.reshape(1, samples, 1, samples)
