"""KKT residuals: the accuracy certificate of the non-negative QPs behind UPGrad and DualProj.

NOTE [KKT certificate]
For ``min_x ½ xᵀHx + qᵀx`` subject to ``x ≥ 0`` (``H`` symmetric positive-definite), a point
``x ≥ 0`` with multipliers ``s = Hx + q`` is the solution iff ``s_j = 0`` where ``x_j > 0`` and
``s_j ≥ 0`` where ``x_j = 0``. Every entry ``s_j`` is a sum of terms of total magnitude
``σ_j = |q_j| + (|H| x)_j``, so the *relative KKT residual*

    ρ = max_j  e_j / σ_j,      e_j = |s_j| if x_j > 0, else max(0, -s_j),

is zero exactly at the solution, and about the unit round-off ``u`` (times ``√m``) when ``s`` is
computed in floating point at the solution: it measures how far from optimal a point is, in the
units the computation itself can resolve.

It is also an error bound. Let ``e`` be the vector of the violations above, with their sign
(``e_j = s_j`` where counted, ``0`` elsewhere). Then ``x`` is the *exact* solution of the same
problem with ``q`` replaced by ``q - e`` (subtracting ``e`` zeroes every violation and keeps every
other sign), and the solution of a strongly convex QP is ``1 / λ_min(H)``-Lipschitz in ``q``, so

    ‖x - x*‖₂  ≤  ‖e‖₂ / λ_min(H)  ≤  ρ ‖σ‖₂ / λ_min(H).

For UPGrad and DualProj ``H = G / tr(G) + reg_eps · I``, so ``λ_min(H) ≥ reg_eps``: a residual
``ρ`` certifies the weights to ``ρ ‖σ‖₂ / reg_eps``. ``ρ`` is unchanged by a positive diagonal
rescaling of the problem (``H → DHD``, ``q → Dq``, ``x → D⁻¹x``), since ``s`` and ``σ`` scale alike.
"""

from __future__ import annotations

import torch
from torch import Tensor

# The residual every solution of the non-negative QPs is certified to (NOTE [KKT certificate]):
# about 450 float64 ulps, well above the round-off of computing s (≈ √m ulps, at most m ulps)
# for m up to a few thousand, and far below anything that changes the weights in practice.
KKT_TOL = 1e-13


def violations(x: Tensor, s: Tensor) -> Tensor:
    """The KKT violations of NOTE [KKT certificate]: ``|s|`` where ``x > 0``, else ``max(0, -s)``.

    Computed as ``max(-s, s · [x > 0]) + 0`` (the ``+ 0`` turns ``-0`` into ``0``): the same
    values as ``torch.where``, without its slow boolean-mask kernel on CPU.

    Example:
        >>> import torch
        >>> violations(torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([-2.0, 2.0, -3.0, 3.0]))
        tensor([2., 2., 3., 0.])
    """
    return torch.maximum(-s, s * (x > 0)).add_(0.0)


def kkt_residual(H: Tensor, q: Tensor, x: Tensor) -> Tensor:
    """The relative KKT residual ``ρ`` of NOTE [KKT certificate], for each problem of a batch.

    Args:
        H: Symmetric matrix of shape ``[m, m]``.
        q: Linear terms, shape ``[k, m]``.
        x: Candidate solutions, shape ``[k, m]``; negative entries are clamped to zero first
            (the solvers return clamped solutions).

    Returns:
        ``ρ`` for each of the ``k`` problems, shape ``[k]``, in the dtype of the inputs.

    Example:
        >>> import torch
        >>> H = torch.tensor([[2.0, -1.0], [-1.0, 2.0]], dtype=torch.float64)
        >>> q = torch.tensor([[-2.0, 2.0]], dtype=torch.float64)
        >>> kkt_residual(H, q, torch.tensor([[1.0, 0.0]], dtype=torch.float64))  # The solution.
        tensor([0.], dtype=torch.float64)
        >>> # At x = (0.5, 0): s = (-1, 1.5), and s_0 = -1 sums terms of magnitude 2 + 1.
        >>> kkt_residual(H, q, torch.tensor([[0.5, 0.0]], dtype=torch.float64))
        tensor([0.3333], dtype=torch.float64)
    """
    x = x.clamp(min=0.0)
    s = torch.addmm(q, x, H)  # H is symmetric: (Hx)ᵀ = xᵀH.
    sigma = torch.addmm(q.abs(), x, H.abs())
    ratio = violations(x, s) / sigma.clamp(min=torch.finfo(sigma.dtype).tiny)
    return ratio.amax(dim=-1) if ratio.shape[-1] else ratio.sum(dim=-1)


def error_bound(H: Tensor, q: Tensor, x: Tensor, min_eigenvalue: float) -> Tensor:
    """The certified bound ``ρ ‖σ‖₂ / λ_min(H)`` on ``‖x - x*‖₂`` (NOTE [KKT certificate]).

    Args:
        H: Symmetric positive-definite matrix of shape ``[m, m]``.
        q: Linear terms, shape ``[k, m]``.
        x: Candidate solutions, shape ``[k, m]``.
        min_eigenvalue: A lower bound on ``λ_min(H)`` (for UPGrad and DualProj: ``reg_eps``).

    Returns:
        The bound for each problem, shape ``[k]`` (``inf`` when ``min_eigenvalue`` is zero).

    Example:
        >>> import torch
        >>> H = torch.eye(2, dtype=torch.float64)
        >>> q = torch.tensor([[-1.0, 1.0]], dtype=torch.float64)
        >>> error_bound(H, q, torch.tensor([[0.9, 0.0]], dtype=torch.float64), 1.0)
        tensor([0.1000], dtype=torch.float64)
    """
    x = x.clamp(min=0.0)
    s = torch.addmm(q, x, H)
    violation = violations(x, s)
    if min_eigenvalue <= 0.0:
        return torch.full_like(violation[..., 0], torch.inf)
    return torch.linalg.vector_norm(violation, dim=-1) / min_eigenvalue
