"""UPGrad (Quinton & Rey, 2024): average of the rows of J projected onto their dual cone."""

from __future__ import annotations

from torch import Tensor

from torchgram._core.functional import public_math

from ._derivatives import refusing_derivatives
from ._dual_cone import projected_preferences
from ._warm_start import WarmStart


@refusing_derivatives("upgrad")
@public_math  # NOTE [autocast], NOTE [the caller's function modes]
def upgrad(
    G: Tensor,
    /,
    *,
    norm_eps: float = 1e-4,
    reg_eps: float = 1e-4,
    state: WarmStart | None = None,
) -> Tensor:
    r"""Weights of UPGrad: the mean of the rows of ``J`` projected onto their dual cone.

    From "Jacobian Descent for Multi-Objective Optimization" (Quinton & Rey, 2024,
    https://arxiv.org/abs/2406.16232). Each row ``g_i = Jᵀe_i`` is projected onto the dual cone
    ``{x : J x ≥ 0}`` (the directions that do not increase any loss to first order) and the
    projections are averaged. By Proposition 1 of the paper, in terms of ``G = J Jᵀ`` only:

    .. math::

        w = \frac{1}{m} \sum_{i=1}^m v_i, \qquad
        v_i = \operatorname*{argmin}_{v \ge e_i} v^\top \hat G v, \qquad
        \hat G = \frac{G}{\operatorname{tr} G} + \varepsilon_{\text{reg}} I,

    so that ``Jᵀw`` is the UPGrad update, and ``J Jᵀ w ≥ 0`` up to the regularisation. The
    normalisation and regularisation follow torchjd's ``UPGradWeighting`` (with its default mean
    preference vector); this function agrees with it to about 1e-12 in float64.

    The ``m`` quadratic programs are solved together, as batched tensor code on ``G``'s device,
    by primal-dual active-set steps whose face systems are solved by batched Cholesky
    factorisations (one per distinct face: the per-sample Gramians of a classifier share them
    class by class; from ``m = 32`` on, from faces guessed by a few ADMM iterations with one
    shared inverse) for ``m < 96``, for ``m < 1024`` when ``G`` has a low effective rank
    (rank-deficient, ill-conditioned, per-sample training Gramians), and at any ``m`` when two
    probed projections show that the default start is right (rank-1 Gramians); otherwise by batched
    conjugate gradients (one ``[m, m] × [m, m]`` GEMM per iteration, mostly in float32). Either
    way every answer is exact to float64 round-off: each projection ``v_i`` is certified by its
    relative KKT residual ``ρ ≤ 1e-13``, which bounds its error by ``ρ ‖σ_i‖₂ / reg_eps`` (NOTE
    [KKT certificate] in ``torchgram/weighting/_kkt.py``; NOTE [choosing the non-negative QP
    solver] in ``_nonneg.py``). With a ridge below the default on a nearly singular Gramian
    the direct solver's face systems are ill-conditioned and ``ρ`` goes past 1e-13: up to
    2.4e-13 for ``reg_eps`` from 1e-6 to 1e-9 on near-duplicate rows of opposite signs (m =
    256; the weights within 1e-9 of torchjd's quadprog, session 66's hunt), and up to 1e-8 for
    ``reg_eps ≤ 1e-10`` with exactly opposite rows (session 58's hunt: the weights still
    within 5e-7 of the 40-digit answer, closer than torchjd's quadprog).

    Args:
        G: The Gramian ``J Jᵀ`` of shape ``[m, m]``, symmetric positive semi-definite.
        norm_eps: If ``trace(G) < norm_eps``, ``G`` is treated as zero (then ``Ĝ = reg_eps · I``
            and the weights are uniform, ``1 / m``).
        reg_eps: Ridge added to the diagonal of the trace-normalised Gramian; it makes the QPs
            strictly convex, so that rank-deficient Gramians have a unique answer. With
            ``reg_eps = 0`` and a singular ``G`` the answer is one of the minimisers.
        state: A :class:`WarmStart` that a training loop passes to every call: the solver then
            starts from the previous call's projections, which saves most of its iterations
            when consecutive Gramians are close. The result does not depend on it.

    Returns:
        The weights ``w``, shape ``[m]``, with ``G``'s dtype and device, all ``≥ 1 / m``. They are
        not differentiable with respect to ``G``.

    Raises:
        NotImplementedError: If a derivative reaches the weights through ``G`` (a backward,
            ``torch.func.grad`` or ``jvp``: pass ``G.detach()`` to hold them constant), or
            ``G`` is batched by ``torch.func.vmap``.
        TypeError: If ``G`` is not a real floating-point tensor, or ``state`` not a WarmStart.
        ValueError: If ``G`` is not a finite, square, symmetric matrix, or an eps is negative.

    Example:
        Two conflicting gradients: the first row is projected so that it no longer increases
        the second loss, and vice versa.

        >>> import torch
        >>> import torchgram.weighting as weighting
        >>> J = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
        >>> w = weighting.upgrad(J @ J.T)
        >>> w
        tensor([0.9999, 0.7500], dtype=torch.float64)
        >>> weighting.upgrad(J @ J.T, reg_eps=0.0)  # The exact projections, without the ridge.
        tensor([1.0000, 0.7500], dtype=torch.float64)
        >>> bool((J @ (J.T @ w) >= 0).all())  # Jᵀw conflicts with no row.
        True
    """
    V = projected_preferences(G, "upgrad", norm_eps, reg_eps, None, state)  # U = I
    return V.mean(dim=0).to(G.dtype) if V.numel() else G.new_zeros(0)
