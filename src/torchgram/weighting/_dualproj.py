"""DualProj: the mean of the rows of J projected onto their dual cone."""

from __future__ import annotations

import torch
from torch import Tensor

from torchgram._core.functional import public_math

from ._derivatives import refusing_derivatives
from ._dual_cone import projected_preferences
from ._warm_start import WarmStart


@refusing_derivatives("dualproj")
@public_math  # NOTE [autocast], NOTE [the caller's function modes]
def dualproj(
    G: Tensor,
    /,
    *,
    norm_eps: float = 1e-4,
    reg_eps: float = 1e-4,
    state: WarmStart | None = None,
) -> Tensor:
    r"""Weights of DualProj: the mean gradient projected onto the dual cone of the rows of ``J``.

    The projection of the averaged gradient onto ``{x : J x ≥ 0}`` is Equation 11 of "Gradient
    Episodic Memory for Continual Learning" (Lopez-Paz & Ranzato, 2017,
    https://arxiv.org/abs/1706.08840); its Gramian form is Proposition 1 of Quinton & Rey (2024,
    https://arxiv.org/abs/2406.16232):

    .. math::

        w = \operatorname*{argmin}_{v \ge \mathbf{1}/m} v^\top \hat G v, \qquad
        \hat G = \frac{G}{\operatorname{tr} G} + \varepsilon_{\text{reg}} I.

    This is the UPGrad quadratic program (see :func:`upgrad`) with the single right-hand side
    ``1 / m``; normalisation, regularisation and defaults follow torchjd's ``DualProjWeighting``.
    Solved in float64, to the same certified accuracy as :func:`upgrad` (by the direct active-set
    solver below 768 losses, by the conjugate-gradient one from there on).

    Args:
        G: The Gramian ``J Jᵀ`` of shape ``[m, m]``, symmetric positive semi-definite.
        norm_eps: If ``trace(G) < norm_eps``, ``G`` is treated as zero (the weights are then
            ``1 / m``).
        reg_eps: Ridge added to the diagonal of the trace-normalised Gramian (see :func:`upgrad`).
        state: A :class:`WarmStart` that a training loop passes to every call (see
            :func:`upgrad`). The result does not depend on it.

    Returns:
        The weights ``w ≥ 1 / m``, shape ``[m]``, with ``G``'s dtype and device. They are not
        differentiable with respect to ``G``.

    Raises:
        NotImplementedError: If a derivative reaches the weights through ``G`` (a backward,
            ``torch.func.grad`` or ``jvp``: pass ``G.detach()`` to hold them constant), or
            ``G`` is batched by ``torch.func.vmap``.
        TypeError: If ``G`` is not a real floating-point tensor, or ``state`` not a WarmStart.
        ValueError: If ``G`` is not a finite, square, symmetric matrix, or an eps is negative.

    Example:
        >>> import torch
        >>> import torchgram.weighting as weighting
        >>> J = torch.tensor([[1.0, 0.0], [-2.0, 1.0]], dtype=torch.float64)
        >>> weighting.dualproj(J @ J.T)
        tensor([0.9994, 0.5000], dtype=torch.float64)

        Without the ridge, ``Jᵀw`` is the exact projection of the mean gradient ``(-0.5, 0.5)``,
        here ``(0, 0.5)``, orthogonal to the first row and in conflict with none:

        >>> w = weighting.dualproj(J @ J.T, reg_eps=0.0)
        >>> w
        tensor([1.0000, 0.5000], dtype=torch.float64)
        >>> bool((J @ (J.T @ w) >= -1e-12).all())
        True
    """
    V = projected_preferences(
        G, "dualproj", norm_eps, reg_eps,
        lambda m, H: torch.full((1, m), 1.0 / m, dtype=H.dtype, device=H.device),
        state,
    )
    return V.squeeze(0).to(G.dtype) if V.numel() else G.new_zeros(0)
