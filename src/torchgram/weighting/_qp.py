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
   method (``s`` is the dual slack: ``s = Hx + q``, resp. ``Hw - ν1``). Every iteration is one
   batched Cholesky factorisation of ``H + diag(s / x)`` and two pairs of triangular solves.
   Interior-point methods converge in a number of iterations that barely depends on ``m`` or on
   the conditioning of ``H``: on random, rank-deficient and duplicated-row Gramians 16 iterations
   already suffice; 30 leave a margin for badly scaled, degenerate problems (row norms of ``J``
   spread over 8 orders of magnitude needed 28).
2. ``_POLISH_STEPS`` steps of active-set polishing (primal-dual active-set, i.e. semismooth
   Newton, steps): the free set ``F = {i : x_i > s_i}`` is read from the current point and the
   problem with ``x_i = 0`` off ``F`` and no constraint on ``F`` is solved exactly (one batched
   Cholesky solve). Its solution satisfies complementarity by construction, so if it is also
   feasible (``x ≥ 0`` and ``s ≥ 0`` up to ``_FEASIBILITY_TOL``) it *is* the solution, up to the
   round-off of a Cholesky solve (about ``cond(H_FF) · 1e-16``), and it is kept for that batch
   element; otherwise the next step starts from it. An element that no step polishes keeps its
   interior-point iterate, whose error is then of the order of ``sqrt(μ)``.

Tolerance: against quadprog (the exact active-set solver torchjd uses) the solutions agree to
about 1e-12 on random Gramians with ``m ≤ 64``, rank-deficient ones included, and to 1e-10 on
the badly scaled degenerate ones above (tests/weighting/test_weighting_qp.py checks against an
exhaustive active-set enumeration and the KKT conditions).

All arithmetic is done in float64 on purpose: the regularised Gramians of UPGrad/DualProj have a
condition number up to ``1 / reg_eps = 1e4`` and the interior-point normal matrices become much
worse than that near the solution, so float32 would lose most digits (and the reference solver,
quadprog, works in float64 too). Callers cast the result back to the Gramian's dtype.

The cost is ``O(batch · m³)`` per iteration, i.e. ``O(m⁴)`` in total for UPGrad (``m`` right-hand
sides), about 60 ms for ``m = 64`` on one CPU core: the same order as solving the ``m`` problems
one after the other with a dense active-set solver, but in a handful of large batched kernels.
The batch is processed in chunks of at most ``_MAX_BATCH_ENTRIES / m²`` problems, which bounds
the memory of the ``[batch, m, m]`` normal matrices.
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
# Round-off allowed on the sign constraints of an active-set solution (the data have unit trace).
_FEASIBILITY_TOL = 1e-10
# Largest number of float64 entries of one [batch, m, m] tensor (2**24: 128 MiB).
_MAX_BATCH_ENTRIES = 2**24


def _max_step(z: Tensor, dz: Tensor) -> Tensor:
    """Largest ``α ∈ [0, 1]`` with ``z + α dz ≥ 0`` (given ``z > 0``), for each row of a batch."""
    ratio = torch.where(dz < 0, -z / dz.clamp(max=-torch.finfo(z.dtype).tiny), torch.inf)
    return ratio.amin(dim=-1, keepdim=True).clamp(max=1.0)


def _mehrotra_step_size(
    x: Tensor, s: Tensor, affine: tuple[Tensor, Tensor]
) -> tuple[Tensor, Tensor]:
    """Mehrotra's centring parameter ``σ`` and duality measure ``μ`` from the affine step."""
    dx, ds = affine
    mu = (x * s).mean(dim=-1, keepdim=True)
    alpha = torch.minimum(_max_step(x, dx), _max_step(s, ds))
    mu_affine = ((x + alpha * dx) * (s + alpha * ds)).mean(dim=-1, keepdim=True)
    sigma = (mu_affine / mu.clamp(min=torch.finfo(mu.dtype).tiny)).clamp(max=1.0) ** 3
    return sigma, mu


def _add_to_diagonal(matrix: Tensor, values: Tensor) -> Tensor:
    """Returns ``matrix + diag_embed(values)`` for a batch of square matrices (out of place)."""
    out = matrix.clone()
    out.diagonal(dim1=-2, dim2=-1).add_(values)
    return out


def _cholesky_solve(factor: Tensor, rhs: Tensor) -> Tensor:
    """Solves ``L Lᵀ x = rhs`` for a batch of vectors ``rhs`` given the Cholesky factors ``L``."""
    # Two triangular solves: the same as torch.cholesky_solve, without its copies of the factors.
    y: Tensor = torch.linalg.solve_triangular(factor, rhs.unsqueeze(-1), upper=False)
    x: Tensor = torch.linalg.solve_triangular(factor.transpose(-2, -1), y, upper=True)
    return x.squeeze(-1)


def _is_feasible(x: Tensor, s: Tensor) -> Tensor:
    """Whether ``x ≥ 0`` and ``s ≥ 0`` up to round-off, for each row of a batch.

    Used on active-set solutions, which satisfy complementarity by construction, so feasibility
    makes them KKT points. The tolerance is absolute: the QPs here have trace-normalised data.
    """
    return (x >= -_FEASIBILITY_TOL).all(dim=-1) & (s >= -_FEASIBILITY_TOL).all(dim=-1)


def _where_rows(condition: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """Row-wise ``torch.where`` for a batch of vectors and a per-row condition."""
    return torch.where(condition.unsqueeze(-1), a, b)


def solve_nonneg_qp(H: Tensor, q: Tensor) -> Tensor:
    """Solves ``min_x ½ xᵀHx + qᵀx`` s.t. ``x ≥ 0`` for each row of ``q``.

    See NOTE [batched QP solver] at the top of this module.

    Args:
        H: Symmetric positive-definite float64 matrix of shape ``[m, m]``.
        q: Float64 tensor of shape ``[k, m]``: one linear term per problem.

    Returns:
        The minimisers, shape ``[k, m]``, non-negative.
    """
    m = q.shape[-1]
    chunk = max(1, _MAX_BATCH_ENTRIES // max(m * m, 1))
    if q.shape[0] > chunk:
        return torch.cat([_solve_nonneg_qp(H, part) for part in torch.split(q, chunk)])
    return _solve_nonneg_qp(H, q)


def _solve_nonneg_qp(H: Tensor, q: Tensor) -> Tensor:
    """:func:`solve_nonneg_qp` for one chunk of right-hand sides."""
    k, m = q.shape
    batch_H = H.expand(k, m, m)
    x = torch.ones_like(q)
    s = torch.ones_like(q)
    for _ in range(_IPM_ITERATIONS):
        # Newton step on  Hx + q - s = 0,  x ∘ s = σμ:  (H + S/X) dx = r_c / x - r_d.
        r_d = q + x @ H - s  # H is symmetric: (H x)ᵀ = xᵀ H.
        factor, _ = torch.linalg.cholesky_ex(_add_to_diagonal(batch_H, s / x))
        r_c = -x * s
        dx_aff = _cholesky_solve(factor, r_c / x - r_d)
        ds_aff = (r_c - s * dx_aff) / x
        sigma, mu = _mehrotra_step_size(x, s, (dx_aff, ds_aff))
        r_c = r_c + sigma * mu - dx_aff * ds_aff
        dx = _cholesky_solve(factor, r_c / x - r_d)
        ds = (r_c - s * dx) / x
        alpha = _STEP_FRACTION * torch.minimum(_max_step(x, dx), _max_step(s, ds))
        x = x + alpha * dx
        s = s + alpha * ds

    solution = x
    polished = torch.zeros(k, dtype=torch.bool, device=H.device)
    for _ in range(_POLISH_STEPS):
        free = (x > s).to(H.dtype)
        # H restricted to the free set, identity on the fixed set: positive-definite.
        reduced = _add_to_diagonal(free.unsqueeze(-1) * batch_H * free.unsqueeze(-2), 1.0 - free)
        factor, _ = torch.linalg.cholesky_ex(reduced)
        x = _cholesky_solve(factor, -free * q)
        s = q + x @ H
        # x_A = 0 and s_F = 0 hold by construction: it is the solution if it is feasible.
        feasible = _is_feasible(x, s)
        solution = _where_rows(feasible & ~polished, x, solution)
        polished = polished | feasible
    return solution.clamp(min=0.0)


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
    jitter = _JITTER * H.diagonal().mean()
    ones = torch.ones(1, m, dtype=H.dtype, device=H.device)
    w = ones / m
    nu = (w @ H).amin(dim=-1, keepdim=True) - 1.0
    s = w @ H - nu  # ≥ 1, and exact dual feasibility  H w - ν 1 - s = 0.
    for _ in range(_IPM_ITERATIONS):
        # Newton step on  Hw - ν1 - s = 0,  1ᵀw = 1,  w ∘ s = σμ. With K = H + S/W:
        # dw = K⁻¹ b + dν K⁻¹ 1  where  b = r_c / w - r_d,  and dν makes 1ᵀ dw = -r_p.
        r_d = w @ H - nu - s
        r_p = w.sum(dim=-1, keepdim=True) - 1.0
        factor, _ = torch.linalg.cholesky_ex(_add_to_diagonal(H.unsqueeze(0), s / w + jitter))
        k_ones = _cholesky_solve(factor, ones)
        k_ones_sum = k_ones.sum(dim=-1, keepdim=True)
        r_c = -w * s
        k_b = _cholesky_solve(factor, r_c / w - r_d)
        dw_aff = k_b + (-r_p - k_b.sum(dim=-1, keepdim=True)) / k_ones_sum * k_ones
        ds_aff = (r_c - s * dw_aff) / w
        sigma, mu = _mehrotra_step_size(w, s, (dw_aff, ds_aff))
        r_c = r_c + sigma * mu - dw_aff * ds_aff
        k_b = _cholesky_solve(factor, r_c / w - r_d)
        dnu = (-r_p - k_b.sum(dim=-1, keepdim=True)) / k_ones_sum
        dw = k_b + dnu * k_ones
        ds = (r_c - s * dw) / w
        alpha = _STEP_FRACTION * torch.minimum(_max_step(w, dw), _max_step(s, ds))
        w = w + alpha * dw
        s = s + alpha * ds
        nu = nu + alpha * dnu

    solution = w
    polished = torch.zeros(1, dtype=torch.bool, device=H.device)
    for _ in range(_POLISH_STEPS):
        free = (w > s).to(H.dtype)
        # On the free set H_FF w_F = ν 1_F, so w_F ∝ H_FF⁻¹ 1_F, scaled to sum to one.
        reduced = free.unsqueeze(-1) * H * free.unsqueeze(-2)
        factor, _ = torch.linalg.cholesky_ex(_add_to_diagonal(reduced, 1.0 - free + free * jitter))
        direction = _cholesky_solve(factor, free)
        w = direction / direction.sum(dim=-1, keepdim=True)
        hw = w @ H
        s = hw - (hw * w).sum(dim=-1, keepdim=True)  # ν = wᵀHw at a KKT point.
        feasible = _is_feasible(w, s)
        solution = _where_rows(feasible & ~polished, w, solution)
        polished = polished | feasible
    return solution.clamp(min=0.0).squeeze(0)
