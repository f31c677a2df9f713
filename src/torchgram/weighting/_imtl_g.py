"""IMTL-G (Liu et al., 2021): the update with equal projections on every unit gradient."""

from __future__ import annotations

import torch
from torch import Tensor

from torchgram._core.functional import public_math

from ._derivatives import refusing_derivatives
from ._validation import check_gramian, check_non_negative


@refusing_derivatives("imtl_g")
@public_math  # NOTE [autocast], NOTE [the caller's function modes]
def imtl_g(G: Tensor, /, *, eps: float = 1e-12) -> Tensor:
    r"""Weights of IMTL-G: the combination whose projections on all unit gradients are equal.

    From "Towards Impartial Multi-task Learning" (Liu et al., ICLR 2021,
    https://openreview.net/forum?id=IMPnRXEWpvr), in the form generalised to linearly dependent
    rows by Quinton & Rey (2024, https://arxiv.org/abs/2406.16232). IMTL-G looks for ``d = Jᵀw``
    with ``⟨d, g_i / |g_i|⟩`` the same for every row ``g_i`` of ``J``, i.e. ``G w ∝ n`` where
    ``n_i = |g_i| = sqrt(G_ii)``:

    .. math::

        v = G^{+} n, \qquad w = \frac{v}{\mathbf 1^\top v}
        \quad (w = 0 \text{ if } |\mathbf 1^\top v| \le \varepsilon),

    where ``G⁺`` is the Moore–Penrose pseudo-inverse. As in torchjd's ``IMTLGWeighting`` (which
    calls ``torch.linalg.pinv`` with its default cut-off), singular values of ``G`` below
    ``m · eps(G.dtype) · σ_max`` are treated as zero. When no eigenvalue of ``G`` comes near
    that cut-off the pseudo-inverse is the inverse, applied by Cholesky factorisations
    (``O(m³ / 3)``, a few tens of milliseconds for ``m = 1024`` on one CPU thread); otherwise it
    is formed from the SVD (about twenty times slower). The pseudo-inverse is
    computed in float64, with that cut-off taken from ``G``'s own dtype so that float32
    round-off in ``G`` is not mistaken for information; for a float64 ``G`` this is torchjd's
    computation, and for a float32 one it is more
    accurate (torchjd inverts in float32, with errors up to ``cond(G) · 6e-8``).

    Args:
        G: The Gramian ``J Jᵀ`` of shape ``[m, m]``, symmetric positive semi-definite.
        eps: If ``|Σ v| ≤ eps`` the weights are all zero (e.g. for a zero Gramian, or rows
            that cancel). The default is torchjd's. The weights are scale-invariant in ``G``,
            but ``eps`` is not. With ``eps = 0`` only an exactly zero sum gives zeros (with
            ``<``, as before session 58, it gave NaN or infinite weights).

    Returns:
        The weights ``w`` (summing to one unless they are all zero), shape ``[m]``, with ``G``'s
        dtype and device. They are not differentiable with respect to ``G``.

    Raises:
        NotImplementedError: If a derivative reaches the weights through ``G`` (a backward,
            ``torch.func.grad`` or ``jvp``: pass ``G.detach()`` to hold them constant), or
            ``G`` is batched by ``torch.func.vmap``.
        TypeError: If ``G`` is not a real floating-point tensor.
        ValueError: If ``G`` is not a finite, square, symmetric matrix, or ``eps`` is negative.

    Example:
        >>> import torch
        >>> import torchgram.weighting as weighting
        >>> J = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
        >>> w = weighting.imtl_g(J @ J.T)
        >>> w
        tensor([0.5858, 0.4142], dtype=torch.float64)
        >>> projections = (J @ (J.T @ w)) / J.norm(dim=1)  # on the unit gradients
        >>> torch.allclose(projections, torch.ones(2, dtype=torch.float64))  # all equal
        True
    """
    G = check_gramian(G, "imtl_g")
    eps = check_non_negative(eps, "eps", "imtl_g")
    m = G.shape[0]
    if m == 0:
        return G.new_zeros(0)
    G64 = G.to(torch.float64)  # float64: the pseudo-inverse amplifies round-off by cond(G).
    norms = G64.diagonal().clamp(min=0.0).sqrt()
    rtol = m * torch.finfo(G.dtype).eps
    v = _solve_if_well_conditioned(G64, norms, rtol)
    if v is None:
        # The pseudo-inverse from the SVD, as torchjd's: an eigendecomposition (hermitian=True,
        # twice as fast) lost the vectors of the small kept eigenvalues of graded Gramians (rows
        # of norms 1e-6 to 1e6: 1e-4 to 2e-2 off the 50-digit answer, the SVD 1e-10 to 2e-7;
        # a trained MLP's per-sample Gramian: 9e-3 against 1e-5; a helper's hunt, session 57).
        v = torch.linalg.pinv(G64, rtol=rtol) @ norms
    total = v.sum()
    weights = torch.where(total.abs() <= eps, torch.zeros_like(v), v / total)
    return weights.to(G.dtype)


def _solve_if_well_conditioned(G: Tensor, b: Tensor, rtol: float) -> Tensor | None:
    """``G⁻¹ b`` by Cholesky if no eigenvalue of ``G`` is near the pinv cut-off, else ``None``.

    ``torch.linalg.pinv`` drops the eigenvalues below ``rtol · λ_max``; if ``G - 2 rtol tr(G) I``
    is positive-definite (its Cholesky factorisation succeeds), every eigenvalue is above twice
    that cut-off (``λ_max ≤ tr(G)``), up to the round-off of the factorisation, so ``G⁺ = G⁻¹``
    and two Cholesky factorisations (one for this test) replace an SVD, about twenty times
    slower. One host synchronisation (the test's outcome).
    """
    shift = 2.0 * rtol * G.diagonal().sum()
    _, info = torch.linalg.cholesky_ex(G - shift * torch.eye(G.shape[0], dtype=G.dtype,
                                                             device=G.device))
    if bool(info != 0):  # Host synchronisation.
        return None
    factor, info = torch.linalg.cholesky_ex(G)
    if bool(info != 0):  # Host synchronisation (does not happen: G is above the shifted one).
        return None
    return torch.cholesky_solve(b.unsqueeze(-1), factor).squeeze(-1)
