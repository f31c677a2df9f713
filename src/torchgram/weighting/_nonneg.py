"""One entry point for the batched non-negative QPs: the direct or the CG solvers, by size.

NOTE [choosing the non-negative QP solver]
Both solvers return the solution to float64 round-off (the direct one by its sign checks on
exact face solves, the CG one by its KKT certificate, NOTE [KKT certificate] in ``_kkt.py``);
they differ in cost. The direct solver (``_qp.py``) factorises a ``p × p`` face block per
problem and active-set round, ``p`` about half of ``m`` for UPGrad: LAPACK, one small matrix
at a time, ``O(k p³)`` per round. The CG solver (``_cg_qp.py``) costs one ``[k, m] × [m, m]``
GEMM per iteration and needs tens to hundreds of iterations. For a single problem (DualProj)
the direct solver is faster up to several hundred variables (``_CG_FROM_SINGLE``), where the
per-call overhead of tensor operations dominates both; the CG solver from there on.

For a batch of problems (UPGrad, ``k = m``) what the direct solver costs is its number of rounds: 4
(random Gramians) to 20 (rank-deficient ones) from ``x = 0``. So it starts from the faces guessed by
a few ADMM iterations with one shared inverse (NOTE [ADMM face identification] in ``_admm.py``),
after which one round (rarely two or three, on a few problems) finishes; the answers are still its
exact, sign-checked ones. Measured on one CPU thread (w17, alternating A/B with the previous paths,
loaded machine): 2.7 to 7 times (a rerun: 4 to 11) faster at m = 64 on rank-m/2, ill-conditioned and
training Gramians, 1 to 1.6 times on random ones, but 0.6 to 0.8 times on rank-1 ones (one round
either way: the guess is extra); 2.5 to 5.5 times at m = 128 and 1.4 to 2.2 times at m = 256 on the
Gramians of low effective rank (rank-1 included), where the previous path was the CG solver (it
needs hundreds of iterations on those ill-conditioned faces). With the guess, the direct solver
stays the better one up to ``_CG_FROM_CONCENTRATED`` variables on Gramians of low effective rank.
(Session 55, once the direct solver kept the batch whole, NOTE [one batch, its faces shared] in
``_qp.py``; A/B against the CG path in one process, 1 thread, the weighting benchmark's Gramians,
medians of 3: at m = 512 the direct solver took 0.58 times the time on ill-conditioned and training
Gramians and 0.83 on rank-m/2 ones; at m = 768 0.56 on training, 0.88 on ill-conditioned and 1.43 on
rank-m/2 ones; at m = 1024 the CG solver stays, unchanged, as on random Gramians. A cold start that
holds, NOTE [cold start probe], now sends a batch to the direct solver at any size: rank-1 Gramians
14 to 21 times faster at m = 512 to 1024, 0.2 s at 1024.) On Gramians of high effective rank
(``tr(H)² / ‖H‖_F² ≥ m / 2``, as for random ones), from ``_SYNC_FROM`` variables on, the synchronous
CG rounds of ``_sync_cg.py`` (NOTE [synchronous CG rounds]) come first (all problems moving in step,
1.2 to 1.9 times faster than the CG solver at m = 128 to 1024), then the CG solver from ``_CG_FROM``
on for what they leave, then the direct one (without a guess) for the rest. Below ``_SYNC_FROM`` the
guess and the direct solver were as fast or faster on random Gramians too (m = 64: 1.07 to 1.26
times in four A/B runs; m = 96: within noise either way). On Gramians of low effective rank the
rounds' faces are ill-conditioned and they certify nothing, so they are skipped.

The CG solvers run on a diagonally rescaled problem (``H → DHD``, ``q → Dq``, ``x → D⁻¹x``: the
KKT residual does not change, NOTE [KKT certificate]) with ``D = diag(H)^{-1/3}``: a diagonal
preconditioner between none, best for a Gramian that is a multiple of the identity plus a
low-rank term (rank-1: about 20 iterations for ``m = 256``, 440 with Jacobi's ``diag^{-1/2}``),
and Jacobi's, best for gradients of very different norms (per-sample gradients late in
training; rows whose norms span four orders of magnitude: 60 iterations, 400 without). The few
problems they do not certify are solved by the direct solver.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._admm import admm_faces
from ._cg_qp import solve_nonneg_qp_cg
from ._qp import cold_start_holds, solve_nonneg_qp
from ._sync_cg import solve_nonneg_qp_sync

# A batch of problems (UPGrad) from this many variables on first goes through the synchronous
# CG rounds (NOTE [synchronous CG rounds] in _sync_cg.py) if H's effective rank is at least this
# fraction of m (see _spread_out); what they leave goes on as below.
_SYNC_FROM = 96
_SYNC_MIN_RANK = 0.5
# The CG solver from this many variables on for a batch of problems (UPGrad: k = m) whose H has
# a high effective rank (after the synchronous rounds) ...
_CG_FROM = 128
# ... for a batch whose H has not (below it: the direct solver from ADMM-guessed faces; 512
# until session 55, when the direct solver's batch stopped being cut into chunks up front,
# NOTE [one batch, its faces shared] in _qp.py: see NOTE [choosing the non-negative QP solver]) ...
_CG_FROM_CONCENTRATED = 1024
# ... and for a single problem (DualProj).
_CG_FROM_SINGLE = 768
# The direct solver starts a batch of problems from ADMM-guessed faces (NOTE [ADMM face
# identification] in _admm.py) from this many variables on. At m = 16 the guess (0.3 ms, mostly
# fixed costs) cost about what the rounds it saved did (A/B: 1.2 and 1.55 times faster on
# ill-conditioned and rank-m/2 Gramians, 0.5 to 0.9 times on the other three); at m = 32 it
# was 1.3 to 5.7 times faster but on rank-1 ones (0.6 times: one round either way). For a
# single problem (DualProj) it cost more than the rounds it saved (0.3 to 0.7 times as fast,
# but for rank-m/2 Gramians at m = 64), so it has none.
_ADMM_FROM = 32
# A batch of problems from this many variables on (up to session 55 only below
# _CG_FROM_CONCENTRATED: UPGrad on rank-1 Gramians then took the CG solver, 3-4 s at m = 1024
# against 0.2 s now) first checks whether the default start is right (NOTE [cold start probe] in
# _qp.py); if so, the direct solver runs from there, with no guess and no CG rounds. A/B in one
# process (1 thread, the weighting benchmark's Gramians and the benchmark MLP's at initialisation):
# at m = 128, 0.57 times the time at initialisation and 0.91 on rank-1 Gramians, 1.02-1.04 on the
# others (the probe, 0.14-0.35 ms); at m = 256, 0.76 and 0.64 (with the fix of NOTE [face blocks in
# chunks]'s padding test). At m = 32 and 64 the probe cost the others 5-30 % for 0.7-0.8 times on
# rank-1 and nothing at initialisation (a round from the guess is as fast there). With a WarmStart
# too (the probe comes first): six UPGrad steps of the MLP on one batch, 0.58-0.59 times the time a
# step at m = 128 and 256; drifting rank-1 Gramians 0.67-0.80; drifting random and training-like
# ones 1.00-1.04 (the probe).
_COLD_PROBE_FROM = 128
# The direct solver runs in the units of diag(H)^(-1/2) where H's diagonal spreads over more
# than this factor (NOTE [direct solves in Jacobi units] in _direct).
_JACOBI_FROM_SPREAD = 1e4


class NonnegSolution(NamedTuple):
    """The solutions, the solver that found them and its iterations (CG only, else 0)."""

    x: Tensor
    solver: str
    iterations: int


def solve_nonneg(H: Tensor, q: Tensor, x0: Tensor | None = None) -> NonnegSolution:
    """Solves ``min_x ½ xᵀHx + qᵀx`` s.t. ``x ≥ 0`` for each row of ``q``, by the faster solver.

    See NOTE [choosing the non-negative QP solver]. A warm start ``x0`` is used for the problems
    where it is closer to the solution than zero is (:func:`_better_start`), unless the default
    start is already right (NOTE [cold start probe] in ``_qp.py``).

    Args:
        H: Symmetric positive-definite float64 matrix of shape ``[m, m]`` (positive
            semi-definite is accepted, then one of the minimisers is returned).
        q: Float64 tensor of shape ``[k, m]``.
        x0: A previous solution, float64 ``[k, m]``, to start from (warm start).

    Returns:
        The minimisers (float64 ``[k, m]``, non-negative), the solver's name and iterations.

    Example:
        >>> import torch
        >>> H = torch.tensor([[2.0, -1.0], [-1.0, 2.0]], dtype=torch.float64)
        >>> solution = solve_nonneg(H, torch.tensor([[-2.0, 2.0]], dtype=torch.float64))
        >>> solution.x, solution.solver
        (tensor([[1.0000, 0.0000]], dtype=torch.float64), 'direct')
    """
    k, m = q.shape
    free = None
    if k > 1 and m >= _COLD_PROBE_FROM and cold_start_holds(H, q):
        # NOTE [cold start probe]; before the warm start, which would send the batch to the
        # guess or the CG rounds (the benchmark MLP over steps on one batch: 1.6-1.7 times slower)
        return NonnegSolution(_direct(H, q), "direct", 0)
    if x0 is not None:
        x0, free = _better_start(H, q, x0)
    sync = k > 1 and m >= _SYNC_FROM and _spread_out(H)
    if k == 1:
        cg = m >= _CG_FROM_SINGLE
    else:
        cg = m >= (_CG_FROM if sync else _CG_FROM_CONCENTRATED)
    if not (sync or cg):
        if k > 1 and m >= _ADMM_FROM:
            free = admm_faces(H, q, x0)  # Warm: from x0 where _better_start kept it.
        return NonnegSolution(_direct(H, q, free), "direct", 0)
    scale = H.diagonal().clamp(min=torch.finfo(H.dtype).tiny).pow(-1.0 / 3.0)
    H_scaled, q_scaled = H * scale.unsqueeze(-1) * scale, q * scale
    x = None if x0 is None else x0 / scale  # The scaled iterates, once there are some.
    left = torch.arange(k, device=q.device)  # The problems not certified yet.
    iterations = 0
    if sync:
        x, certified, iterations = solve_nonneg_qp_sync(H_scaled, q_scaled, x0=x)
        if bool(certified.all()):  # Host synchronisation.
            return NonnegSolution(x * scale, "cg", iterations)
        left = (~certified).nonzero().squeeze(-1)
        # The others go on from their last iterates, or from zero where that is closer.
        start, free = _better_start(H, q[left], x[left] * scale)
        x = x.index_copy(0, left, start / scale)
        free = torch.zeros_like(x, dtype=torch.bool).index_copy_(0, left, free)
    solution = torch.zeros_like(q) if x is None else x * scale
    if cg:
        y, certified, more = solve_nonneg_qp_cg(
            H_scaled, q_scaled[left], free=None if free is None else free[left],
            x0=None if x is None else x[left],
        )
        iterations += more
        solution.index_copy_(0, left, y * scale)
        left = left[~certified]
        free = None  # The direct solver starts afresh from what CG does not certify.
    if left.shape[0]:
        solution.index_copy_(0, left, _direct(H, q[left], None if free is None else free[left]))
    return NonnegSolution(solution, "cg", iterations)


def _direct(H: Tensor, q: Tensor, free: Tensor | None = None) -> Tensor:
    """The direct solver on the Jacobi-scaled problem (``H -> DHD``, ``q -> Dq``, ``x = D y``).

    NOTE [direct solves in Jacobi units]
    The active set's sign tests are relative to each
    problem's largest ``|z|`` and its terms' magnitudes; in the units of ``D = diag(H)^(-1/2)``
    every variable has the same scale, so a row of ``J`` with a norm 1e-15 of the others'
    (whose variable is then about 1e19 with ``reg_eps = 0``) no longer makes that tolerance
    swallow the other variables' signs (session 54's hunt: relative KKT residuals of 1e-3 to
    4e-2 returned as solved, on full-rank Gramians). The KKT certificate does not change under
    this scaling, nor do the free sets. Only where the diagonal spreads over more than
    ``_JACOBI_FROM_SPREAD`` (variables of scales 100 times apart): elsewhere the tolerances are
    the scaled ones to within that, and the scaling cost 4-9 % of ``upgrad`` on the benchmark
    MLP's Gramian at m = 256 (A/B), for the same answers. With the default ``reg_eps = 1e-4``
    the diagonal of ``H = G / tr G + reg_eps I`` spreads over at most about ``1 / reg_eps``, so
    this is for smaller ridges (the weighting benchmark's five families: the same answers, to
    the bit, and times, 0.97-1.01×).
    """
    diagonal = H.diagonal()
    largest = diagonal.amax()
    # A zero diagonal entry (a zero row of J, reg_eps = 0) keeps the unit of the largest: its
    # variable changes nothing, and 1 / sqrt(tiny) would blow it up (weights of 1e147)
    positive = diagonal > 0
    smallest = torch.where(positive, diagonal, largest).amin()
    if not bool(largest > _JACOBI_FROM_SPREAD * smallest):  # Host synchronisation.
        return solve_nonneg_qp(H, q, free)
    scale = torch.where(positive, diagonal, largest).rsqrt()
    return solve_nonneg_qp(H * scale.unsqueeze(-1) * scale, q * scale, free) * scale


def _spread_out(H: Tensor) -> bool:
    """Whether ``H``'s effective rank ``tr(H)² / ‖H‖_F²`` is at least ``_SYNC_MIN_RANK · m``.

    That ratio of the first two moments of the spectrum is ``m`` for a multiple of the identity,
    about ``0.75 m`` for a random Gramian ``A Aᵀ`` (``A`` of shape ``[m, 3m]``), ``1`` for a
    rank-1 one, and ``0.01 m`` to ``0.3 m`` for the benchmark's rank-deficient, ill-conditioned
    and training Gramians. Those give ill-conditioned faces, where the synchronous rounds certify
    nothing (they hand everything back after 12 iterations) and the direct solver's complement
    side often does best (NOTE [complement side] in ``_qp.py``). One host synchronisation.
    """
    m = H.shape[0]
    trace = H.diagonal().sum()
    return bool(trace * trace >= _SYNC_MIN_RANK * m * torch.linalg.vector_norm(H) ** 2)


def _better_start(H: Tensor, q: Tensor, x0: Tensor) -> tuple[Tensor, Tensor]:
    """Per problem, the warm start ``x0`` or the cold one (``x = 0``), whichever is closer.

    Closer in the sense of NOTE [KKT certificate]: ``‖x - x*‖₂ ≤ ‖e‖₂ / λ_min(H)``, ``e`` the
    KKT violations at ``x``; at ``x = 0`` they are the negative entries of ``q``. A previous
    solution of unrelated rows (a fresh mini-batch, whose row ``i`` is another sample) is
    usually farther than ``0`` and would cost the active-set method extra rounds.

    Returns:
        The starting points (``x0`` clamped to ``≥ 0``, or zero) and their free sets (the
        support of ``x0``, or the variables with ``q_j < 0``).
    """
    x0 = x0.clamp(min=0.0)
    s = torch.addmm(q, x0, H)
    warm = torch.linalg.vector_norm(torch.where(x0 > 0, s, (-s).clamp(min=0.0)), dim=-1)
    cold = torch.linalg.vector_norm((-q).clamp(min=0.0), dim=-1)
    use = (warm < cold).unsqueeze(-1)
    return x0 * use, torch.where(use, x0 > 0, q < 0)
