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
  (iterative refinement), in units of that residual (so that nothing underflows once it is
  tiny): a round ends once it has reduced the face residual by ``√eps`` of the working dtype,
  and the next one starts from ``s`` recomputed exactly, in float64. Sign changes within
  ``√eps`` of their magnitude are left to the float64 end of the round.
* Certificate: at the end of every round the problem's relative KKT residual ``ρ`` (NOTE [KKT
  certificate] in ``_kkt.py``) is computed from that float64 ``s``; a problem is done when
  ``ρ ≤ tol``, with its solution clamped to ``x ≥ 0`` (the clamped point is the one certified).
  Done problems are frozen, and dropped from the GEMM once there are enough of them.
* What is not certified within ``max_iterations``, makes no progress in ``_STALLED_ROUNDS``
  rounds or diverges (PDAS may cycle on hard problems, and CG stalls or diverges on singular
  faces) is left to the caller, which solves it with the direct method.

Host synchronisation: one per ``_CHECK_EVERY`` iterations (which problems change face or end a
round), plus one per round end. Cost: one ``[k, m] × [m, m]`` GEMM and about ten elementwise
operations on ``[k, m]`` tensors per iteration, and at each face change or round end a few dozen
more on the problems concerned (with one float64 GEMM per round end). For UPGrad: about 50 to 70
iterations on random Gramians, a few hundred on ill-conditioned ones (the count grows like
``√cond`` of the face systems), whatever ``m``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._kkt import KKT_TOL

# From this m on, CG iterations run in float32 (NOTE [batched CG active-set solver]).
_FLOAT32_FROM = 128
# Variables leaving the faces change s by rows of H, gathered and added while they are fewer than
# one in this many entries of the problems changing faces (then one GEMM is cheaper).
_SPARSE_DROPS = 128
# A problem whose CG residual grows this much beyond its round's start (|r̂|² ≤ m) is given up.
_DIVERGED = 1e8
# A round ends after this many CG iterations at most (its end counts as a stall without progress).
_ROUND_ITERATIONS = 240
# A problem whose residual has not halved in this many rounds in a row is given up, as is one
# whose faces have changed more than this many times (PDAS cycles; legitimate counts measured
# on the benchmark Gramians of m = 256: at most 23).
_FACE_CHANGES = 64
_STALLED_ROUNDS = 3
# CG iterations between two checks of the signs (and of the rounds' ends).
_CHECK_EVERY = 6
# Done problems are dropped from the batch once they are this fraction of it.
_DROP_FRACTION = 0.125


# Per-problem vectors in the working dtype, stacked so that a PDAS step or the end of a round
# reads and writes a problem's whole state with one indexing operation per stack.
_WORK = ("q", "minus_free", "off_face", "s0", "r0", "base", "sigma", "dx", "hdx", "p")
_WIDE = ("q64", "x64")  # float64
_SMALL = ("rr", "target", "scale", "age")  # one number per problem, working dtype
_ROW = ("free", "stalls", "changes", "residual", "scale64", "done")  # one tensor each


class _Batch:
    """The problems still being solved, one row each.

    A round solves for the correction ``δ`` to its starting point ``x`` that zeroes the residual
    ``r = -s`` on the face, ``s = Hx + q``: ``H_FF δ_F = r_F``. It is solved in units of
    ``|r|`` (``δ = |r| δ̂``, ``H_FF δ̂_F = r̂_F`` with ``|r̂| = 1``), so that its working dtype
    neither underflows nor loses digits once ``r`` is tiny, as it is in the last rounds.

    The fields named in ``_WORK``, ``_WIDE`` and ``_SMALL`` are views into three stacked
    tensors (``work`` ``[10, b, m]``, ``wide`` ``[2, b, m]``, ``small`` ``[4, b]``), updated in
    place. Masks are kept as ``work`` tensors: multiplying by them is several times faster on
    CPU than ``torch.where`` with a boolean mask.

    * ``q``, ``q64``: the linear terms. ``minus_free``: -1 on the face, 0 off it;
      ``off_face``: 1 off the face, 0 on it.
    * ``x64``: the round's starting point (float64, ≥ 0, zero off the face); ``s0``: its
      multipliers; ``scale``, ``scale64``: ``|r|`` there; ``r0``: ``r / |r|``.
    * ``dx``: ``δ̂`` so far; ``hdx``: ``H δ̂`` (the residual is ``r0 - (H δ̂)_F``); ``p``: the CG
      direction (zero off the face); ``rr``: ``|r̂|²``; ``target``: the ``|r̂|²`` that ends
      the round; ``age``: its CG iterations so far.
    * ``base``: ``low - x - s`` off the face, where ``low`` is the threshold below which ``x``
      (on the face) or ``s`` (off it) is a wrong sign: the wrong signs are where
      ``base - |r| (δ̂ + H δ̂ off the face)`` is positive. ``sigma``: the magnitudes summed into
      ``s``.
    * ``free`` (bool ``[b, m]``); ``stalls``: rounds in a row that did not halve ``residual``,
      the best KKT residual at the end of a round (float64 ``[b]``); ``changes``: face changes
      so far; ``done``: certified or given up; ``rows``: indices in the caller's batch.
    """

    q: Tensor
    minus_free: Tensor
    off_face: Tensor
    s0: Tensor
    r0: Tensor
    base: Tensor
    sigma: Tensor
    dx: Tensor
    hdx: Tensor
    p: Tensor
    q64: Tensor
    x64: Tensor
    rr: Tensor
    target: Tensor
    scale: Tensor
    age: Tensor
    free: Tensor
    stalls: Tensor
    changes: Tensor
    residual: Tensor
    scale64: Tensor
    done: Tensor

    def __init__(self, rows: Tensor, work: Tensor, wide: Tensor, small: Tensor,
                 **row_fields: Tensor) -> None:
        self.rows, self.work, self.wide, self.small = rows, work, wide, small
        for name in _ROW:
            setattr(self, name, row_fields[name])
        for names, stack in ((_WORK, work), (_WIDE, wide), (_SMALL, small)):
            for name, view in zip(names, stack.unbind(0), strict=True):
                setattr(self, name, view)

    def select(self, index: Tensor) -> _Batch:
        """The problems ``index`` (positions in this batch), as a new batch."""
        return _Batch(self.rows[index], self.work.index_select(1, index),
                      self.wide.index_select(1, index), self.small.index_select(1, index),
                      **{name: getattr(self, name)[index] for name in _ROW})

    def write(self, index: Tensor, other: _Batch) -> None:
        """Overwrites the problems ``index`` with the batch ``other`` (of ``len(index)`` rows)."""
        for name in ("work", "wide", "small"):
            getattr(self, name).index_copy_(1, index, getattr(other, name))
        for name in _ROW:
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
    batch = _round(x, torch.addmm(q, x, H), free.clone(), sigma, q, work_dtype)
    if x0 is not None:  # A warm start may be solved already: certify before iterating.
        batch, solved = _end_round(batch, H, H_work, H_abs, tol)
        solution.index_copy_(0, batch.rows[solved], batch.x64[solved])
        certified.index_fill_(0, batch.rows[solved], True)
    iterations = 0
    while iterations < max_iterations and not (iterations == 0 and bool(batch.done.all())):
        iterations += 1
        _cg_step(batch, H_work)
        if iterations % _CHECK_EVERY:
            continue
        wrong = _wrong_signs(batch)
        # CG diverges on a singular face (H singular, e.g. reg_eps = 0): give those problems up.
        diverged = ~(batch.rr <= _DIVERGED * batch.rows.new_tensor(m, dtype=batch.rr.dtype))
        batch.done |= diverged
        batch.age.add_(_CHECK_EVERY)
        active = ~batch.done
        flip = (wrong.amax(dim=-1) > 0) & active
        # A round also ends after _ROUND_ITERATIONS: its float64 end measures the progress.
        end_round = ((batch.rr <= batch.target) | (batch.age >= _ROUND_ITERATIONS)) & active
        end_round &= ~flip
        any_flip, any_end = torch.stack([flip.any(), end_round.any()]).tolist()  # Host sync.
        if any_flip:
            index = flip.nonzero().squeeze(-1)
            if index.shape[0] == batch.rows.shape[0]:  # Every problem: no need to gather.
                batch = _change_faces(batch, wrong > 0, H_work)
            else:
                batch.write(index, _change_faces(batch.select(index), wrong[index] > 0, H_work))
        if any_end:
            index = end_round.nonzero().squeeze(-1)
            if index.shape[0] == batch.rows.shape[0]:
                batch, solved = _end_round(batch, H, H_work, H_abs, tol)
                ended = batch
            else:
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
        solution.index_copy_(0, rows, _current(batch.select(left.nonzero().squeeze(-1))))
    return solution, certified, iterations


def _current(batch: _Batch) -> Tensor:
    """The problems' current iterates ``x + |r| δ̂``, float64, clamped to ``x ≥ 0``."""
    return torch.addcmul(batch.x64, batch.dx, batch.scale64.unsqueeze(-1)).clamp(min=0.0)


def _round(x: Tensor, s: Tensor, free: Tensor, sigma: Tensor, q: Tensor, work: torch.dtype,
           previous: _Batch | None = None, **updates: Tensor) -> _Batch:
    """A batch starting a CG round from the float64 iterate ``x`` and its multipliers ``s``.

    ``rows`` and the other per-problem fields (``_ROW``) carry over from the batch
    ``previous`` of the problems' last round, or are those of a first round; ``updates``
    overrides some of them.
    """
    n = q.shape[0]
    tiny = torch.finfo(work).tiny
    plus_free = free.to(work)
    off_face = 1.0 - plus_free
    minus_free = plus_free.neg_()
    s_work, x_work = s.to(work), x.to(work)
    # |r| as its largest entry (no squares: they would underflow once r is tiny).
    r = s_work * minus_free
    scale = r.abs().amax(dim=-1).clamp_(min=tiny)
    r0 = r.div_(scale.unsqueeze(-1))
    rr = torch.linalg.vecdot(r0, r0)
    noise = torch.finfo(work).eps ** 0.5
    low_x = x_work.abs().amax(dim=-1, keepdim=True).mul_(-noise)
    # low - x on the face (s ≈ 0 there): low = -noise max |x|; low - s off it (x = 0 there):
    # low = -noise σ.
    base = torch.add(s_work, sigma, alpha=noise).mul_(off_face).neg_()
    base.addcmul_(minus_free, low_x, value=-1.0).sub_(x_work)
    zeros = torch.zeros_like(r0)
    work_stack = torch.stack([q.to(work), minus_free, off_face, s_work, r0, base, sigma, zeros,
                              zeros, r0])
    small = torch.stack([rr, rr * torch.finfo(work).eps, scale, torch.zeros_like(rr)])
    scale64 = scale.to(x.dtype)
    if previous is None:
        counts = torch.zeros(n, dtype=torch.int64, device=q.device)
        carried = {"rows": torch.arange(n, device=q.device), "stalls": counts,
                   "changes": counts, "residual": torch.full_like(scale64, torch.inf),
                   "done": counts.bool()}
    else:
        carried = {name: getattr(previous, name)
                   for name in ("rows", "stalls", "changes", "residual", "done")}
    carried |= updates
    return _Batch(work=work_stack, wide=torch.stack([q, x]), small=small, free=free,
                  scale64=scale64, **carried)


def _cg_step(batch: _Batch, H_work: Tensor) -> None:
    """One CG iteration on every face, in place.

    A round ends once ``|r̂|²`` is below ``target``: reduced by ``√eps`` of the working dtype.
    The round solves for a correction to the float64 residual it starts from, so its working
    precision limits the reduction (to about ``eps · cond``), not the final accuracy: two rounds
    reach float64 round-off from a float32 start.
    """
    tiny = torch.finfo(H_work.dtype).tiny
    ph = batch.p @ H_work  # One GEMM for the whole batch; p is zero off the faces.
    alpha = (batch.rr / torch.linalg.vecdot(batch.p, ph).clamp(min=tiny)).unsqueeze(-1)
    batch.dx.addcmul_(batch.p, alpha)
    batch.hdx.addcmul_(ph, alpha)
    r = torch.addcmul(batch.r0, batch.hdx, batch.minus_free)
    rr = torch.linalg.vecdot(r, r)
    batch.p.mul_((rr / batch.rr.clamp(min=tiny)).unsqueeze(-1)).add_(r)
    batch.rr.copy_(rr)


def _wrong_signs(batch: _Batch) -> Tensor:
    """The wrong signs of the current iterates, as 0/1 in the working dtype, ``[b, m]``."""
    # x on the face, s off it (x is zero off the face, s about zero on it): a sign is wrong below
    # the noise of the working precision, the float64 end of the round settles those within it.
    change = torch.addcmul(batch.dx, batch.hdx, batch.off_face)
    violation = torch.addcmul(batch.base, change, batch.scale.unsqueeze(-1), value=-1.0)
    return violation.clamp_(min=0.0).sign_()


def _change_faces(batch: _Batch, wrong: Tensor, H_work: Tensor) -> _Batch:
    """PDAS step: flip the wrong signs, restart CG on the new faces from the current point.

    A variable joining the face keeps ``x_j = 0``; one leaving it drops its ``x_j``, which
    changes ``s`` by ``-x_j H_j``: a few rows of ``H`` per problem, added without a GEMM.
    """
    free = batch.free ^ wrong
    x = torch.addcmul(batch.x64, batch.dx, batch.scale64.unsqueeze(-1))
    # s = H x + q at the current point: the round's start plus |r| H δ̂.
    s = torch.addcmul(batch.s0, batch.hdx, batch.scale.unsqueeze(-1)).to(x.dtype)
    dropped = x * (batch.free & ~free)  # The values of the variables that leave the face.
    problem, variable = dropped.nonzero(as_tuple=True)
    if problem.shape[0] * _SPARSE_DROPS > dropped.numel():  # Many: one GEMM is cheaper.
        s -= (dropped.to(H_work.dtype) @ H_work).to(s.dtype)
    else:
        s.index_add_(0, problem, H_work.index_select(0, variable).to(s.dtype)
                     * -dropped[problem, variable].unsqueeze(-1))
    changes = batch.changes + 1
    return _round(x * free, s, free, batch.sigma, batch.q64, H_work.dtype, batch,
                  changes=changes, done=batch.done | (changes > _FACE_CHANGES))


def _end_round(batch: _Batch, H: Tensor, H_work: Tensor, H_abs: Tensor, tol: float
               ) -> tuple[_Batch, Tensor]:
    """End the problems' round: certify them in float64 (NOTE [KKT certificate]), or go on.

    Returns the batch for their next round, where the certified problems and those given up
    (no progress in ``_STALLED_ROUNDS`` rounds) are done and frozen, and which are certified.
    """
    x = torch.addcmul(batch.x64, batch.dx, batch.scale64.unsqueeze(-1))
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
    ended = _round(x, s, free, sigma, q, H_work.dtype, batch, stalls=stalls, done=done,
                   residual=torch.minimum(residual, batch.residual))
    ended.p.mul_(~done.unsqueeze(-1))  # A done problem is frozen: no direction and no
    ended.rr.mul_(~done)  # residual, hence no step.
    return ended, solved
