"""A lean first pass for many non-negative QPs sharing ``H``: synchronous active-set CG rounds.

NOTE [synchronous CG rounds]
Solves ``min_x ½ xᵀHx + qᵀx`` subject to ``x ≥ 0`` for ``k`` vectors ``q`` (UPGrad: ``k = m``)
with the same ideas as the CG solver of ``_cg_qp.py`` (NOTE [batched CG active-set solver]):
primal-dual active-set (PDAS) faces, conjugate gradients on the faces with one ``[k, m] × [m, m]``
GEMM per iteration for all problems, float32 iterations refined in float64, every answer
certified by its KKT residual (NOTE [KKT certificate]). What differs is the bookkeeping, which
there costs as much as the GEMMs below ``m ≈ 512`` (thousands of small tensor operations per
call: every problem changes its face and ends its rounds on its own schedule, each change
gathering and scattering its state). Here all problems live in one batch and move in step:

* A *round* starts, for every problem left, from its float64 iterate ``x ≥ 0``: ``s = Hx + q``
  in float64 (one GEMM), the certificate ``ρ`` from it, the face ``F = {x > 0} ∪ {s < -tol σ}``
  (the PDAS step: negative multipliers join, variables clamped to zero leave), then CG in
  ``work_dtype`` on ``H_FF δ_F = -s_F`` in units of ``|s_F|`` (iterative refinement: each round
  solves for the correction to the float64 residual, so float32 iterations reach float64
  round-off in a few rounds). The round's iterate is ``x + δ`` clamped to ``x ≥ 0``.
* A round ends, for all problems at once, when at least half of them have either reduced their
  face residual by ``_REDUCTION`` (what ``work_dtype`` can resolve) or shown a wrong sign
  (``x + δ < 0`` on the face or ``s + Hδ < 0`` off it, beyond the working precision's noise),
  checked every ``_CHECK_EVERY`` iterations with one host synchronisation; or after
  ``_ROUND_ITERATIONS``. The other problems simply keep iterating until then: their work is
  never wasted, the next round starts from where they stand.
* Problems certified (``ρ ≤ tol``) leave the batch at a round's start, as do those whose
  largest KKT violation has not halved in ``_STALLED_ROUNDS`` rounds (PDAS cycling, or float32
  CG unable to make progress on an ill-conditioned face): those, and whatever is left after
  ``max_iterations``, are handed back uncertified with their last iterate, for the caller to
  finish with the solvers of ``_cg_qp.py`` and ``_qp.py``. So are all problems when, before any
  is certified, ``_CHURN_ROUNDS`` rounds in a row end at their first check (faces that keep
  changing: PDAS cycling on rank-deficient or ill-conditioned Gramians).
* ``σ`` (the magnitudes summed into ``s``) takes one more GEMM; it changes little from round to
  round, so it is recomputed only when the residual it gives is within ``_RECOMPUTE_SIGMA`` of
  ``tol``, and a problem is certified only with ``σ`` computed at its returned point.

So a round costs one float64 GEMM (two near the end) and about twenty elementwise operations
on the whole batch, and a CG iteration one float32 GEMM and about ten. For UPGrad on random
Gramians: 42 to 51 iterations in 5 to 7 rounds for m = 64 to 1024 (the solver of ``_cg_qp.py``:
54 to 60), 1.2 to 1.9 times faster than it. On Gramians of low effective rank (rank-deficient,
ill-conditioned, per-sample training Gramians) the faces are ill-conditioned and the rounds
certify nothing: they churn and hand everything back after 12 iterations, and
``_nonneg.solve_nonneg`` does not call them there (NOTE [choosing the non-negative QP solver]).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._kkt import KKT_TOL, violations

# A round ends for a problem once its face residual has shrunk by this factor (float32 resolves
# about 1e-7 of a residual on faces whose condition number is of order ten) ...
_REDUCTION = {torch.float32: 1e-5, torch.float64: 1e-13}
# ... and for all problems once at least this fraction of them are done with it (or have
# wrong signs), checked every _CHECK_EVERY iterations, or after _ROUND_ITERATIONS iterations.
_ROUND_QUORUM = 0.5
_CHECK_EVERY = 3
_ROUND_ITERATIONS = 30
# A problem whose largest KKT violation has not halved in this many rounds in a row is handed
# back.
_STALLED_ROUNDS = 3
# Before any problem is certified, this many rounds in a row ending at their first check hand
# every problem back: the faces keep changing (PDAS cycling on hard problems; random Gramians
# take two or three such rounds).
_CHURN_ROUNDS = 4
# The magnitudes σ are recomputed once the residual they give is within this factor of tol.
_RECOMPUTE_SIGMA = 100.0


def solve_nonneg_qp_sync(
    H: Tensor,
    q: Tensor,
    *,
    x0: Tensor | None = None,
    tol: float = KKT_TOL,
    max_iterations: int = 64,
    work_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor, int]:
    """Solves ``min_x ½ xᵀHx + qᵀx`` s.t. ``x ≥ 0`` for the rows of ``q``, as far as it cheaply can.

    See NOTE [synchronous CG rounds] at the top of this module.

    Args:
        H: Symmetric positive-definite float64 matrix of shape ``[m, m]``, preferably with a
            diagonal of about one (a diagonal rescaling; signs and rounds are judged relative to
            the magnitudes of the entries).
        q: Float64 tensor of shape ``[k, m]``: one linear term per problem.
        x0: Initial iterate, float64 ``[k, m]`` (default zero); negative entries are clamped.
        tol: The relative KKT residual a solution is certified to (NOTE [KKT certificate]).
        max_iterations: CG iterations after which the problems left are handed back.
        work_dtype: Dtype of the CG iterations.

    Returns:
        The solutions ``x ≥ 0`` (float64 ``[k, m]``; where not certified, the last iterate, to
        start another solver from), which of them are certified (boolean ``[k]``), and the
        number of CG iterations run.

    Example:
        >>> import torch
        >>> H = torch.tensor([[2.0, -1.0], [-1.0, 2.0]], dtype=torch.float64)
        >>> q = torch.tensor([[-2.0, 2.0], [1.0, 1.0]], dtype=torch.float64)
        >>> x, certified, _ = solve_nonneg_qp_sync(H, q)
        >>> x, certified
        (tensor([[1., 0.],
                [0., 0.]], dtype=torch.float64), tensor([True, True]))
    """
    k, m = q.shape
    solution = torch.zeros_like(q) if x0 is None else x0.clamp(min=0.0)
    certified = torch.zeros(k, dtype=torch.bool, device=q.device)
    if k == 0 or m == 0:
        return solution, torch.ones_like(certified), 0
    H_work, H_abs = H.to(work_dtype), H.abs().to(work_dtype)
    q_abs = q.abs().to(work_dtype)
    rows = torch.arange(k, device=q.device)
    x = solution.clone()
    best = torch.full((k,), torch.inf, dtype=H.dtype, device=H.device)
    stalls = torch.zeros(k, dtype=torch.int64, device=H.device)
    # The magnitudes summed into s (NOTE [KKT certificate]), and whether they are those at x.
    sigma = q_abs if x0 is None else torch.addmm(q_abs, x.to(work_dtype), H_abs)
    stale = False
    iterations = churn = 0
    any_certified = False
    while True:
        s = torch.addmm(q, x, H)  # Float64: the certificate and the round's residual.
        violation = violations(x, s)
        residual = _relative(violation, sigma)
        # σ is a magnitude, which a round changes little: it is recomputed at x (one more
        # GEMM) only when the residual it gives is close enough to certify something.
        if stale and bool((residual <= _RECOMPUTE_SIGMA * tol).any()):  # Host synchronisation.
            sigma = torch.addmm(q_abs, x.to(work_dtype), H_abs)
            residual = _relative(violation, sigma)
            stale = False
        solved = (residual <= tol) & (not stale)
        # Progress is measured on the largest violation itself (a stale σ would blur it).
        largest = violation.amax(dim=-1)
        stalls = torch.where(largest <= 0.5 * best, 0, stalls + 1)
        best = torch.minimum(best, largest)
        leaving = solved | (stalls >= _STALLED_ROUNDS)
        if iterations >= max_iterations or churn >= _CHURN_ROUNDS:
            leaving = torch.ones_like(leaving)
        n_leaving, n_solved = torch.stack([leaving.sum(), solved.sum()]).tolist()  # Host sync.
        any_certified |= n_solved > 0
        if n_leaving:
            solution.index_copy_(0, rows[leaving], x[leaving])
            certified.index_copy_(0, rows[leaving], solved[leaving])
            if n_leaving == rows.shape[0]:
                return solution, certified, iterations
            left = (~leaving).nonzero().squeeze(-1)
            rows, q, q_abs, x, s, sigma = (tensor.index_select(0, left) for tensor in
                                           (rows, q, q_abs, x, s, sigma))
            best, stalls = best.index_select(0, left), stalls.index_select(0, left)
        free = (x > 0) | (s < -tol * sigma.to(H.dtype))
        step, count = _cg_round(H_work, x, s, free, sigma, tol, max_iterations - iterations)
        iterations += count
        churn = churn + 1 if count <= _CHECK_EVERY and not any_certified else 0
        x = x.add_(step).clamp_(min=0.0)
        stale = True


def _relative(violation: Tensor, sigma: Tensor) -> Tensor:
    """The relative KKT residual ``ρ`` of each problem (NOTE [KKT certificate]), float64."""
    tiny = torch.finfo(violation.dtype).tiny
    return (violation / sigma.to(violation.dtype).clamp(min=tiny)).amax(dim=-1)


def _cg_round(H: Tensor, x: Tensor, s: Tensor, free: Tensor, sigma: Tensor, tol: float,
              budget: int) -> tuple[Tensor, int]:
    """One round of NOTE [synchronous CG rounds]: the float64 step ``δ`` and the iterations run.

    ``H`` in the working dtype; ``x``, ``s`` float64 (``s = Hx + q``); ``sigma`` the magnitudes
    summed into ``s``, in the working dtype; ``tol`` the residual the caller certifies. CG on
    ``H_FF δ̂_F = r̂_F`` with ``r = -s_F`` and ``r̂ = r / |r|_∞``, so that nothing underflows once
    ``r`` is tiny; ``δ = |r|_∞ δ̂``.
    """
    work = H.dtype
    tiny = torch.finfo(work).tiny
    noise = torch.finfo(work).eps ** 0.5
    on_face = free.to(work)
    off_face = 1.0 - on_face
    s_work, x_work = s.to(work), x.to(work)
    r = torch.mul(s_work, on_face).neg_()
    scale = r.abs().amax(dim=-1, keepdim=True).clamp_(min=tiny)
    r.div_(scale)
    # A sign is wrong where  x + |r| δ̂ < -noise max|x|  on the face, and where
    # s + |r| (H δ̂) < -noise σ  off it: where  bound + δ̂ (on) + H δ̂ (off)  is negative.
    bound = torch.add(x_work, x_work.amax(dim=-1, keepdim=True), alpha=noise).mul_(on_face)
    bound.add_(torch.add(s_work, sigma, alpha=noise).mul_(off_face)).div_(scale)
    p = r.clone()
    rr = torch.linalg.vecdot(r, r)
    # The round may stop short of _REDUCTION where the certificate needs less: a face residual
    # below tol σ_j / 2 on every entry of the face (its 2-norm bounds them all).
    needed = sigma.masked_fill(~free, torch.inf).amin(dim=-1, keepdim=True).mul_(0.5 * tol)
    target = torch.maximum(rr * _REDUCTION[work] ** 2, needed.div_(scale).squeeze(-1) ** 2)
    dx = torch.zeros_like(r)
    hdx = torch.zeros_like(r)
    count = 0
    while count < budget:
        count += 1
        ph = p @ H  # One GEMM for the whole batch; p is zero off the faces.
        alpha = (rr / torch.linalg.vecdot(p, ph).clamp(min=tiny)).unsqueeze(-1)
        dx.addcmul_(p, alpha)
        hdx.addcmul_(ph, alpha)
        r.addcmul_(ph.mul_(on_face), alpha, value=-1.0)
        rr_next = torch.linalg.vecdot(r, r)
        p.mul_((rr_next / rr.clamp(min=tiny)).unsqueeze(-1)).add_(r)
        rr = rr_next
        if count % _CHECK_EVERY == 0 or count >= _ROUND_ITERATIONS:
            wrong = torch.addcmul(bound, dx, on_face).addcmul_(hdx, off_face).amin(dim=-1) < 0
            ended = (wrong | (rr <= target)).to(work).mean()
            if count >= _ROUND_ITERATIONS or float(ended) >= _ROUND_QUORUM:  # Host sync.
                break
    return dx.to(x.dtype).mul_(scale.to(x.dtype)), count
