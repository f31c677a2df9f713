"""The sum weighting: every loss gets the weight ``1``."""

from __future__ import annotations

import torch
from torch import Tensor

from torchgram._core.functional import public_math

from ._validation import check_gramian


@public_math  # NOTE [autocast], NOTE [the caller's function modes]
def sum(G: Tensor, /) -> Tensor:  # Shadows the builtin on purpose (like `torch.sum`).
    r"""Unit weights ``w = 1``: the update ``Jᵀw`` is the gradient of the summed loss.

    The Gramian is only used for its shape, dtype and device, and is still validated.

    Args:
        G: The Gramian ``J Jᵀ`` of shape ``[m, m]``, symmetric positive semi-definite.

    Returns:
        The weights ``[1, …, 1]``, shape ``[m]``, with ``G``'s dtype and device.

    Raises:
        NotImplementedError: If ``G`` is batched by ``torch.func.vmap``.
        TypeError: If ``G`` is not a real floating-point tensor.
        ValueError: If ``G`` is not a finite, square, symmetric matrix.

    Example:
        >>> import torch
        >>> import torchgram.weighting as weighting
        >>> J = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
        >>> weighting.sum(J @ J.T)
        tensor([1., 1., 1.])
    """
    G = check_gramian(G, "sum")
    return torch.ones(G.shape[0], dtype=G.dtype, device=G.device)
