"""Batched solvers for the two small quadratic programs behind the Gramian weightings.

NOTE [batched QP solver]
Both problems are strictly (or merely) convex QPs in ``m`` variables with simple constraints:

* non-negative QP (dual-cone projection, used by UPGrad and DualProj)::

      min_x  ½ xᵀHx + qᵀx   subject to  x ≥ 0,

  solved for a whole batch of vectors ``q`` that share one ``H``;
* simplex QP (the min-norm point of a convex hull, used by MGDA)::

      min_w  ½ wᵀHw         subject to  w ≥ 0,  1ᵀw = 1.

Write ``s`` for the multipliers of the sign constraints (``s = Hx + q``, resp. ``Hw - ν1`` with
``ν = wᵀHw``): a point is the solution iff it is feasible, ``s ≥ 0`` and ``x_i s_i = 0``. Both
problems are solved by active-set methods, batched over the problems, on ``H``'s device:

* Every iteration has, for each problem, a free set ``F`` (a guess of the variables that are
  positive at the solution) and solves the QP on the face ``x_i = 0`` off ``F`` exactly: one
  batched Cholesky solve with the blocks ``H_FF``, padded with the identity (for ``m`` from
  ``_GATHER_FROM`` on, gathered into ``p × p`` matrices, ``p`` the largest ``|F|`` of the
  batch). This *face solution* ``z`` satisfies complementarity by construction, so it is the
  solution iff its signs are right: ``z_F ≥ 0`` and ``s ≥ 0`` off ``F``. A sign counts as wrong
  below ``-_SIGN_TOL`` (16 ulps) times the magnitude of the terms it is computed from (for
  ``s_i``, ``|q_i| + (|H| |z|)_i``), so an accepted answer is exact up to the round-off of one
  Cholesky solve (about ``cond(H_FF) · 1e-16``).
* Phase 1, up to ``_EXCHANGE_ITERATIONS`` primal-dual active-set steps (semismooth Newton,
  "block principal pivoting"): every variable with a wrong sign changes side. It starts from
  ``x = 0`` (``F = {i : q_i < 0}``: for UPGrad, the rows in conflict with the projected one),
  from the caller's free sets (UPGrad: guessed by ADMM, NOTE [ADMM face identification] in
  ``_admm.py``, then most problems are solved by the first iteration), or from ``F`` =
  everything (simplex QP), and solves most problems in one to five iterations.
  But it is not monotone, and may cycle when ``H`` is far from an M-matrix.
* Phase 2, up to ``_DESCENT_ITERATIONS`` iterations for the problems phase 1 left: a primal
  active-set method with block additions (Lawson–Hanson style) from phase 1's last face solution
  made feasible. Its iterate ``x`` stays feasible and its objective never increases: when ``z``
  is infeasible, ``x`` moves towards it until the first free variable reaches zero, which leaves
  ``F``; when ``z`` is feasible, it becomes ``x``, and the variables with ``s_i < 0`` join ``F``
  (only the most negative one right after a step of length zero: the classic finite rule).
* The problems left after that, or whose face systems were not positive-definite (a singular
  ``H``, e.g. UPGrad with ``reg_eps = 0`` and a rank-deficient Gramian, or an indefinite one,
  e.g. MGDA on a rank-deficient float32 Gramian), go through both phases again with systems
  shifted by ``max(0, _JITTER · tr(H) / m - 2 λ_min(H))`` (zero for a positive-definite ``H``).
  On a singular face the shifted solution is close to the minimum-norm one; signs are still
  checked with the exact ``H``. What still fails (rare: e.g. one problem of DualProj with
  ``reg_eps = 0`` on a half-rank ``m = 64`` Gramian) is solved by the previous solver:
  ``_IPM_ITERATIONS`` Mehrotra predictor-corrector interior-point iterations, then up to
  ``_POLISH_STEPS`` face solves on the free set read off the interior point. The simplex QP
  skips the retry when it started from the full face and every face factored (its iterations
  ran out: the retry would repeat them), and its interior-point iterations stop once converged
  (NOTE [simplex QP fallback]).

Host synchronisation: the active-set method decides on the host when to stop and which problems
to drop from the batch (solved ones, when half of them are, or always from ``_GATHER_FROM`` on,
where the factorisations dominate; solved problems are fixed points of both phases, so keeping
them in the batch for a while changes nothing). That is one synchronisation per iteration, one
more per iteration for the size ``p`` of gathered blocks, and one per call to check for
leftovers: for UPGrad on the test Gramians, 2 to 15 in all for ``m ≤ 16`` and up to about 40 for
``m = 64`` on rank-deficient ones. This is what buys the speed: the previous, synchronisation-
free solver did a fixed 30 interior-point iterations on the full ``[m, m]`` systems of every
problem.

Accuracy: against quadprog (the exact active-set solver torchjd uses) the solutions agree to
about 1e-12, relative to their largest entry, on random Gramians with ``m ≤ 128`` (rank-
deficient ones included, and row norms spread over 16 orders of magnitude); tests/weighting
checks against an exhaustive active-set enumeration, the KKT conditions and torchjd.

All arithmetic is done in float64 on purpose: the regularised Gramians of UPGrad/DualProj have a
condition number up to ``1 / reg_eps = 1e4`` (and MGDA's is not regularised), so float32 would
lose most digits (the reference solver, quadprog, works in float64 too). Callers cast the result
back to the Gramian's dtype.

Cost: ``O(p³)`` per problem and iteration, and a few iterations: up to about 25 for UPGrad (40
for MGDA) on rank-deficient Gramians, whose solutions are degenerate but for the ridge. For
UPGrad on one CPU core: about 0.2 to 2 ms for ``m ≤ 16``, where the fixed overhead of each
tensor operation dominates, and 4 to 15 ms for ``m = 64`` (the interior-point solver took 5 to
8 ms and 60 to 75 ms).
Where a round holds ``[batch, m, m]`` matrices (the masked systems below ``_GATHER_FROM``, the
interior-point fallback), the batch is processed in chunks of at most ``_MAX_BATCH_ENTRIES / m²``
problems, which bounds their memory (NOTE [one batch, its faces shared]).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from ._min_norm import WolfeRun, certified_face_solution

_EXCHANGE_ITERATIONS = 6
# The simplex QP's exchange steps: up to this many, while they progress (NOTE [exchange while it
# progresses]).
_PATIENT_EXCHANGE_ITERATIONS = 48
_EXCHANGE_PATIENCE = 8
_PATIENT_EXCHANGE_FROM = 128
_DESCENT_ITERATIONS = 32
_IPM_ITERATIONS = 30
_POLISH_STEPS = 3
# The simplex QP's interior-point iterations stop once the duality measure has fallen by this
# factor from its start and the free set read off the iterate has not changed for
# _IPM_STABLE_ITERATIONS iterations (NOTE [simplex QP fallback]).
_IPM_MU_REDUCTION = 1e-24
_IPM_STABLE_ITERATIONS = 2
# Fraction of the distance to the boundary of the positive orthant taken by an interior-point step.
_STEP_FRACTION = 0.99
# Shift added to the diagonal of H in the linear systems of the simplex QP, and of both QPs when
# they are retried, relative to trace(H) / m. It only affects the face solutions and search
# directions (the multipliers are always evaluated with the exact H), and keeps the systems
# solvable when H is singular (e.g. duplicated rows of J, or reg_eps = 0).
_JITTER = 1e-12
# Round-off allowed on the signs of an active-set solution, relative to the magnitude of the terms
# they are computed from.
_SIGN_TOL = 16 * torch.finfo(torch.float64).eps
# Round-off allowed on the sign constraints of a polished interior-point solution (unit trace).
_FEASIBILITY_TOL = 1e-10
# Up to this m the face systems are the full [m, m] matrices, masked; above it, the free blocks
# are gathered into [p, p] matrices (p the largest free set), which costs a few more operations
# and a host synchronisation, and pays off once the O(p³) factorisations dominate.
_GATHER_FROM = 48
# Largest bound tr(K) tr(K⁻¹) on the condition number of K for which face systems are solved
# through K⁻¹ (NOTE [complement side]).
_MAX_COMPLEMENT_COND = 1e8
# NOTE [choosing the min-norm start]
# From _WOLFE_FROM variables, MGDA's simplex QP uses Wolfe's algorithm (``_min_norm.py``, NOTE
# [Wolfe's support]) where the active set is slow: where it fails (rank-deficient Gramians
# with the origin in the hull, where its exchanges cycle), Wolfe's run answers before the
# shifted retry and the interior-point method, for up to _WOLFE_CYCLES_PER_VARIABLE · m
# cycles; and first, for up to _WOLFE_FIRST_CYCLES cycles, on Gramians of effective rank
# tr(H)² / |H|²_F at most _WOLFE_FIRST_RANK (a support of a few points: a rank-1 Gramian's
# answer in 2 cycles, where the active set solves faces of all m). A cycle costs 60-150 µs
# in small tensor operations and a product with the corral's columns, and a run takes one to
# three cycles per point of the support, so it does not pay elsewhere: run first on every
# Gramian of effective rank up to m / 32 with m / 4 cycles (the first version), it made
# per-sample training Gramians (effective rank ~12, supports of 60-110) 1.9x faster at
# m = 1024 after 20 training steps, but a review found them 2-2.9x slower at m = 512-896
# after 100-300 steps (2.5-3 cycles a point: the budget spent, then the active set as
# before), and a handoff of the unfinished corral to the active set slower still (its
# exchanges from a small face: 60 ms against 25 at m = 1024 on rank 1). Measured (1 thread,
# A/B in one process, medians of 3): rank-m/2 1.3x faster at m = 512 and 1.7x at 1024
# (1.28 s -> 0.77 s: the interior-point method, replaced); rank-1 1.7-1.8x; the other
# families never meet it and are unchanged. The same minima to 1e-21 of the trace (the
# weights too but where the minimiser is not unique: rank-1, where Wolfe's support has 2
# points, the active set's all m).
_WOLFE_FROM = 512
_WOLFE_FIRST_RANK = 4
_WOLFE_FIRST_CYCLES = 32
_WOLFE_CYCLES_PER_VARIABLE = 4
# Largest number of float64 entries of one [batch, m, m] tensor (2**24: 128 MiB).
_MAX_BATCH_ENTRIES = 2**24
# Largest number of float64 entries of one [chunk, p, p] tensor of gathered face blocks (2**18:
# 2 MiB; NOTE [face blocks in chunks]).
_MAX_BLOCK_ENTRIES = 2**18


# ---------------------------------------------------------------- linear algebra on faces


def _add_to_diagonal(matrix: Tensor, values: Tensor | float) -> Tensor:
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


def _cholesky_solve_columns(factor: Tensor, rhs: Tensor) -> Tensor:
    """:func:`_cholesky_solve` for several right-hand sides per factor, ``rhs [batch, k, n]``."""
    y = torch.linalg.solve_triangular(factor, rhs.transpose(-2, -1), upper=False)
    x = torch.linalg.solve_triangular(factor.transpose(-2, -1), y, upper=True)
    return x.transpose(-2, -1)


def _identity_off(matrix: Tensor, keep: Tensor) -> Tensor:
    """``matrix`` broadcast to ``[batch, n, n]``, its rows and columns off ``keep`` made identity's.

    ``keep`` is a ``[batch, n]`` boolean. Done by multiplying with 0/1 masks: bit-identical to
    ``torch.where``, and several times faster on CPU for these sizes.
    """
    mask = keep.to(matrix.dtype)
    system = matrix * (mask.unsqueeze(-1) * mask.unsqueeze(-2))
    system.diagonal(dim1=-2, dim2=-1).add_(1.0 - mask)
    return system


class _FaceSystems:
    """The matrix ``K`` of the face systems and, once a solve needs it, its inverse."""

    def __init__(self, K: Tensor) -> None:
        self.K = K
        self._inverse: Tensor | None = None
        self._tried = False
        self._padded: dict[str, Tensor] = {}
        self._factor: tuple[Tensor, Tensor] | None = None

    def factor(self) -> tuple[Tensor, Tensor]:
        """The Cholesky factor of ``K`` and its ``info`` (computed once)."""
        if self._factor is None:
            self._factor = torch.linalg.cholesky_ex(self.K)
        return self._factor

    def blocks(self, side: str, order: Tensor, valid: Tensor, problems: int) -> Tensor:
        """The blocks of ``K`` (``side = "K"``) or ``K⁻¹`` (``"inverse"``) on ``order``.

        ``matrix[order_b][:, order_b]`` for each row ``order_b`` of ``order`` (``[batch, p]``),
        with the rows and columns off ``valid`` (``[batch, p]``) made the identity's. For a
        round of many ``problems`` (``order`` may be a chunk of them: NOTE [face blocks in
        chunks]) from ``K`` padded with the identity (:func:`_gather_blocks`, computed once per
        side); for few (``problems p² < 4 m²``, e.g. DualProj's single problem), where padding
        ``K`` would cost more than it saves, gathered from ``K`` and masked. (Until session 33
        the test read the chunk's size: at m = 256, chunks of 13 to 16 problems with ``p``
        about 130 took the masks' way, 1.6 times slower a round.)
        """
        matrix = self.K if side == "K" else self.inverse()
        assert matrix is not None
        batch, p = order.shape
        if side not in self._padded and problems * p * p < 4 * matrix.numel():
            flat = _flat_index(order, matrix.shape[-1])
            index = (flat * matrix.shape[-1]).unsqueeze(-1) + flat.unsqueeze(-2)
            block = matrix.reshape(-1).index_select(0, index.view(-1)).view(batch, p, p)
            return _identity_off(block, valid)
        if side not in self._padded:
            self._padded[side] = _pad_with_identity(matrix)
        return _gather_blocks(self._padded[side], order, valid)

    def inverse(self) -> Tensor | None:
        """``K⁻¹`` (computed once), or None if ``K`` is not safely positive-definite.

        Safely: ``tr(K) tr(K⁻¹) ≤ _MAX_COMPLEMENT_COND`` (a bound on the condition number), so
        that the solves through it (NOTE [complement side]) lose at most 8 digits before their
        refinement step.
        """
        if not self._tried:
            self._tried = True
            factor, info = self.factor()
            if bool(info == 0):  # Host synchronisation, once per solve.
                inverse = torch.cholesky_inverse(factor)
                bound = self.K.diagonal().sum() * inverse.diagonal().sum()
                if bool(bound <= _MAX_COMPLEMENT_COND):  # Host synchronisation.
                    self._inverse = inverse
        return self._inverse


def _pad_with_identity(matrix: Tensor) -> Tensor:
    """``blockdiag(matrix, I)`` (``[2n, 2n]`` for an ``[n, n]`` matrix), flattened."""
    n = matrix.shape[-1]
    padded = matrix.new_zeros(2 * n, 2 * n)
    padded[:n, :n] = matrix
    padded[n:, n:].diagonal().fill_(1.0)
    return padded.view(-1)


def _gather_blocks(padded: Tensor, order: Tensor, valid: Tensor) -> Tensor:
    """``matrix[order_b][:, order_b]`` for each row ``order_b`` of ``order`` (``[batch, p]``).

    Its rows and columns off ``valid`` (``[batch, p]``) are made the identity's: ``padded`` is
    ``blockdiag(matrix, I)`` flattened (:func:`_pad_with_identity`), and the slots off ``valid``
    read its identity block (slot ``j`` as index ``n + j``). So the padding costs no mask
    operations on the ``[batch, p, p]`` blocks, and the gather is one ``index_select`` with flat
    indices (2 to 2.5 times faster than ``index_select`` then ``gather``, then the masks, at
    ``m = 64`` to 128 on one CPU thread).
    """
    batch, p = order.shape
    size = math.isqrt(padded.shape[0])
    slots = torch.arange(p, device=order.device)
    order = _flat_index(torch.where(valid, order, slots + size // 2), size)
    index = (order * size).unsqueeze(-1) + order.unsqueeze(-2)
    return padded.index_select(0, index.view(-1)).view(batch, p, p)


def _flat_index(order: Tensor, size: int) -> Tensor:
    """``order``, indices into an ``[size, size]`` matrix, as int32 when its flat indices fit.

    Half the memory of int64 ones for the ``[batch, p, p]`` flat indices, and at ``m = 256``
    their sum was 36 times faster (17.8 ms in int64: NOTE [face blocks in chunks]).
    """
    return order.to(torch.int32) if size * size < 2**31 else order


def _solve_on_face(systems: _FaceSystems, free: Tensor, rhs: Tensor, *,
                   refine: bool = True) -> tuple[Tensor, Tensor, Correction | None]:
    """Solves ``K_FF z_F = rhs_F`` with ``z = 0`` off ``F``, for each row's free set ``F``.

    The systems are ``K`` with the rows and columns off ``F`` replaced by the identity's, which
    is block-diagonal up to a permutation: the solution is exactly zero off ``F``. Above
    ``_GATHER_FROM`` variables, the blocks are gathered into ``[batch, p, p]`` matrices, ``p``
    the largest ``|F|`` of the batch (the free indices first), padded with the identity; or,
    when the fixed sets ``A`` are the smaller ones, NOTE [complement side]; or, when no variable
    of any problem is fixed (MGDA's first face), ``K``'s own Cholesky factor (computed once, and
    reused for ``K⁻¹`` if a later face needs it: rank-1 Gramians, solved on that face, took
    twice as long through ``K⁻¹`` at m = 256 and 1024).

    Args:
        systems: The symmetric float64 matrix ``K`` of shape ``[m, m]`` (and its inverse).
        free: Boolean free sets, shape ``[batch, m]``.
        rhs: Right-hand sides, shape ``[batch, m]`` (only their free entries are read).
        refine: Whether a solve through ``K⁻¹`` (NOTE [complement side]) makes its refinement
            step here; if not, the caller decides (NOTE [refinement on demand]).

    Returns:
        ``z`` of shape ``[batch, m]``, whether each block was positive-definite (its
        Cholesky factorisation succeeded), and, for a solve through ``K⁻¹`` left without its
        refinement step, the map from a residual ``rhs - K z`` (zero off ``F``) to its
        correction (else None).
    """
    K = systems.K
    batch, m = free.shape
    if m < _GATHER_FROM:
        factor, info = torch.linalg.cholesky_ex(_identity_off(K, free))
        return _cholesky_solve(factor, rhs * free), info == 0, None
    piece = _piece_of(free)  # NOTE [one batch, its faces shared]
    if piece < batch:
        return _solve_in_pieces(systems, free, rhs, piece)
    count = free.sum(dim=-1)
    # Host synchronisation: the sizes of the gathered blocks, on either side.
    p, p_fixed = torch.stack([count.max(), m - count.min()]).tolist()
    if p_fixed == 0:  # every variable free in every problem: K itself, factorised once
        factor, info = systems.factor()
        return _cholesky_solve(factor, rhs), (info == 0).expand(batch), None
    if p_fixed < p and (inverse := systems.inverse()) is not None:
        faces = _Faces.of(free, p_fixed)  # NOTE [problems that share a face]
        return _solve_by_complement(systems, inverse, faces, rhs * free, p_fixed, refine)
    faces = _Faces.of(free, p)
    order, valid = faces.blocks(faces.free, p)  # Free first.
    factors = _Factors(systems, "K", order, valid, faces.groups)
    order, valid = faces.per_problem(order, valid)
    y = factors.solve(rhs.gather(1, order) * valid)
    return torch.zeros_like(rhs).scatter(1, order, y), factors.ok, None


def _piece_of(free: Tensor) -> int:
    """How many problems of ``free``'s batch one face solve takes at a time.

    NOTE [one batch, its faces shared]: the whole batch where its distinct free sets are at most
    :func:`_batch_chunk` (their factors then fit its bound), else that many problems.
    """
    batch, m = free.shape
    chunk = _batch_chunk(m)
    if batch <= chunk:
        return batch
    members, counts = _face_keys(free)
    if counts.shape[0] > chunk:  # Host synchronisation.
        return chunk
    # Equal keys of unequal sets would make the blocks those of every problem: checked
    _, exact = _distinct_sets(free, members, counts.shape[0])
    return batch if bool(exact) else chunk


def _face_keys(free: Tensor) -> tuple[Tensor, Tensor]:
    """Each problem's distinct key and each key's count (NOTE [problems that share a face]).

    Equal sets have equal keys (exact integer sums); unequal ones may collide, which
    :func:`_distinct_sets` tells.
    """
    keys = (free * _hash_weights(free.shape[1], free.device)).sum(dim=-1)
    _, members, counts = torch.unique(keys, return_inverse=True, return_counts=True)
    return members, counts


def _distinct_sets(free: Tensor, members: Tensor, faces: int) -> tuple[Tensor, Tensor]:
    """One set per key (``[faces, m]``), and whether every problem's set is its key's."""
    representatives = torch.empty(faces, dtype=members.dtype, device=free.device).scatter_(
        0, members, torch.arange(free.shape[0], device=free.device))
    distinct = free.index_select(0, representatives)
    return distinct, (distinct.index_select(0, members) == free).all()


def _solve_in_pieces(systems: _FaceSystems, free: Tensor, rhs: Tensor,
                     piece: int) -> tuple[Tensor, Tensor, None]:
    """:func:`_solve_on_face`, ``piece`` problems at a time, each refined at once.

    A correction left for later (NOTE [refinement on demand]) would keep every piece's factors
    until the caller's check, which is the memory the pieces are there to bound.
    """
    parts = [_solve_on_face(systems, part_free, part_rhs)
             for part_free, part_rhs in zip(free.split(piece), rhs.split(piece), strict=True)]
    return torch.cat([part[0] for part in parts]), torch.cat([part[1] for part in parts]), None


# NOTE [problems that share a face]
# UPGrad's m problems on a per-sample Gramian of a classifier share their faces in groups: at
# the benchmark MLP's initialisation the 256 problems of m = 256 had 18 distinct free sets
# (10 of 18 to 33 problems each, about one per class: the samples of a class have nearly
# parallel gradients), the 64 of m = 64 had 11. Problems with the same free set have the same
# face block, so each distinct block is gathered and factorised once (as in the combinatorial
# NNLS of Van Benthem and Keenan, 2004) and every problem solves with its group's factor: the
# same factor as its own, and the right-hand sides of a group are solved side by side (one
# triangular solve with several columns, so the last bits may differ from one column at a
# time). The groups are the distinct keys Σ_{j ∈ F} h_j (40-bit integers h_j, exact integer
# sums: equal sets have equal keys), checked exactly (every problem's set equal to its
# group's; else, a collision of two sets' keys, no grouping). Grouping is used when it at
# least halves the blocks, for batches of _GROUP_FROM problems or more whose factorisations
# cost at least _GROUP_FROM_COST (batch · p³): below, the few operations grouping adds cost
# more than they save (the MLP's m = 64: 0.93 times as fast with it, p = 12). A batch with
# more distinct faces costs the keys and one host synchronisation per round. Measured (upgrad,
# 1 thread, A/B in one process, the same weights to the bit or, rank-1, to 3e-13 relative):
# the MLP's m = 256 1.28-1.30 times faster, m = 128 1.08-1.11; rank-1 Gramians (two faces)
# 1.25 times at m = 64, 4.0 at 128, 7.7-8.5 at 256; random, rank-m/2, ill-conditioned and
# trained-network ones (as many faces as problems) 0.96-1.01, within this machine's noise.
_GROUP_FROM = 16
_GROUP_FROM_COST = 2**19


@functools.lru_cache(maxsize=16)
def _hash_weights(m: int, device: torch.device) -> Tensor:
    """``m`` pseudo-random 40-bit integers (fixed): sums of up to 2^23 of them are exact.

    Drawn, not a multiple of the index modulo 2^40 as until session 55: with those, two free
    sets whose indices have the same sum (``{a, d}`` and ``{b, c}`` with ``a + d = b + c``) got
    the same key, and a helper found ~400 distinct 96-wide faces at m = 1024 colliding in every
    seed tried (caught by the exact check, which then turned grouping off).
    """
    generator = torch.Generator().manual_seed(0x9E3779B97F)
    return torch.randint(1, 1 << 40, (m,), generator=generator).to(device)


class _Groups(NamedTuple):
    """Which problems share a face (NOTE [problems that share a face])."""

    members: Tensor
    """``[batch]``: each problem's distinct face."""
    slots: Tensor
    """``[batch]``: each problem's place among those of its face."""
    width: int
    """The most problems of one face."""


class _Faces:
    """A batch's free sets, and the distinct ones when few problems share each (see the NOTE)."""

    def __init__(self, free: Tensor, groups: _Groups | None) -> None:
        self.free = free
        """The distinct free sets, ``[faces, m]`` (every problem's without ``groups``)."""
        self.groups = groups

    @classmethod
    def of(cls, free: Tensor, p: int) -> _Faces:
        """The free sets ``free`` (``[batch, m]``), grouped where that halves the blocks.

        ``p``: the size of the blocks (their factorisations cost ``batch · p³ / 3``).
        """
        batch, m = free.shape
        if batch < _GROUP_FROM or batch * p**3 < _GROUP_FROM_COST:
            return cls(free, None)
        members, counts = _face_keys(free)  # a collision of unequal sets is caught below
        faces = counts.shape[0]  # Host synchronisation.
        if 2 * faces > batch:
            return cls(free, None)
        distinct, exact = _distinct_sets(free, members, faces)
        exact, width = torch.stack([exact, counts.max()]).tolist()  # Host synchronisation.
        if not exact:
            return cls(free, None)
        by_face = torch.argsort(members, stable=True)
        starts = counts.cumsum(0).sub_(counts)
        slots = torch.empty_like(members).index_copy_(
            0, by_face, torch.arange(batch, device=free.device)
            - starts.index_select(0, members.index_select(0, by_face)))
        return cls(distinct, _Groups(members, slots, width))

    def blocks(self, first: Tensor, p: int) -> tuple[Tensor, Tensor]:
        """Each distinct set's indices with ``first`` true first, the first ``p``, and ``valid``.

        ``first`` is ``[faces, m]`` (a function of :attr:`free`); ``valid[g, j]`` says whether
        slot ``j`` holds one of them.
        """
        order = torch.argsort((~first).view(torch.uint8), dim=-1, stable=True)[:, :p]
        valid = torch.arange(p, device=first.device) < first.sum(dim=-1, keepdim=True)
        return order, valid

    def per_problem(self, *tensors: Tensor) -> tuple[Tensor, ...]:
        """``tensors`` (one row per distinct set) with one row per problem."""
        if self.groups is None:
            return tensors
        return tuple(t.index_select(0, self.groups.members) for t in tensors)


Correction = Callable[[Tensor], Tensor]
"""A face solve's correction for a residual (NOTE [refinement on demand])."""

# NOTE [refinement on demand]
# A solve through K⁻¹ (NOTE [complement side]) loses up to cond(K) · eps, so it takes one step
# of iterative refinement against K. On the non-negative QP's unshifted faces (K = H), the
# residual of the face equations is s = Hz + q on F, which the active-set method computes next
# anyway (with |q| + |H| |z|, the magnitudes its signs are judged by): so the step is taken
# only where some |s_i| on F exceeds _SIGN_TOL times those magnitudes -- where z is not already
# the exact face solution of a problem perturbed by round-off, which is all a refinement step
# in working precision can deliver (the stopping test of LAPACK's refinement, xGERFS: backward
# error at round-off). Well-conditioned faces then need 2 products by K⁻¹ instead of 5 (the
# benchmark MLP at initialisation: cond(H) = 15, the residual at most 3.3 eps of its terms);
# the others pay one more check. Shifted faces (the retry, MGDA's) always refine.

# NOTE [face blocks in chunks]
# The gathered blocks of a round are factorised a chunk of problems at a time, each chunk's
# [chunk, p, p] tensors at most _MAX_BLOCK_ENTRIES (2 MiB) -- the same factors and solutions
# up to round-off (batched LAPACK treats every matrix apart; a chunk's memory alignment may
# change the last bits), without large temporaries: one above glibc's largest mmap threshold
# (32 MiB) is a fresh mapping on every allocation, each page faulted in on first touch, and
# freeing several smaller ones at once can trim the heap with the same effect. At m = 256 (p
# about 130, 35 MiB of blocks per round) one gather took 45 ms, 20 of them the page faults of
# its output and 18 its int64 flat indices (now int32: _flat_index). Measured (1 thread, A/B in
# one process, upgrad, the benchmark's Gramians): m = 256 1.2-1.7 times faster on the families
# the direct solver takes (rank-deficient, ill-conditioned, training), m = 128 1.0-1.5 times,
# unchanged at m = 64 (one chunk). Chunks of 16 MiB still faulted 8-16 thousand pages a call.


class _Factors:
    """The Cholesky factors of gathered face blocks, a chunk of problems at a time.

    NOTE [face blocks in chunks]: each chunk's ``[chunk, p, p]`` tensors stay within
    ``_MAX_BLOCK_ENTRIES``.
    """

    def __init__(self, systems: _FaceSystems, side: str, order: Tensor, valid: Tensor,
                 groups: _Groups | None = None) -> None:
        blocks, p = order.shape
        self.chunk = max(1, _MAX_BLOCK_ENTRIES // max(1, p * p))
        parts = [torch.linalg.cholesky_ex(systems.blocks(side, order[start:start + self.chunk],
                                                         valid[start:start + self.chunk], blocks))
                 for start in range(0, blocks, self.chunk)]
        self.factors = [factor for factor, _ in parts]
        self.ok = torch.cat([info for _, info in parts]) == 0
        # NOTE [problems that share a face]: one block per distinct face, solved for all its
        # problems at once (their right-hand sides side by side)
        self.groups = groups
        if groups is not None:
            self.ok = self.ok.index_select(0, groups.members)

    def solve(self, rhs: Tensor) -> Tensor:
        """``y`` with ``blocks y = rhs`` (``[batch, p]`` both)."""
        if self.groups is None:
            return torch.cat([_cholesky_solve(factor, rhs[k * self.chunk:(k + 1) * self.chunk])
                              for k, factor in enumerate(self.factors)])
        members, slots, width = self.groups
        index = (members, slots)
        faces = sum(factor.shape[0] for factor in self.factors)
        side_by_side = rhs.new_zeros(faces, width, rhs.shape[-1]).index_put_(index, rhs)
        solved = torch.cat([
            _cholesky_solve_columns(factor, side_by_side[k * self.chunk:(k + 1) * self.chunk])
            for k, factor in enumerate(self.factors)])
        return solved[index]


def _solve_by_complement(systems: _FaceSystems, inverse: Tensor, faces: _Faces, b: Tensor,
                         p: int, refine: bool = True) -> tuple[Tensor, Tensor, Correction | None]:
    """:func:`_solve_on_face` through ``W = K⁻¹`` and the fixed sets ``A`` (``b`` zero off F).

    NOTE [complement side]
    ``K_FF z_F = b_F`` with ``z_A = 0`` is ``K z = b + E_A λ`` for the multipliers ``λ`` of the
    constraints ``z_A = 0``: ``z = W b + W E_A λ``, with ``W_AA λ = -(W b)_A``. So one inverse of
    ``K``, shared by every problem, and one ``|A| × |A|`` system per problem replace the
    ``|F| × |F|`` ones: much cheaper when few variables are fixed at zero, as for UPGrad on the
    Gramians of a network early in training, where nearly every constraint is active (m = 64:
    ``|A| ≤ 4`` where ``|F| ≈ 60``). ``W_AA`` is positive-definite when ``K`` is; its blocks are
    gathered and padded as the free ones are (``p`` the largest ``|A|``). Going through ``W``
    costs digits (``cond(K) · eps``, at most ``_MAX_COMPLEMENT_COND · eps``): one step of
    iterative refinement against ``K`` itself wins them back (with ``refine=False``, left to
    the caller: NOTE [refinement on demand]).
    """
    order, valid = faces.blocks(~faces.free, p)  # Fixed first.
    factors = _Factors(systems, "inverse", order, valid, faces.groups)
    order, valid, free = faces.per_problem(order, valid, faces.free)

    def solve(rhs: Tensor) -> Tensor:
        t = rhs @ inverse  # W rhs (W is symmetric).
        if p == 0:
            return t * free
        multipliers = factors.solve(-t.gather(1, order) * valid) * valid
        return (t + torch.zeros_like(t).scatter(1, order, multipliers) @ inverse) * free

    z = solve(b)
    if not refine:  # NOTE [refinement on demand]
        return z, factors.ok, solve
    return z + solve((b - z @ systems.K) * free), factors.ok, None


# ---------------------------------------------------------------- the two problems


class _Problem(Protocol):
    """A batch of QPs, as the active-set method sees it (NOTE [batched QP solver])."""

    def solve_face(self, free: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Face solutions ``z`` for the free sets ``free`` (``[batch, m]``) and their multipliers.

        Returns ``z``, the multipliers ``s``, the thresholds below which an entry of ``z`` and
        of ``s`` is negative beyond round-off (shape ``[batch, 1]`` each), and whether each face
        system was solved.
        """
        ...

    def make_feasible(self, z: Tensor) -> Tensor:
        """A feasible point whose support is within ``z``'s positive entries."""
        ...

    def select(self, index: Tensor) -> _Problem:
        """The sub-batch of the problems ``index``."""
        ...


class _NonnegQP:
    """``min ½ xᵀHx + qᵀx`` s.t. ``x ≥ 0``, for each row of ``q``; face systems use ``K``."""

    def __init__(self, H: Tensor, systems: _FaceSystems, q: Tensor, H_abs: Tensor) -> None:
        self.H, self.systems, self.q, self.H_abs = H, systems, q, H_abs
        self.q_abs = q.abs()
        self.minus_q = -q

    @classmethod
    def new(cls, H: Tensor, q: Tensor, shift: Tensor | None = None) -> _NonnegQP:
        """The problems for the rows of ``q``, their face systems shifted by ``shift · I``."""
        K = H if shift is None else _add_to_diagonal(H, shift)
        return cls(H, _FaceSystems(K), q, H.abs())

    def solve_face(self, free: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        # NOTE [refinement on demand]: on H's own faces (not shifted ones), s is the residual
        z, ok, correct = _solve_on_face(self.systems, free, self.minus_q,
                                        refine=self.systems.K is not self.H)
        s, z_abs, low_s = self._multipliers(z)
        if correct is not None and bool(((s.abs() > -low_s) & free).any()):  # Host sync.
            z = z + correct(-s * free)
            s, z_abs, low_s = self._multipliers(z)
        return z, s, z_abs.amax(dim=-1, keepdim=True).mul_(-_SIGN_TOL), low_s, ok

    def _multipliers(self, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``s = Hz + q``, ``|z|``, and the bound below which an entry of ``s`` is negative."""
        s = torch.addmm(self.q, z, self.H)  # H is symmetric: (H z)ᵀ = zᵀ H.
        z_abs = z.abs()
        # s_i = q_i + (Hz)_i sums terms whose magnitudes add up to |q_i| + (|H| |z|)_i.
        return s, z_abs, torch.addmm(self.q_abs, z_abs, self.H_abs).mul_(-_SIGN_TOL)

    def make_feasible(self, z: Tensor) -> Tensor:
        return z.clamp(min=0.0)

    def select(self, index: Tensor) -> _NonnegQP:
        return _NonnegQP(self.H, self.systems, self.q.index_select(0, index), self.H_abs)


class _SimplexQP:
    """``min ½ wᵀHw`` s.t. ``w ≥ 0``, ``1ᵀw = 1`` (a batch of one); systems use ``H + shift I``."""

    def __init__(self, H: Tensor, shift: Tensor) -> None:
        self.H, self.H_abs = H, H.abs()
        self.systems = _FaceSystems(_add_to_diagonal(H, shift))
        # Whether every face system so far was positive-definite (a tensor: no host sync).
        self.factored = torch.ones((), dtype=torch.bool, device=H.device)

    def solve_face(self, free: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        # On the face, H_FF w_F = ν 1_F: w_F ∝ H_FF⁻¹ 1_F, scaled to sum to one.
        direction, ok, _ = _solve_on_face(self.systems, free, free.to(self.H.dtype))
        self.factored = self.factored & ok.all()
        total = direction.sum(dim=-1, keepdim=True)
        w = direction / total
        hw = w @ self.H
        nu = (hw * w).sum(dim=-1, keepdim=True)  # ν = wᵀHw at a KKT point.
        w_abs = w.abs()
        # s_i = (Hw)_i - ν sums terms whose magnitudes add up to (|H| |w|)_i + |ν|.
        low_s = torch.addmm(nu.abs(), w_abs, self.H_abs).mul_(-_SIGN_TOL)
        low_w = w_abs.amax(dim=-1, keepdim=True).mul_(-_SIGN_TOL)
        return w, hw - nu, low_w, low_s, ok & (total > 0)[:, 0]

    def make_feasible(self, z: Tensor) -> Tensor:
        w = z.clamp(min=0.0)
        total = w.sum(dim=-1, keepdim=True)
        return torch.where(total > 0, w / total, 1.0 / w.shape[-1])

    def select(self, index: Tensor) -> _SimplexQP:
        return self  # A batch of one is never split.


# ---------------------------------------------------------------- the active-set method


def _wrong_signs(free: Tensor, z: Tensor, s: Tensor, low_z: Tensor, low_s: Tensor) -> Tensor:
    """Where a face solution's sign is wrong (``z < 0`` on ``F``, ``s < 0`` off it)."""
    return torch.where(free, z < low_z, s < low_s)


# NOTE [exchange while it progresses]
# Phase 1's exchange steps (block principal pivoting) are not monotone and may cycle where H is
# far from an M-matrix, hence a fixed six before the feasible descent. On MGDA's simplex QP
# from m = 128, six is often too few: on the per-sample Gramian of the weighting benchmark's
# trained digits MLP at m = 1024 the wrong signs fell 503, 406, 295, 234, 150, 99, then (more
# steps) 64, 43, 26, 13, 7, 0 -- solved in 12 face solves -- while after six the descent phase
# dropped one variable per step, ran out after 32, and the interior-point method answered; on
# eigenvalues spread down to 1e-8 they fell with small setbacks to 0 in 22-30 steps. Where the
# minimiser is degenerate (the origin inside the hull of the rows: rank m / 2) they cycle
# (lows of 9, then 5, then nothing lower for dozens of steps). So the simplex QP from
# _PATIENT_EXCHANGE_FROM on exchanges for up to _PATIENT_EXCHANGE_ITERATIONS steps, ending
# after _EXCHANGE_PATIENCE in a row without a new low of the wrong signs: a cycling problem
# pays a few more face solves before the descent phase (and the fallback: NOTE [simplex QP
# fallback]). Below m = 128 a step is mostly fixed overhead and the descent phase solves the
# hard cases about as fast: unchanged. Measured (1 thread, A/B in one process, mgda on the
# weighting benchmark's Gramians, after the fallback change): training 1.1 s -> 0.14 s at
# m = 1024 (8x); ill-conditioned 4x at m = 256, 5.5-6.7x at 512-1024; rank-m/2 0.9-0.95x of
# the fallback change's time (the extra steps); the other families unchanged. Answers are the
# active set's, exact face solves with signs checked (KKT at round-off); the interior-point
# route's differ from them by the jitter's effect (2e-10 at cond 1e8).


def _active_set(problem: _Problem, free: Tensor,
                patience: int | None = None) -> tuple[Tensor, Tensor]:
    """Solves a batch of QPs by the two phases of NOTE [batched QP solver].

    Args:
        problem: The batch of problems.
        free: Initial free sets, shape ``[batch, m]``.
        patience: ``None`` for ``_EXCHANGE_ITERATIONS`` exchange steps; else up to
            ``_PATIENT_EXCHANGE_ITERATIONS``, ending after ``patience`` steps in a row without
            fewer wrong signs than ever before (NOTE [exchange while it progresses]).

    Returns:
        The solutions (anything for unsolved problems), and which problems were solved.
    """
    batch, m = free.shape
    rows = torch.arange(batch, device=free.device)
    solution = torch.zeros(free.shape, dtype=torch.float64, device=free.device)
    solved = torch.zeros(batch, dtype=torch.bool, device=free.device)

    def store(z: Tensor, ok: Tensor, unsolved: Tensor) -> None:
        solution.index_copy_(0, rows, z)
        solved.index_copy_(0, rows, ok & ~unsolved)

    def worth_dropping(left: Tensor, last: bool) -> bool:
        """Whether to drop the solved (or failed) rows from the batch now.

        Solved rows are fixed points of both phases, so they may stay in the batch; for small
        problems, keeping them until half the batch is solved saves operations.
        """
        n_left, n_rows = left.shape[0], rows.shape[0]
        return n_left < n_rows and (last or m >= _GATHER_FROM or 2 * n_left <= n_rows)

    # Phase 1: primal-dual active-set (exchange) steps; with a patience, for as long as the
    # number of wrong signs keeps reaching new lows (NOTE [exchange while it progresses]).
    z = solution
    iterations = _EXCHANGE_ITERATIONS if patience is None else _PATIENT_EXCHANGE_ITERATIONS
    fewest, stalled = None, 0
    for iteration in range(iterations):
        z, s, low_z, low_s, ok = problem.solve_face(free)
        wrong = _wrong_signs(free, z, s, low_z, low_s)
        unsolved = wrong.any(dim=-1)
        left = (ok & unsolved).nonzero().squeeze(-1)  # Host synchronisation.
        if left.shape[0] == 0:
            store(z, ok, unsolved)
            return solution, solved
        last = iteration == iterations - 1
        if patience is not None:
            count = int(wrong[left].sum())  # Host synchronisation.
            fewest, stalled = (count, 0) if fewest is None or count < fewest else (
                fewest, stalled + 1)
            last = last or stalled >= patience
        # Solved rows leave before phase 2, whose first step would move them off their face.
        if worth_dropping(left, last=last):
            store(z, ok, unsolved)
            rows, free, wrong, z = rows[left], free[left], wrong[left], z[left]
            problem = problem.select(left)
        free = free ^ wrong
        if last:
            break

    # Phase 2: feasible descent, from phase 1's last face solutions made feasible.
    x = problem.make_feasible(z)
    free = x > 0
    single = torch.zeros_like(free[:, :1])
    for iteration in range(_DESCENT_ITERATIONS):
        z, s, low_z, low_s, ok = problem.solve_face(free)
        negative_z = free & (z < low_z)
        negative_s = ~free & (s < low_s)
        infeasible = negative_z.any(dim=-1, keepdim=True)
        unsolved = infeasible[:, 0] | negative_s.any(dim=-1)
        left = (ok & unsolved).nonzero().squeeze(-1)  # Host synchronisation.
        if left.shape[0] == 0:
            store(z, ok, unsolved)
            return solution, solved
        # Infeasible z: move from x towards z until the first free variable reaches zero.
        ratio = torch.where(negative_z, x / (x - z), torch.inf)
        step = ratio.amin(dim=-1, keepdim=True).clamp(min=0.0, max=1.0)  # x may be ~-eps.
        leaving = negative_z & (ratio <= step)
        # Feasible z: it becomes x, and the variables with s < 0 join F; only the most negative
        # one right after a step of length zero (the classic rule, which guarantees progress).
        lowest = torch.where(negative_s, s, torch.inf).amin(dim=-1, keepdim=True)
        joining = negative_s & (~single | (s == lowest))
        single = (single | (step <= 0.0)) & infeasible
        x = torch.where(infeasible, torch.where(leaving, 0.0, torch.lerp(x, z, step)), z)
        free = torch.where(infeasible, free & ~leaving, free | joining)
        if worth_dropping(left, last=iteration == _DESCENT_ITERATIONS - 1):
            store(z, ok, unsolved)
            rows, free, x, single = rows[left], free[left], x[left], single[left]
            problem = problem.select(left)
    return solution, solved


# ---------------------------------------------------------------- the interior-point fallback


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


def _is_feasible(x: Tensor, s: Tensor) -> Tensor:
    """Whether ``x ≥ 0`` and ``s ≥ 0`` up to ``_FEASIBILITY_TOL``, for each row of a batch."""
    return (x >= -_FEASIBILITY_TOL).all(dim=-1) & (s >= -_FEASIBILITY_TOL).all(dim=-1)


def _where_rows(condition: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """Row-wise ``torch.where`` for a batch of vectors and a per-row condition."""
    return torch.where(condition.unsqueeze(-1), a, b)


def _interior_point_nonneg(H: Tensor, q: Tensor) -> Tensor:
    """The fallback for :func:`solve_nonneg_qp`: interior-point iterations, then polishing."""
    k, m = q.shape
    batch_H = H.expand(k, m, m)
    x = torch.ones_like(q)
    s = torch.ones_like(q)
    for _ in range(_IPM_ITERATIONS):
        # Newton step on  Hx + q - s = 0,  x ∘ s = σμ:  (H + S/X) dx = r_c / x - r_d.
        r_d = q + x @ H - s
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


def _interior_point_simplex(H: Tensor, jitter: Tensor) -> Tensor:
    """The fallback for :func:`solve_simplex_qp`: interior-point iterations, then polishing."""
    m = H.shape[0]
    ones = torch.ones(1, m, dtype=H.dtype, device=H.device)
    w = ones / m
    nu = (w @ H).amin(dim=-1, keepdim=True) - 1.0
    s = w @ H - nu  # ≥ 1, and exact dual feasibility  H w - ν 1 - s = 0.
    converged = (w * s).mean() * _IPM_MU_REDUCTION  # NOTE [simplex QP fallback]
    free, stable = w > s, 0
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
        previous, free = free, w > s
        stable = stable + 1 if bool((free == previous).all()) else 0  # Host synchronisation.
        if stable >= _IPM_STABLE_ITERATIONS and bool((w * s).mean() <= converged):
            break

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
    return solution.clamp(min=0.0)


# ---------------------------------------------------------------- public entry points


def solve_nonneg_qp(H: Tensor, q: Tensor, free: Tensor | None = None) -> Tensor:
    """Solves ``min_x ½ xᵀHx + qᵀx`` s.t. ``x ≥ 0`` for each row of ``q``.

    See NOTE [batched QP solver] at the top of this module.

    Args:
        H: Symmetric positive-definite float64 matrix of shape ``[m, m]``. A singular one is
            accepted too (then one of the minimisers is returned, if the problem is bounded).
        q: Float64 tensor of shape ``[k, m]``: one linear term per problem.
        free: Initial free sets, boolean ``[k, m]`` (e.g. the previous solution's support, to
            warm-start); by default the variables with ``q_j < 0``.

    Returns:
        The minimisers, shape ``[k, m]``, non-negative.
    """
    m = q.shape[-1]
    if free is None:
        free = _default_free(q)
    # NOTE [one batch, its faces shared]
    # A round's memory is bounded by _MAX_BATCH_ENTRIES: below _GATHER_FROM its systems are
    # [batch, m, m] matrices, so the batch is solved in chunks of _batch_chunk(m) problems. From
    # _GATHER_FROM on the active set holds [batch, m] tensors, and what grows with the batch is
    # the factors of its face blocks (up to p² each, kept for the round's solves) and the
    # right-hand sides of a grouped face side by side; so the batch stays whole, and each round
    # (_solve_on_face) takes it whole when its distinct free sets are at most _batch_chunk(m) --
    # their problems then share one factorisation per face across the batch (NOTE [problems
    # that share a face]) -- and else _batch_chunk(m) problems at a time, as before. Until
    # session 55 the batch was cut into chunks of 2^24 / m² problems up front (from m = 257 for
    # UPGrad's k = m; 16 at m = 1024), each factorising the same faces again: a rank-1
    # Gramian, two faces in all, took 64 rounds of a ~1000-wide face at m = 1024 (0.78 s,
    # against 0.17 s as one batch). A first version kept every round whole: a review found the
    # factors of an ill-conditioned Gramian's round at m = 768 holding 1 GB (37 MB before).
    chunk = _batch_chunk(m) if m < _GATHER_FROM else q.shape[0]
    if q.shape[0] > chunk:
        return torch.cat([_solve_nonneg_qp(H, part, part_free) for part, part_free
                          in zip(torch.split(q, chunk), torch.split(free, chunk), strict=True)])
    return _solve_nonneg_qp(H, q, free)


def _default_free(q: Tensor) -> Tensor:
    """The free sets from ``x = 0``: the solution unless ``s = q`` has negative entries."""
    return q < -_SIGN_TOL * q.abs().amax(dim=-1, keepdim=True)


# NOTE [cold start probe]
# The direct solver's default start, F = {j : q_j < 0} (from x = 0), is right for nearly every
# problem of a batch or for nearly none. On UPGrad's m problems (m = 32 to 256, the weighting
# benchmark's Gramians): all of them on rank-1 Gramians and 96-100 % on the per-sample Gramian of
# the benchmark MLP 784-512-512-10 at initialisation (|F| about 0.9 m: per-sample gradients that
# mostly conflict), none on random, rank-m/2, ill-conditioned and trained-network ones. Where it
# is right, one round from there solves nearly everything, and the ADMM guess (NOTE [ADMM face
# identification] in _admm.py) or the synchronous CG rounds cost more than they save: the direct
# solver from x = 0 against from the guess, 1 thread, m = 32 / 64 / 128 / 256: 0.6 / 1.8 / 4.9
# / 17 ms against 1.1 / 2.1 / 7.7 / 28 ms at initialisation, 0.6 / 1.3 / 12 / 76 against 1.1 /
# 2.8 / 16 / 125 ms on rank-1 Gramians. So cold_start_holds solves _COLD_PROBES problems spread
# over the batch on their default faces first (one gathered face system each: 0.14-0.5 ms at
# m = 128-256 where it fails, 0.5-0.9 ms where it holds); if each is right, the whole batch
# starts there (_nonneg._COLD_PROBE_FROM says from which m). The answer is the direct solver's
# either way (exact, sign-checked): only the time depends on the verdict.
_COLD_PROBES = 2
_PROBE_TOL = 1e-9


def cold_start_holds(H: Tensor, q: Tensor) -> bool:
    """Whether the default free sets solve a few problems spread over the batch.

    NOTE [cold start probe]: then :func:`solve_nonneg_qp` from its default start is the fastest
    way to the whole batch. A verdict, not a solution: each probe's block ``H_FF`` is gathered
    and factorised on its own, and signs count as wrong beyond ``_PROBE_TOL`` times the largest
    ``|q|``. Nothing but the time depends on it.

    Example:
        >>> import torch
        >>> a = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
        >>> H = torch.outer(a, a) / 5.25 + 1e-4 * torch.eye(3, dtype=torch.float64)  # rank-1
        >>> cold_start_holds(H, H)  # UPGrad's problems: q = H e_i
        True
        >>> H = torch.tensor([[1.0, -0.9], [-0.9, 1.0]], dtype=torch.float64)
        >>> cold_start_holds(H, torch.tensor([[-1.0, 0.1]], dtype=torch.float64))  # x₂ > 0 too
        False
    """
    k = q.shape[0]
    for row in torch.linspace(0, k - 1, min(k, _COLD_PROBES)).round().long().tolist():
        sample = q[row]
        free = _default_free(sample.unsqueeze(0))[0]
        index = free.nonzero().squeeze(-1)  # Host synchronisation.
        factor, info = torch.linalg.cholesky_ex(H.index_select(0, index).index_select(1, index))
        z = torch.zeros_like(sample).index_copy_(
            0, index, _cholesky_solve(factor, -sample.index_select(0, index)))
        s = torch.addmv(sample, H, z)
        low = -_PROBE_TOL * sample.abs().amax()
        if bool(info != 0) or bool(_wrong_signs(free, z, s, low, low).any()):  # Host sync.
            return False
    return True


def _solve_nonneg_qp(H: Tensor, q: Tensor, free: Tensor) -> Tensor:
    """:func:`solve_nonneg_qp` for one chunk of right-hand sides."""
    x, solved = _active_set(_NonnegQP.new(H, q), free)
    if bool(solved.all()):  # Host synchronisation.
        return x.clamp(min=0.0)
    # Some face system was not positive-definite (H singular, e.g. reg_eps = 0, or indefinite by
    # round-off), or the iterations ran out: retry those problems with shifted systems.
    unsolved = (~solved).nonzero().squeeze(-1)
    q = q.index_select(0, unsolved)
    shift = _regularizing_shift(H)
    retried, solved = _active_set(_NonnegQP.new(H, q, shift), free.index_select(0, unsolved))
    if not bool(solved.all()):  # Host synchronisation.
        left = (~solved).nonzero().squeeze(-1)
        shifted = _add_to_diagonal(H, shift)  # its iterations hold [batch, m, m] systems
        retried.index_copy_(0, left, torch.cat([
            _interior_point_nonneg(shifted, part)
            for part in torch.split(q[left], _batch_chunk(H.shape[-1]))]))
    return x.index_copy_(0, unsolved, retried).clamp(min=0.0)


def _batch_chunk(m: int) -> int:
    """How many problems' ``[m, m]`` systems fit in ``_MAX_BATCH_ENTRIES`` float64 entries."""
    return max(1, _MAX_BATCH_ENTRIES // max(m * m, 1))


def _regularizing_shift(H: Tensor) -> Tensor:
    """The diagonal shift that makes ``H``'s systems safely positive-definite, if they are not.

    ``max(0, _JITTER · trace(H) / m - 2 λ_min(H))``: zero for a positive-definite ``H`` (the
    problem is unchanged), about the jitter for a singular one, and enough to make an indefinite
    one (by round-off, e.g. a float32 Gramian of rank < m) positive-definite.
    """
    eigenvalue = torch.linalg.eigvalsh(H)[0]
    return (_JITTER * H.diagonal().mean() - 2.0 * eigenvalue).clamp(min=0.0)


def _regularizing_shift_per_row(H: Tensor) -> Tensor:
    """:func:`_regularizing_shift` in each row's units (NOTE [jitter in each row's units]).

    ``(_JITTER + max(0, -2 λ_min(D^-½ H D^-½))) · diag(H)`` (``D = diag(H)``, positive here):
    the shift that makes the Jacobi-scaled ``H`` safely positive-definite, scaled back. A
    float32 Gramian's round-off makes ``H`` indefinite by about its own ulps, relative to
    each row's terms: a shift of ``2 |λ_min(H)|`` on every row swamped the short ones (MGDA
    up to 9e5 times the shortest row's vertex on graded rank-deficient float32 Gramians; a
    review's find, session 57).
    """
    scale = H.diagonal().rsqrt()
    scaled = H * scale.unsqueeze(0) * scale.unsqueeze(1)
    eigenvalue = torch.linalg.eigvalsh(scaled)[0]
    return (_JITTER + (-2.0 * eigenvalue).clamp(min=0.0)) * H.diagonal()


# NOTE [jitter in each row's units]
# The simplex QP's face systems are H_FF + diag(jitter) (a singular H has singular faces). A
# jitter of 1e-12 · tr(H) / m on every row swamped rows whose H_ii is below it: with row norms
# spread over 1e5 (three tasks' gradients of norms 1e-5, 1 and 1e5) MGDA returned a Jᵀw 290
# times the min-norm point's, and on per-sample Gramians late in training (norms 1e-13 to 1)
# a wᵀHw 2e10 times a vertex's, all within 1e-10 · tr(H) of the optimum, the tolerance then
# documented (a helper's hunt, session 57). The jitter is now 1e-12 · H_ii on row i: the same
# relative regularisation of every row whatever its scale, and exact answers on those cases
# (Jᵀw to round-off of the closed form; wᵀHw below the smallest H_ii). A zero row (H_ii = 0,
# hence a zero row and column of a PSD H) gets none: its vertex is a minimiser (wᵀHw = 0) and
# is returned at once.

# NOTE [simplex QP fallback]
# On MGDA's Gramians where the origin is (nearly) in the convex hull of the rows -- rank-deficient
# (m = 256, rank 128) or with eigenvalues down to 1e-8 times the largest -- the minimiser is
# degenerate, phase 1 does not settle and phase 2 drops one variable per iteration: both phases
# run out (38 face solves) and, before session 34, were retried with H shifted by
# _regularizing_shift (an eigenvalue of H: 130 ms at m = 1024) -- the same 38 face solves again,
# since that shift is within a factor of three of the jitter once H + jitter I has factored --
# before the interior-point method answered. Now, when the start was the full face and every face
# system factored, the iterations go straight to the interior-point method, with the systems of
# H itself where H - jitter / 2 I factors (where _regularizing_shift gives zero: λ_min above
# half the jitter), else the jitter (it gives 0 to 3 jitters there, since H + jitter I
# factored; a barely positive-definite H keeps a shift); a face that did not factor, or a warm
# start from a smaller face, still takes the shifted retry. And the interior-point iterations
# stop once the duality measure has fallen by _IPM_MU_REDUCTION (1e-24) from its start with the
# free set unchanged for _IPM_STABLE_ITERATIONS: Mehrotra's steps get there in 17-24 of the 30
# at m = 256-1024, after which nothing changes. Measured (1 thread, A/B in one process, the
# weighting benchmark's Gramians): rank-m/2 and ill-conditioned 1.45-1.6x faster at m = 256,
# 1.5-1.6x at m = 512 and 1024 (1.3 s -> 0.8 s), the same weights (ill-conditioned: equal to
# the last bit; rank-m/2: equal Jᵀw, equal objective to 1e-21 of the trace); the other families
# never left the active set and were unchanged. (Since then the ill-conditioned and training
# Gramians mostly stay in the active set: NOTE [exchange while it progresses].)


def _effective_rank(H: Tensor) -> float:
    """``tr(H)² / |H|²_F`` (the participation ratio of the eigenvalues: 1 for rank one)."""
    trace, frobenius = H.diagonal().sum(), torch.linalg.matrix_norm(H)
    return float(trace * trace / (frobenius * frobenius))  # Host synchronisation.


def _by_wolfe(H: Tensor, wolfe: WolfeRun, cycles: int) -> Tensor | None:
    """Up to ``cycles`` more of Wolfe's cycles, then the face's certified solution, if any."""
    if wolfe.status != "running" or wolfe.run(cycles) != "converged":
        return None
    return certified_face_solution(H, wolfe.support())


def solve_simplex_qp(H: Tensor, free: Tensor | None = None) -> Tensor:
    """Solves ``min_w ½ wᵀHw`` s.t. ``w ≥ 0`` and ``Σ w = 1``.

    See NOTE [batched QP solver] at the top of this module.

    Args:
        H: Symmetric positive semi-definite float64 matrix of shape ``[m, m]``, not all zero.
        free: Initial support guess, boolean ``[m]`` with a ``True`` entry (e.g. the previous
            solution's support, to warm-start); by default every variable.

    Returns:
        A minimiser of shape ``[m]`` (unique in ``Jᵀw`` but not necessarily in ``w`` when ``H``
        is singular).
    """
    m = H.shape[0]
    zero_rows = H.diagonal() == 0
    if bool(zero_rows.any()):  # Host synchronisation. A zero row of a PSD H: its vertex
        return zero_rows.cumsum(0).eq(1).logical_and(zero_rows).to(H.dtype)  # has wᵀHw = 0
    wolfe = None
    if free is None and m >= _WOLFE_FROM and _effective_rank(H) <= _WOLFE_FIRST_RANK:
        wolfe = WolfeRun(H)  # NOTE [choosing the min-norm start]
        certified = _by_wolfe(H, wolfe, _WOLFE_FIRST_CYCLES)
        if certified is not None:
            return certified
    if free is None:
        free = torch.ones(m, dtype=torch.bool, device=H.device)
    free = free.reshape(1, m)
    jitter = _JITTER * H.diagonal()  # NOTE [jitter in each row's units]
    problem = _SimplexQP(H, jitter)
    patience = _EXCHANGE_PATIENCE if m >= _PATIENT_EXCHANGE_FROM else None
    w, solved = _active_set(problem, free, patience)
    if not bool(solved.all()) and m >= _WOLFE_FROM:  # Host synchronisation.
        # Wolfe's run, resumed or from the start, before the shifted retry and the
        # interior-point method (NOTE [choosing the min-norm start]).
        certified = _by_wolfe(H, WolfeRun(H) if wolfe is None else wolfe,
                              _WOLFE_CYCLES_PER_VARIABLE * m)
        if certified is not None:
            return certified
    if not bool(solved.all()):  # Host synchronisation.
        # NOTE [simplex QP fallback]
        if bool(free.all() & problem.factored):  # Host synchronisation.
            # H + jitter I factored (the first face): the retry would repeat the same steps.
            # _regularizing_shift's value without its eigenvalue: zero where H - jitter / 2 I
            # factors (λ_min > jitter / 2), else the jitter (it would give 0 to 3 jitters).
            _, info = torch.linalg.cholesky_ex(_add_to_diagonal(H, -jitter / 2))
            shift = torch.where(info == 0, torch.zeros_like(jitter), jitter)
        else:
            # A face system was not positive-definite (H indefinite by round-off, e.g. a
            # float32 Gramian of rank < m), or the start was not the full face: retry with
            # shifted systems.
            shift = _regularizing_shift_per_row(H)
            w, solved = _active_set(_SimplexQP(H, shift), free, patience)
        if not bool(solved.all()):  # Host synchronisation.
            w = _interior_point_simplex(H, shift)
    return w.clamp(min=0.0).squeeze(0)
