"""The mean weighting: every loss gets the weight ``1 / m``."""

from __future__ import annotations

import torch
from torch import Tensor

from torchgram._core.functional import public_math

from ._validation import check_gramian


@public_math  # NOTE [autocast], NOTE [the caller's function modes]
def mean(G: Tensor, /) -> Tensor:
    r"""Uniform weights ``w = 1 / m``: the update ``Jᵀw`` is the gradient of the mean loss.

    This is the baseline of multi-task and multi-objective learning (plain averaging of the
    losses). The Gramian is only used for its shape, dtype and device, and is still validated.

    Args:
        G: The Gramian ``J Jᵀ`` of shape ``[m, m]``, symmetric positive semi-definite.

    Returns:
        The weights ``[1/m, …, 1/m]``, shape ``[m]``, with ``G``'s dtype and device.

    Raises:
        NotImplementedError: If ``G`` is batched by ``torch.func.vmap``.
        TypeError: If ``G`` is not a real floating-point tensor.
        ValueError: If ``G`` is not a finite, square, symmetric matrix.

    Example:
        >>> import torch
        >>> import torchgram.weighting as weighting
        >>> J = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0], [0.0, 1.0]])
        >>> weighting.mean(J @ J.T)
        tensor([0.2500, 0.2500, 0.2500, 0.2500])
    """
    G = check_gramian(G, "mean")
    m = G.shape[0]
    return torch.full((m,), 1.0 / max(m, 1), dtype=G.dtype, device=G.device)
