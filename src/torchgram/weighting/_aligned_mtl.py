"""Aligned-MTL (Senushkin et al., 2023): align the principal components of the gradients."""

from __future__ import annotations

from typing import Literal, TypeAlias

import torch
from torch import Tensor

from torchgram._core.functional import public_math

from ._derivatives import refusing_derivatives
from ._validation import check_gramian, scaled_by_a_power_of_two

ScaleMode: TypeAlias = Literal["min", "median", "rmse"]
_SCALE_MODES = ("min", "median", "rmse")


@refusing_derivatives("aligned_mtl")
@public_math  # NOTE [autocast], NOTE [the caller's function modes]
def aligned_mtl(G: Tensor, /, *, scale_mode: ScaleMode = "min") -> Tensor:
    r"""Weights of Aligned-MTL: the mean of the rows of a well-conditioned version of ``J``.

    From "Independent Component Alignment for Multi-Task Learning" (Senushkin et al., CVPR 2023,
    https://arxiv.org/abs/2305.19000), Algorithm 1. With the eigendecomposition
    ``G = V Λ Vᵀ`` restricted to its ``r`` eigenvalues above ``m · eps(G.dtype) · λ_max``,

    .. math::

        B = \sqrt{\lambda_s}\; V \Lambda^{-1/2} V^\top, \qquad w = B\, \frac{\mathbf 1}{m},

    so that ``Jᵀ B`` has orthogonal rows of equal norm ``sqrt(λ_s)`` (all singular values of the
    Jacobian made equal to one of them) and ``Jᵀw`` is the mean of those aligned rows. The scale
    ``λ_s`` is the smallest kept eigenvalue (``"min"``, the default, as in the paper's
    Algorithm 1 and torchjd), their (lower) median (``"median"``) or their mean (``"rmse"``, as
    in the authors' code). A zero Gramian gives ``B = I``, i.e. ``w = 1 / m``. This matches
    torchjd's ``AlignedMTLWeighting`` with its default mean preference vector; the
    eigendecomposition is done in float64, since ``λ_s`` can be much smaller than ``λ_max``.

    Args:
        G: The Gramian ``J Jᵀ`` of shape ``[m, m]``, symmetric positive semi-definite.
        scale_mode: ``"min"``, ``"median"`` or ``"rmse"``: which eigenvalue sets the scale.

    Returns:
        The weights ``w``, shape ``[m]``, with ``G``'s dtype and device. They are not
        differentiable with respect to ``G``.

    Raises:
        NotImplementedError: If a derivative reaches the weights through ``G`` (a backward,
            ``torch.func.grad`` or ``jvp``: pass ``G.detach()`` to hold them constant), or
            ``G`` is batched by ``torch.func.vmap``.
        TypeError: If ``G`` is not a real floating-point tensor.
        ValueError: If ``G`` is not a finite, square, symmetric matrix, or ``scale_mode`` is
            unknown.

    Example:
        Orthogonal rows of norms 1 and 2 are rescaled to the smaller norm:

        >>> import torch
        >>> import torchgram.weighting as weighting
        >>> J = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
        >>> weighting.aligned_mtl(J @ J.T)
        tensor([0.5000, 0.2500])
    """
    G = check_gramian(G, "aligned_mtl")
    if scale_mode not in _SCALE_MODES:
        raise ValueError(
            f"torchgram.weighting.aligned_mtl: expected scale_mode to be one of {_SCALE_MODES}, "
            f"got {scale_mode!r}."
        )
    m = G.shape[0]
    if m == 0:
        return G.new_zeros(0)
    # G · 2^-e (the weights do not depend on the scale): m · λ_max cannot overflow below
    eigenvalues, eigenvectors = torch.linalg.eigh(
        scaled_by_a_power_of_two(G.to(torch.float64))[0], UPLO="U")  # Ascending.
    kept = eigenvalues > eigenvalues.amax() * m * torch.finfo(G.dtype).eps
    rank = kept.sum()
    safe = torch.where(kept, eigenvalues, 1.0)
    inverse_sqrt = torch.where(kept, safe.rsqrt(), 0.0)
    # The kept eigenvalues are the last `rank` ones; all selections below avoid a host sync.
    if scale_mode == "min":
        scale = torch.where(kept, eigenvalues, torch.inf).amin()
    elif scale_mode == "median":
        lower_median = (m - rank + (rank - 1).clamp(min=0) // 2).clamp(max=m - 1)
        scale = eigenvalues.index_select(0, lower_median.reshape(1)).squeeze(0)
    else:
        scale = torch.where(kept, eigenvalues, 0.0).sum() / rank.clamp(min=1)
    scale = torch.where(rank > 0, scale, 1.0).clamp(min=0.0)
    uniform = torch.full((m,), 1.0 / m, dtype=eigenvalues.dtype, device=eigenvalues.device)
    weights = scale.sqrt() * (eigenvectors @ (inverse_sqrt * (eigenvectors.T @ uniform)))
    weights = torch.where(rank > 0, weights, uniform)
    return weights.to(G.dtype)
