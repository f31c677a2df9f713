"""Batched non-negative QPs for large ``m``: active-set steps with conjugate-gradient face solves.

NOTE [batched CG active-set solver]
Solves ``min_x ½ xᵀHx + qᵀx`` subject to ``x ≥ 0`` for ``k`` vectors ``q`` sharing ``H``, as
:func:`._qp.solve_nonneg_qp` does, but without factorising anything. The direct solver factorises
one face block ``H_FF`` per problem and iteration, ``O(k p³)`` with ``p ≈ m / 2`` for UPGrad on
Gramians with conflicts: ``m⁴ / 24`` flops per iteration, run by LAPACK one small matrix at a time.
Here every face system ``H_FF z_F = -q_F`` is solved by conjugate gradients, and the ``k`` CG
iterations share one matrix product ``P H`` (``[k, m] × [m, m]``, one GEMM, masked to the faces).

* Primal-dual active-set (PDAS) steps decide the faces, as in the direct solver: a variable of
  ``F`` whose value turns negative leaves it, a variable off ``F`` whose multiplier ``s_j`` turns
  negative joins it. The face systems are solved only as far as the signs need: every
  ``_CHECK_EVERY`` CG iterations, the problems with wrong signs change their faces and restart
  CG on the new ones from where they stand (not from zero). Checking at common ticks rather
  than after every iteration keeps the bookkeeping off the critical path.
* Mixed precision: the CG iterations run in ``work_dtype`` (float32 from ``_FLOAT32_FROM``
  variables on, where GEMMs are about twice as fast; float64 below), the iterate is kept in
  float64, and each CG *round* solves for the correction to the float64 residual ``s = Hx + q``
  (iterative refinement): a round ends once it has reduced the face residual by
  ``_ROUND_REDUCTION`` or reached the working precision's noise floor, and the next one starts
  from ``s`` recomputed exactly, in float64.
* Certificate: at the end of every round the problem's relative KKT residual ``ρ`` (NOTE [KKT
  certificate] in ``_kkt.py``) is computed from that float64 ``s``; a problem is done when
  ``ρ ≤ tol``, with its solution clamped to ``x ≥ 0`` (the clamped point is the one certified).
  Done problems are frozen, and dropped from the GEMM once there are enough of them.
* What is not certified within ``max_iterations`` (PDAS may cycle on hard problems, and CG
  stalls on singular faces) is left to the caller, which solves it with the direct method.

Host synchronisation: one per iteration (which problems change face or end a round).
Cost: one ``[k, m] × [m, m]`` GEMM and a few dozen elementwise operations on ``[k, m]``
tensors per iteration; for UPGrad about 40 to 60 iterations on random Gramians, a few hundred on
ill-conditioned ones (the count grows like ``√cond`` of the face systems).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._kkt import KKT_TOL

# From this m on, CG iterations run in float32 (NOTE [batched CG active-set solver]).
_FLOAT32_FROM = 128
# Ulps of the working dtype below which a sign counts as zero, relative to its magnitude.
_NOISE_ULPS = 16.0
# A problem whose residual has not halved in this many rounds in a row is given up.
_STALLED_ROUNDS = 3
# CG iterations between two checks of the signs (and of the rounds' ends).
_CHECK_EVERY = 6
# Done problems are dropped from the batch once they are this fraction of it.
_DROP_FRACTION = 0.125


# Per-problem vectors in the working dtype, stacked so that a PDAS step or the end of a round
# reads and writes a problem's whole state with one indexing operation per stack.
_WORK = ("q", "minus_free", "off_face", "x", "dx", "s", "sigma", "low", "p")
_WIDE = ("q64", "x64")  # float64
_SMALL = ("rr", "target")  # one number per problem, working dtype


class _Batch:
    """The problems still being solved, one row each.

    The fields named in ``_WORK``, ``_WIDE`` and ``_SMALL`` are views into three stacked
    tensors (``work`` ``[9, b, m]``, ``wide`` ``[2, b, m]``, ``small`` ``[2, b]``), updated in
    place. Masks are kept as ``work`` tensors: multiplying by them is several times faster on
    CPU than ``torch.where`` with a boolean mask.

    * ``q``, ``q64``: the linear terms. ``minus_free``: -1 on the face, 0 off it (``r = -s`` on
      the face); ``off_face``: its complement, 1 off the face.
    * ``x``, ``x64``: the iterate at the start of the round (≥ 0, zero off the face), in the
      working dtype and in float64; ``dx``: the round's correction (zero off the face).
    * ``s``: the multipliers ``H (x + dx) + q``; ``sigma``: the magnitudes summed into them.
    * ``low``: below it, ``x`` (on the face) or ``s`` (off it) is a wrong sign.
    * ``p``: the CG direction (zero off the face); ``rr``: ``|r|²``; ``target``: the ``|r|²``
      that ends the round.
    * ``free`` (bool ``[b, m]``); ``stalls`` (rounds in a row that did not halve
      ``residual``): int ``[b]``;
      ``residual``: the best KKT residual at the end of a round, float64 ``[b]``; ``done``:
      certified or given up, bool ``[b]``; ``rows``: indices in the caller's batch.
    """

    q: Tensor
    minus_free: Tensor
    off_face: Tensor
    x: Tensor
    dx: Tensor
    s: Tensor
    sigma: Tensor
    low: Tensor
    p: Tensor
    q64: Tensor
    x64: Tensor
    rr: Tensor
    target: Tensor

    def __init__(self, rows: Tensor, work: Tensor, wide: Tensor, small: Tensor, free: Tensor,
                 stalls: Tensor, residual: Tensor, done: Tensor) -> None:
        self.rows, self.work, self.wide, self.small = rows, work, wide, small
        self.free, self.stalls, self.residual, self.done = free, stalls, residual, done
        for names, stack in ((_WORK, work), (_WIDE, wide), (_SMALL, small)):
            for name, view in zip(names, stack.unbind(0), strict=True):
                setattr(self, name, view)

    def select(self, index: Tensor) -> _Batch:
        """The problems ``index`` (positions in this batch), as a new batch."""
        return _Batch(self.rows[index], self.work.index_select(1, index),
                      self.wide.index_select(1, index), self.small.index_select(1, index),
                      self.free[index], self.stalls[index], self.residual[index],
                      self.done[index])

    def write(self, index: Tensor, other: _Batch) -> None:
        """Overwrites the problems ``index`` with the batch ``other`` (of ``len(index)`` rows)."""
        for name in ("work", "wide", "small"):
            getattr(self, name).index_copy_(1, index, getattr(other, name))
        for name in ("free", "stalls", "residual", "done"):
            getattr(self, name).index_copy_(0, index, getattr(other, name))


def solve_nonneg_qp_cg(
    H: Tensor,
    q: Tensor,
    *,
    free: Tensor | None = None,
    x0: Tensor | None = None,
    tol: float = KKT_TOL,
    max_iterations: int = 2000,
    work_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, int]:
    """Solves ``min_x ½ xᵀHx + qᵀx`` s.t. ``x ≥ 0`` for each row of ``q``, to a certified residual.

    See NOTE [batched CG active-set solver] at the top of this module.

    Args:
        H: Symmetric positive-definite float64 matrix of shape ``[m, m]``, preferably with a
            unit diagonal (a diagonal rescaling: CG's signs and rounds are judged relative to
            the magnitudes of the entries, which it evens out).
        q: Float64 tensor of shape ``[k, m]``: one linear term per problem.
        free: Initial free sets, boolean ``[k, m]`` (default: the variables with ``q_j < 0``).
        x0: Initial iterate, float64 ``[k, m]`` (default zero); its entries off ``free`` are
            ignored, negative ones are clamped to zero.
        tol: The relative KKT residual a solution is certified to (NOTE [KKT certificate]).
        max_iterations: CG iterations after which the problems left are given up.
        work_dtype: Dtype of the CG iterations (default: float32 from ``_FLOAT32_FROM``
            variables on, else float64).

    Returns:
        The solutions ``x ≥ 0`` (float64 ``[k, m]``; where not certified, the last iterate, a
        starting point for another solver), which of them are certified (boolean ``[k]``), and
        the number of iterations run.

    Example:
        >>> import torch
        >>> H = torch.tensor([[2.0, -1.0], [-1.0, 2.0]], dtype=torch.float64)
        >>> q = torch.tensor([[-2.0, 2.0], [1.0, 1.0]], dtype=torch.float64)
        >>> x, certified, _ = solve_nonneg_qp_cg(H, q)
        >>> x, certified
        (tensor([[1., 0.],
                [0., 0.]], dtype=torch.float64), tensor([True, True]))
    """
    k, m = q.shape
    if work_dtype is None:
        work_dtype = torch.float32 if m >= _FLOAT32_FROM else torch.float64
    solution = torch.zeros_like(q)
    certified = torch.zeros(k, dtype=torch.bool, device=q.device)
    if k == 0 or m == 0:
        return solution, torch.ones_like(certified), 0
    if free is None:
        free = q < 0
    x = torch.zeros_like(q) if x0 is None else (x0 * free).clamp(min=0.0)
    H_work, H_abs = H.to(work_dtype), H.abs().to(work_dtype)

    sigma = torch.addmm(q.abs().to(work_dtype), x.to(work_dtype), H_abs)
    batch = _round(x, torch.addmm(q, x, H), free.clone(), sigma, q, H_work.dtype)
    iterations = 0
    for iterations in range(1, max_iterations + 1):  # noqa: B007 (returned)
        _cg_step(batch, H_work)
        if iterations % _CHECK_EVERY:
            continue
        wrong = _wrong_signs(batch)
        active = ~batch.done
        flip = (wrong.amax(dim=-1) > 0) & active
        end_round = (batch.rr <= batch.target) & active & ~flip
        any_flip, any_end = torch.stack([flip.any(), end_round.any()]).tolist()  # Host sync.
        if any_flip:
            index = flip.nonzero().squeeze(-1)
            batch.write(index, _change_faces(batch.select(index), wrong[index] > 0, H_work))
        if any_end:
            index = end_round.nonzero().squeeze(-1)
            ended, solved = _end_round(batch.select(index), H, H_work, H_abs, tol)
            batch.write(index, ended)
            solution.index_copy_(0, ended.rows[solved], ended.x64[solved])
            certified.index_fill_(0, ended.rows[solved], True)
            done = int(batch.done.sum())  # Host synchronisation.
            if done == batch.rows.shape[0]:
                break
            if done >= _DROP_FRACTION * batch.rows.shape[0]:
                batch = batch.select((~batch.done).nonzero().squeeze(-1))
    left = ~certified[batch.rows]
    if bool(left.any()):  # Host synchronisation.
        rows = batch.rows[left]
        solution.index_copy_(0, rows, (batch.x64[left] + batch.dx[left]).clamp(min=0.0))
    return solution, certified, iterations


def _round(x: Tensor, s: Tensor, free: Tensor, sigma: Tensor, q: Tensor, work: torch.dtype,
           rows: Tensor | None = None, residual: Tensor | None = None,
           stalls: Tensor | None = None, done: Tensor | None = None) -> _Batch:
    """A batch starting a CG round from the float64 iterate ``x`` and its multipliers ``s``.

    ``rows``, ``residual``, ``stalls`` and ``done`` carry over from the problems' previous
    round (default: a first round).
    """
    n = q.shape[0]
    minus_free = free.to(work).neg_()
    s_work = s.to(work)
    r = s_work * minus_free
    rr = torch.linalg.vecdot(r, r)
    noise = _NOISE_ULPS * torch.finfo(work).eps
    x_work = x.to(work)
    low_x = x_work.abs().amax(dim=-1, keepdim=True).mul_(-noise)
    low = torch.where(free, low_x, sigma * -noise)
    work_stack = torch.stack([q.to(work), minus_free, minus_free + 1.0, x_work,
                              torch.zeros_like(r), s_work, sigma, low, r])
    small = torch.stack([rr, rr * torch.finfo(work).eps])
    zeros = torch.zeros(n, dtype=torch.int64, device=q.device)
    return _Batch(
        rows=torch.arange(n, device=q.device) if rows is None else rows,
        work=work_stack, wide=torch.stack([q, x]), small=small, free=free,
        stalls=zeros if stalls is None else stalls,
        residual=torch.full_like(s[:, 0], torch.inf) if residual is None else residual,
        done=zeros.bool() if done is None else done,
    )


def _cg_step(batch: _Batch, H_work: Tensor) -> None:
    """One CG iteration on every face, in place.

    A round ends once ``|r|²`` is below ``target``: its residual reduced by ``√eps`` of the
    working dtype. A round solves for a correction to the float64 residual it starts from, so its
    working precision limits the reduction (to about ``eps · cond``), not the final accuracy:
    two rounds reach float64 round-off from a float32 start.
    """
    tiny = torch.finfo(H_work.dtype).tiny
    ph = batch.p @ H_work  # One GEMM for the whole batch; p is zero off the faces.
    alpha = (batch.rr / torch.linalg.vecdot(batch.p, ph).clamp(min=tiny)).unsqueeze(-1)
    batch.dx.addcmul_(batch.p, alpha)
    batch.s.addcmul_(ph, alpha)
    r = batch.s * batch.minus_free
    rr = torch.linalg.vecdot(r, r)
    batch.p.mul_((rr / batch.rr.clamp(min=tiny)).unsqueeze(-1)).add_(r)
    batch.rr.copy_(rr)


def _wrong_signs(batch: _Batch) -> Tensor:
    """The wrong signs of the current iterates, as 0/1 in the working dtype, ``[b, m]``."""
    # x on the face, s off it (x is zero off the face, s about zero on it): a sign is wrong below
    # the noise of the working precision, the float64 end of the round settles those within it.
    violation = batch.low - batch.x - batch.dx
    return violation.addcmul_(batch.s, batch.off_face, value=-1.0).clamp_(min=0.0).sign_()


def _change_faces(batch: _Batch, wrong: Tensor, H_work: Tensor) -> _Batch:
    """PDAS step: flip the wrong signs, restart CG on the new faces from the current point."""
    free = batch.free ^ wrong
    x = (batch.x64 + batch.dx) * free
    s = torch.addmm(batch.q, x.to(H_work.dtype), H_work)
    return _round(x, s, free, batch.sigma, batch.q64, H_work.dtype, batch.rows, batch.residual,
                  batch.stalls, batch.done)


def _end_round(batch: _Batch, H: Tensor, H_work: Tensor, H_abs: Tensor, tol: float
               ) -> tuple[_Batch, Tensor]:
    """End the problems' round: certify them in float64 (NOTE [KKT certificate]), or go on.

    Returns the batch for their next round, where the certified problems and those given up
    (no progress in ``_STALLED_ROUNDS`` rounds) are done and frozen, and which are certified.
    """
    x = batch.x64 + batch.dx
    free = batch.free & (x >= 0)  # Negative values leave the face...
    x = x.clamp(min=0.0)  # ... and the certified point is the clamped one.
    q = batch.q64
    s = torch.addmm(q, x, H)  # Float64: the certificate, and the next round's residual.
    sigma = torch.addmm(batch.q.abs(), x.to(H_work.dtype), H_abs)
    sigma64 = sigma.to(s.dtype)
    violation = torch.where(x > 0, s.abs(), (-s).clamp(min=0.0))
    residual = (violation / sigma64.clamp(min=torch.finfo(s.dtype).tiny)).amax(dim=-1)
    solved = residual <= tol
    stalls = torch.where(residual <= 0.5 * batch.residual, 0, batch.stalls + 1)
    done = solved | (stalls >= _STALLED_ROUNDS)
    free = free | (s < -tol * sigma64)  # Negative multipliers join the face (x is unchanged).
    ended = _round(x, s, free, sigma, q, H_work.dtype, batch.rows,
                   torch.minimum(residual, batch.residual), stalls, done)
    ended.p.mul_(~done.unsqueeze(-1))  # A done problem is frozen: no direction and no
    ended.rr.mul_(~done)  # residual, hence no step.
    return ended, solved
