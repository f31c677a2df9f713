"""The support of MGDA's min-norm point by Wolfe's algorithm, and its exact face solution.

NOTE [Wolfe's support]
MGDA's simplex QP ``min wᵀHw`` over the simplex (``_qp.py``, NOTE [batched QP solver]) is the
minimum-norm point of the convex hull of ``J``'s rows, whose Gram matrix is ``H``. The
active-set method starts from the full face (every loss in the support) and drops variables a
block at a time: each step factorises the whole free block, ``O(m³)`` at first. Where the
support is small (per-sample Gramians of a trained classifier: 112 of m = 1024) that start
is far from the answer: 10 to 12 face solves of sizes falling from 1024, about 90 ms of the
call's 100 ms; where the origin is in the hull (rank-deficient Gramians), the steps cycle and
the interior-point fallback answers after a second (NOTE [exchange while it progresses]).

Wolfe's algorithm ("Finding the nearest point in a polytope", Math. Programming 11, 1976)
grows the support instead. It keeps a *corral*: affinely independent points ``S`` whose
affine hull's min-norm point ``x = Σ_S w_i p_i`` has ``w > 0``. A major cycle adds the point
``j`` minimising ``<p_j, x> = (Hw)_j`` if it is below ``|x|² = wᵀHw``; a minor cycle moves
``w`` towards the new affine minimiser until a weight reaches zero and drops that point. With
``H`` only (no points), the affine minimiser on ``S`` solves the bordered system
``[[0, 1ᵀ], [1, H_SS]] [μ; v] = [1; 0]``, which is non-singular for affinely independent
points even where ``H_SS`` is singular (the origin in their hull); its inverse is kept and
updated in ``O(|S|²)`` per added or dropped point (a Schur complement, and its inverse, with
the dropped point swapped to the end first). A cycle costs one ``[m, |S|] × [|S|]`` product
and about 30 small tensor operations, so the whole run costs about ``|support|`` cycles.

The run's answer is only a guess of the support (it decides in floating point, with
tolerances): :func:`certified_face_solution` solves the face exactly, once, and accepts it
only if its signs are right by the active set's own test (``_qp.py``, NOTE [batched QP
solver]). Otherwise, or when the run stops (a budget of cycles, an affinely dependent point),
the active set goes on, from the guessed support where there is one.

When it runs, and what it gained: NOTE [choosing the min-norm start] in ``_qp.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

# An added point must improve |x|² by more than this, relative to |x|² + |x| |p_j| (a bound
# on the magnitudes of the terms compared: relative to the largest |p_i|², Wolfe's choice,
# points whose norms are spread over orders of magnitude stop the run too early).
_IMPROVEMENT_TOL = 1e-12
# A Schur complement below this (relative to the largest |p_i|²) is an affinely dependent point:
# the run is over, at the origin if |x|² is below _ORIGIN_TOL times the largest |p_i|² (the
# origin in the hull: every further point is in the corral's affine hull), else failed.
_DEPENDENT_TOL = 1e-13
_ORIGIN_TOL = 1e-20
# The corral's buffers first hold this many points (then double as needed).
_FIRST_CAPACITY = 64
# Round-off allowed on the signs (as _qp._SIGN_TOL).
_SIGN_TOL = 16 * torch.finfo(torch.float64).eps


class _Corral:
    """Wolfe's corral: the points ``S``, their weights, the columns ``H[:, S]``, ``B⁻¹``.

    ``B`` is the bordered matrix ``[[0, 1ᵀ], [1, H_SS]]``; position ``r`` of ``S`` is row and
    column ``r + 1`` of ``B``.
    """

    def __init__(self, H: Tensor, first: int) -> None:
        m = H.shape[0]
        self.H = H
        capacity = min(m, _FIRST_CAPACITY) + 1
        self.inverse = H.new_zeros(capacity + 1, capacity + 1)
        self.columns = H.new_empty(m, capacity)
        self.index = torch.empty(capacity, dtype=torch.long, device=H.device)
        self.member = torch.zeros(m, dtype=torch.bool, device=H.device)
        self.size = 0
        self.inverse[0, 0] = -H[first, first]
        self.inverse[0, 1] = self.inverse[1, 0] = 1.0
        self._append(first)
        self.weights = H.new_ones(1)

    def _grow(self) -> None:
        """Doubles the buffers' capacity (they start small: supports are often small)."""
        capacity = min(2 * self.columns.shape[1], self.H.shape[0] + 1)
        inverse = self.H.new_zeros(capacity + 1, capacity + 1)
        used = self.size + 1
        inverse[:used, :used] = self.inverse[:used, :used]
        columns = self.H.new_empty(self.H.shape[0], capacity)
        columns[:, :self.size] = self.columns[:, :self.size]
        index = torch.empty(capacity, dtype=torch.long, device=self.H.device)
        index[:self.size] = self.index[:self.size]
        self.inverse, self.columns, self.index = inverse, columns, index

    def _append(self, j: int) -> None:
        self.columns[:, self.size] = self.H[j]
        self.index[self.size] = j
        self.member[j] = True
        self.size += 1

    def add(self, j: int, dependent_tol: float) -> bool:
        """Adds point ``j`` (weight 0); ``False`` if it is affinely dependent on ``S``."""
        k = self.size
        if k + 1 >= self.columns.shape[1]:
            self._grow()
        border = torch.cat([self.H.new_ones(1), self.H[j].index_select(0, self.index[:k])])
        block = self.inverse[:k + 1, :k + 1]
        product = block @ border
        schur = float(self.H[j, j] - border @ product)  # Host synchronisation.
        if not schur > dependent_tol:
            return False
        block.addr_(product, product, alpha=1.0 / schur)
        self.inverse[k + 1, :k + 1] = product * (-1.0 / schur)
        self.inverse[:k + 1, k + 1] = product * (-1.0 / schur)
        self.inverse[k + 1, k + 1] = 1.0 / schur
        self._append(j)
        self.weights = torch.cat([self.weights, self.weights.new_zeros(1)])
        return True

    def drop(self, position: int) -> None:
        """Removes the point at ``position`` (swapped to the end, then a Schur downdate)."""
        last = self.size - 1
        if position != last:
            a, b = position + 1, last + 1
            rows = [b, a]
            self.inverse[[a, b], :last + 2] = self.inverse[rows, :last + 2]
            self.inverse[:last + 2, [a, b]] = self.inverse[:last + 2, rows]
            self.columns[:, [position, last]] = self.columns[:, [last, position]]
            self.index[[position, last]] = self.index[[last, position]]
            self.weights[[position, last]] = self.weights[[last, position]]
        self.member[self.index[last]] = False
        column = self.inverse[:last + 1, last + 1].clone()
        self.inverse[:last + 1, :last + 1].addr_(
            column, column, alpha=-1.0 / float(self.inverse[last + 1, last + 1]))
        self.inverse[last + 1, :last + 2] = 0.0
        self.inverse[:last + 2, last + 1] = 0.0
        self.size = last
        self.weights = self.weights[:last]

    def affine_minimiser(self) -> Tensor:
        """The weights of the min-norm point of ``S``'s affine hull (they sum to one)."""
        return self.inverse[1:self.size + 1, 0]


class WolfeRun:
    """Wolfe's algorithm on ``H``, resumable: :meth:`run` goes on from where it stopped.

    See NOTE [Wolfe's support] at the top of this module.

    Args:
        H: Symmetric positive semi-definite float64 ``[m, m]`` matrix, not all zero.

    Example:
        The points ``(1, 0)``, ``(0, 2)`` and ``(2, 2)``: the min-norm point of their hull,
        ``(0.8, 0.4)``, is on the segment between the first two.

        >>> J = torch.tensor([[1.0, 0.0], [0.0, 2.0], [2.0, 2.0]], dtype=torch.float64)
        >>> wolfe = WolfeRun(J @ J.T)
        >>> wolfe.run(10), wolfe.support()
        ('converged', tensor([ True,  True, False]))
    """

    def __init__(self, H: Tensor) -> None:
        diagonal = H.diagonal()
        scale = float(diagonal.amax())  # Host synchronisation.
        self.status = "running" if scale > 0.0 else "failed"
        self.dependent_tol = _DEPENDENT_TOL * scale
        self.origin_tol = _ORIGIN_TOL * scale
        self.corral = _Corral(H, int(diagonal.argmin()))
        self.cycles = 0

    def support(self) -> Tensor:
        """The corral's points, boolean ``[m]``."""
        return self.corral.member.clone()

    def run(self, max_cycles: int) -> str:
        """Up to ``max_cycles`` more major cycles.

        Returns:
            ``"converged"`` (the corral is the support of a min-norm point), ``"running"``
            (out of cycles: :meth:`run` may go on) or ``"failed"`` (an affinely dependent
            point, or no progress: the run is over).
        """
        corral = self.corral
        for _ in range(max_cycles):
            if self.status != "running":
                break
            self.cycles += 1
            k = corral.size
            products = corral.columns[:, :k] @ corral.weights  # <p_j, x> for every j
            norm = corral.weights @ products.index_select(0, corral.index[:k])  # |x|²
            j = products.argmin()
            bound = norm + (norm.clamp(min=0.0) * corral.H[j, j].clamp(min=0.0)).sqrt()
            j_value, improvement, member, norm_value = torch.stack(  # One host synchronisation.
                [j.to(norm.dtype), norm - products[j] - _IMPROVEMENT_TOL * bound,
                 corral.member[j].to(norm.dtype), norm]).tolist()
            if improvement <= 0.0 or member:
                self.status = "converged"
            elif not corral.add(int(j_value), self.dependent_tol):
                self.status = "converged" if norm_value <= self.origin_tol else "failed"
            elif not self._minor_cycles():
                self.status = "failed"
        return self.status

    def _minor_cycles(self) -> bool:
        """Moves to the new corral's affine minimiser, dropping points; ``False`` if stuck."""
        corral = self.corral
        for _ in range(corral.size):  # Each minor cycle drops at least one point.
            target = corral.affine_minimiser()
            outside = target <= 0.0
            if not bool(outside.any()):  # Host synchronisation.
                corral.weights = target.clone()
                return True
            weights = corral.weights
            ratio = torch.where(outside, weights / (weights - target), torch.inf)
            step = ratio.amin().clamp(0.0, 1.0)
            weights = torch.lerp(weights, target, step)
            leaving = (outside & (ratio <= step)).nonzero().squeeze(-1).tolist()  # Host sync.
            if len(leaving) >= corral.size:
                return False
            corral.weights = weights
            for position in sorted(leaving, reverse=True):
                corral.drop(position)
            corral.weights = corral.weights.clamp(min=0.0)
            corral.weights = corral.weights / corral.weights.sum()
        return False


def certified_face_solution(H: Tensor, support: Tensor) -> Tensor | None:
    """The exact minimiser on the face ``support`` if it is the simplex QP's solution.

    The face's min-norm point solves the bordered system of NOTE [Wolfe's support] (one LU
    factorisation and one step of iterative refinement, in float64); it is accepted when its
    signs are right by the active set's test (``_qp.py``): ``w ≥ -16 ulps · max |w|`` on the
    face and ``s = Hw - wᵀHw ≥ -16 ulps · ((|H| |w|)_i + wᵀHw)`` off it, or, in place of the
    second, when ``|wᵀHw| ≤ 16 ulps · |w|ᵀ|H||w|``: ``Jᵀw`` is the origin up to round-off,
    which no point of the hull beats (``s`` is all round-off there).

    Args:
        H: Symmetric positive semi-definite float64 ``[m, m]`` matrix.
        support: Boolean ``[m]``, not all ``False``.

    Returns:
        The minimiser ``w`` (``[m]``, ``≥ 0``), or ``None`` if the face is not the solution's
        (or its bordered system is singular).

    Example:
        >>> H = torch.tensor([[1.0, 0.0], [0.0, 4.0]], dtype=torch.float64)
        >>> certified_face_solution(H, torch.tensor([True, True]))
        tensor([0.8000, 0.2000], dtype=torch.float64)
        >>> certified_face_solution(H, torch.tensor([False, True])) is None
        True
    """
    index = support.nonzero().squeeze(-1)
    k = index.shape[0]
    bordered = H.new_zeros(k + 1, k + 1)
    bordered[1:, 1:] = H[index][:, index]
    bordered[0, 1:] = 1.0
    bordered[1:, 0] = 1.0
    rhs = H.new_zeros(k + 1, 1)
    rhs[0] = 1.0
    factors, pivots, info = torch.linalg.lu_factor_ex(bordered)
    if int(info) != 0:  # Host synchronisation.
        return None
    solution = torch.linalg.lu_solve(factors, pivots, rhs)
    solution = solution + torch.linalg.lu_solve(factors, pivots, rhs - bordered @ solution)
    face_weights = solution[1:, 0]
    w = H.new_zeros(H.shape[0])
    w[index] = face_weights
    columns = H[:, index]
    hw = columns @ face_weights
    nu = w @ hw
    magnitudes = columns.abs() @ face_weights.abs()  # of the terms of (Hw)_i
    low_s = (magnitudes + nu.abs()).mul_(-_SIGN_TOL)
    low_w = -_SIGN_TOL * face_weights.abs().amax()
    # wᵀHw = |Jᵀw|² zero up to its round-off: the origin, the least |x|² there is, whatever the
    # signs of s (all zero but for round-off there: s_i = <p_i, x> - |x|²).
    at_origin = nu.abs() <= _SIGN_TOL * (w.abs() @ magnitudes)
    right = (face_weights >= low_w).all() & (at_origin | ((hw - nu >= low_s) | support).all())
    right = right & torch.isfinite(face_weights).all()
    if not bool(right):  # Host synchronisation.
        return None
    return w.clamp(min=0.0)
