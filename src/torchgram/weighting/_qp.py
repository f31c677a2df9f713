"""Batched solvers for the two small quadratic programs behind the Gramian weightings.

NOTE [batched QP solver]
Both problems are strictly (or merely) convex QPs in ``m`` variables with simple constraints:

* non-negative QP (dual-cone projection, used by UPGrad and DualProj)::

      min_x  ½ xᵀHx + qᵀx   subject to  x ≥ 0,

  solved for a whole batch of vectors ``q`` that share one ``H``;
* simplex QP (the min-norm point of a convex hull, used by MGDA)::

      min_w  ½ wᵀHw         subject to  w ≥ 0,  1ᵀw = 1.

They are solved in two phases, entirely with batched tensor code on ``H``'s device and with a
fixed amount of work (no data-dependent Python control flow, hence no host synchronisation):

1. ``_IPM_ITERATIONS`` iterations of Mehrotra's predictor-corrector primal-dual interior-point
   method. Every iteration is one batched Cholesky factorisation of ``H + diag(s / x)`` and two
   triangular solves. Interior-point methods converge in a number of iterations that barely
   depends on ``m`` or on the conditioning of ``H``; after the budget the duality measure
   ``μ = xᵀs / m`` is typically below 1e-20, far past what is needed to read off the active set.
2. ``_POLISH_STEPS`` steps of active-set polishing (a primal-dual active-set / semismooth Newton
   step): the free set ``F = {i : x_i > s_i}`` is read from the current point, the equality-
   constrained problem on ``F`` is solved exactly (one batched Cholesky solve), and the result
   replaces the current point for a batch element only if its KKT violation is smaller. When the
   active set is identified correctly (always the case in our tests, including rank-deficient
   ``H``), the result is exact up to float64 round-off of a Cholesky solve, i.e. about
   ``cond(H_FF) · 1e-16``; otherwise the best interior-point iterate is kept, whose KKT violation
   is of the order of ``μ``.

All arithmetic is done in float64 on purpose: the regularised Gramians of UPGrad/DualProj have a
condition number up to ``1 / reg_eps = 1e4`` and the interior-point normal matrices become much
worse than that near the solution, so float32 would lose most digits (and the reference solver,
quadprog, works in float64 too). Callers cast the result back to the Gramian's dtype.

The cost is ``O(batch · m³)`` per iteration, i.e. ``O(m⁴)`` in total for UPGrad (``m`` right-hand
sides). That is the same order as solving the ``m`` problems with a dense active-set solver.
"""

from __future__ import annotations

import torch
from torch import Tensor

_IPM_ITERATIONS = 30
_POLISH_STEPS = 3
# Fraction of the distance to the boundary of the positive orthant taken by an interior-point step.
_STEP_FRACTION = 0.99
# Jitter added to the Newton matrices of the simplex QP, relative to trace(H) / m. It only affects
# the search directions (the residuals are always evaluated with the exact H), and keeps the
# linear systems solvable when H is singular (e.g. duplicated rows of J).
_JITTER = 1e-12


def _max_step(z: Tensor, dz: Tensor) -> Tensor:
    """Largest ``α ∈ [0, 1]`` with ``z + α dz ≥ 0`` (``z > 0``), for each row of a batch."""
    ratio = torch.where(dz < 0, -z / dz.clamp(max=-torch.finfo(z.dtype).tiny), torch.inf)
    return ratio.amin(dim=-1, keepdim=True).clamp(max=1.0)


def _solve_pd(matrix: Tensor, rhs: Tensor) -> Tensor:
    """Solves ``matrix @ x = rhs`` for a batch of positive-definite matrices, without syncing."""
    factor, _ = torch.linalg.cholesky_ex(matrix)  # `_ex`: no error check, hence no host sync.
    return torch.cholesky_solve(rhs.unsqueeze(-1), factor).squeeze(-1)


def _kkt_violation(x: Tensor, s: Tensor) -> Tensor:
    """Largest violation of ``x ≥ 0``, ``s ≥ 0`` and ``x ∘ s = 0`` for each row of a batch."""
    violation = torch.stack([(-x).clamp(min=0), (-s).clamp(min=0), (x * s).abs()], dim=-1)
    return violation.amax(dim=(-2, -1))


def _keep_best(
    best: tuple[Tensor, ...], candidate: tuple[Tensor, ...], best_viol: Tensor, viol: Tensor
) -> tuple[tuple[Tensor, ...], Tensor]:
    """Row-wise selection of whichever of two batched KKT points has the smaller violation."""
    better = viol < best_viol
    chosen = tuple(
        torch.where(better.reshape(better.shape + (1,) * (b.ndim - better.ndim)), c, b)
        for b, c in zip(best, candidate, strict=True)
    )
    return chosen, torch.where(better, viol, best_viol)


def solve_nonneg_qp(H: Tensor, q: Tensor) -> Tensor:
    """Solves ``min_x ½ xᵀHx + qᵀx`` s.t. ``x ≥ 0`` for each row of ``q``.

    See NOTE [batched QP solver] at the top of this module.

    Args:
        H: Symmetric positive-definite float64 matrix of shape ``[m, m]``.
        q: Float64 tensor of shape ``[k, m]``: one linear term per problem.

    Returns:
        The minimisers, shape ``[k, m]``, non-negative.
    """
    k, m = q.shape
    diag = torch.arange(m, device=H.device)
    x = torch.ones_like(q)
    s = torch.ones_like(q)
    for _ in range(_IPM_ITERATIONS):
        grad = q + x @ H  # H is symmetric: (H x)ᵀ = xᵀ H.
        r_d = grad - s
        mu = (x * s).mean(dim=-1, keepdim=True)
        normal = H.expand(k, m, m).clone()
        normal[:, diag, diag] += s / x
        factor, _ = torch.linalg.cholesky_ex(normal)

        def direction(r_c: Tensor, factor: Tensor = factor, r_d: Tensor = r_d) -> tuple[Tensor, Tensor]:
            rhs = (r_c / x - r_d).unsqueeze(-1)
            dx = torch.cholesky_solve(rhs, factor).squeeze(-1)
            return dx, (r_c - s * dx) / x

        # Predictor (affine-scaling) step, then Mehrotra's centring-corrector step.
        dx_aff, ds_aff = direction(-x * s)
        alpha_aff = torch.minimum(_max_step(x, dx_aff), _max_step(s, ds_aff))
        mu_aff = ((x + alpha_aff * dx_aff) * (s + alpha_aff * ds_aff)).mean(dim=-1, keepdim=True)
        sigma = (mu_aff / mu.clamp(min=torch.finfo(mu.dtype).tiny)).clamp(max=1.0) ** 3
        dx, ds = direction(-x * s + sigma * mu - dx_aff * ds_aff)
        alpha = _STEP_FRACTION * torch.minimum(_max_step(x, dx), _max_step(s, ds))
        alpha = alpha.clamp(max=1.0)
        x = x + alpha * dx
        s = s + alpha * ds
        # Keep exact dual feasibility's slack in sync with x when the step was a full one.
        del grad

    best = (x, s)
    best_viol = _kkt_violation(x, s)
    for _ in range(_POLISH_STEPS):
        free = (x > s).to(H.dtype)
        # H restricted to the free set, identity on the fixed set: positive-definite.
        reduced = free.unsqueeze(-1) * H * free.unsqueeze(-2)
        reduced[:, diag, diag] += 1.0 - free
        x = _solve_pd(reduced, -free * q)
        s = q + x @ H
        best, best_viol = _keep_best(best, (x, s), best_viol, _kkt_violation(x, s))
    return best[0].clamp(min=0.0)


def solve_simplex_qp(H: Tensor) -> Tensor:
    """Solves ``min_w ½ wᵀHw`` s.t. ``w ≥ 0`` and ``Σ w = 1``.

    See NOTE [batched QP solver] at the top of this module.

    Args:
        H: Symmetric positive semi-definite float64 matrix of shape ``[m, m]``, not all zero.

    Returns:
        A minimiser of shape ``[m]`` (unique in ``Jᵀw`` but not necessarily in ``w`` when ``H``
        is singular).
    """
    m = H.shape[0]
    diag = torch.arange(m, device=H.device)
    jitter = _JITTER * H.diagonal().mean()
    ones = torch.ones(1, m, dtype=H.dtype, device=H.device)
    w = ones / m
    hw = w @ H
    nu = hw.amin(dim=-1, keepdim=True) - 1.0
    s = hw - nu  # ≥ 1, and exact dual feasibility H w - ν 1 - s = 0.
    for _ in range(_IPM_ITERATIONS):
        hw = w @ H
        r_d = hw - nu - s
        r_p = w.sum(dim=-1, keepdim=True) - 1.0
        mu = (w * s).mean(dim=-1, keepdim=True)
        normal = H.unsqueeze(0).clone()
        normal[:, diag, diag] += s / w + jitter
        factor, _ = torch.linalg.cholesky_ex(normal)
        k_ones = torch.cholesky_solve(ones.unsqueeze(-1), factor).squeeze(-1)

        def direction(
            r_c: Tensor, factor: Tensor = factor, r_d: Tensor = r_d, r_p: Tensor = r_p,
            k_ones: Tensor = k_ones,
        ) -> tuple[Tensor, Tensor, Tensor]:
            k_b = torch.cholesky_solve((r_c / w - r_d).unsqueeze(-1), factor).squeeze(-1)
            dnu = (-r_p - k_b.sum(-1, keepdim=True)) / k_ones.sum(-1, keepdim=True)
            dw = k_b + dnu * k_ones
            return dw, (r_c - s * dw) / w, dnu

        dw_aff, ds_aff, _ = direction(-w * s)
        alpha_aff = torch.minimum(_max_step(w, dw_aff), _max_step(s, ds_aff))
        mu_aff = ((w + alpha_aff * dw_aff) * (s + alpha_aff * ds_aff)).mean(dim=-1, keepdim=True)
        sigma = (mu_aff / mu.clamp(min=torch.finfo(mu.dtype).tiny)).clamp(max=1.0) ** 3
        dw, ds, dnu = direction(-w * s + sigma * mu - dw_aff * ds_aff)
        alpha = _STEP_FRACTION * torch.minimum(_max_step(w, dw), _max_step(s, ds))
        w = w + alpha * dw
        s = s + alpha * ds
        nu = nu + alpha * dnu

    best = (w, s)
    best_viol = _kkt_violation(w, s) + (w.sum(-1) - 1.0).abs()
    for _ in range(_POLISH_STEPS):
        free = (w > s).to(H.dtype)
        reduced = free.unsqueeze(-1) * H * free.unsqueeze(-2)
        reduced[:, diag, diag] += 1.0 - free + free * jitter
        direction_f = _solve_pd(reduced, free)  # H_FF a = 1_F, then w_F = a / (1ᵀa).
        w = direction_f / direction_f.sum(-1, keepdim=True)
        s = w @ H - (w @ H * w).sum(-1, keepdim=True)  # ν = wᵀHw at a KKT point.
        viol = _kkt_violation(w, s) + (w.sum(-1) - 1.0).abs()
        best, best_viol = _keep_best(best, (w, s), best_viol, viol)
    return best[0].clamp(min=0.0).squeeze(0)
