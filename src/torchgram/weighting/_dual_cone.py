"""Projection onto the dual cone of the rows of J, in Gramian form (UPGrad, DualProj).

Proposition 1 of Quinton & Rey (2024): for ``G = J Jᵀ`` and weights ``u``, the projection of
``Jᵀu`` onto the dual cone ``{x : J x ≥ 0}`` of the rows of ``J`` is ``Jᵀv`` with

    v = argmin_{v ≥ u} vᵀ G v.

Writing ``v = u + x`` turns it into ``min_{x ≥ 0} ½ xᵀGx + (G u)ᵀx``, the non-negative QP
solved by :mod:`._nonneg` (NOTE [choosing the non-negative QP solver]). As in torchjd, ``G``
is first normalised by its trace (the squared Frobenius norm of ``J``; a trace below
``norm_eps`` gives the zero matrix) and regularised by ``reg_eps · I``, which makes the QP
strictly convex, hence its solution unique, even when ``J`` is rank-deficient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._nonneg import solve_nonneg
from ._validation import check_gramian, check_non_negative, scaled_by_a_power_of_two
from ._warm_start import WarmStart, check_state


def normalize_and_regularize(G: Tensor, norm_eps: float, reg_eps: float) -> Tensor:
    """Returns ``G / tr(G) + reg_eps · I`` in float64 (``reg_eps · I`` if ``tr(G) < norm_eps``).

    The two operations are done in ``G``'s precision (at least float32: ``reg_eps = 1e-4`` added
    to diagonal entries of order ``1 / m`` would lose most of its digits in half precision), then
    the result is cast to float64 for the QP. That loses nothing beyond ``G``'s own round-off and
    gives the QP exactly the matrix that torchjd's ``QuadprogProjector`` gives quadprog, so the
    two agree to float64 round-off for float32 Gramians too. ``torch.where`` rather than ``if``
    keeps it free of host synchronisation.
    """
    G, exponent = scaled_by_a_power_of_two(G.to(torch.promote_types(G.dtype, torch.float32)))
    trace = G.diagonal().sum()  # of G · 2^-e: no overflow, and G / trace is unchanged
    threshold = torch.ldexp(torch.tensor(norm_eps, dtype=torch.float64, device=G.device),
                            -exponent)
    is_zero = (trace < threshold) | (trace <= 0)  # `<= 0` matters for norm_eps = 0 only.
    normalized = torch.where(is_zero, torch.zeros_like(G), G / trace)
    eye = torch.eye(G.shape[0], dtype=G.dtype, device=G.device)
    return (normalized + reg_eps * eye).to(torch.float64)


def project_weights(U: Tensor | None, H: Tensor, state: WarmStart | None = None,
                    name: str = "") -> Tensor:
    """Solves ``min_{v ≥ u} vᵀ H v`` for each row ``u ≥ 0`` of ``U`` (shape ``[k, m]``).

    Args:
        U: Float64 tensor of shape ``[k, m]``, or ``None`` for the identity (UPGrad's unit
            vectors: then ``q = H`` exactly, without the ``[m, m] × [m, m]`` product).
        H: Normalised and regularised float64 Gramian of shape ``[m, m]`` (positive-definite).
        state: Where the previous call of the weighting ``name`` left its solution ``v - u``
            (used as the starting point if it fits), and where this call leaves its own.
        name: The weighting, to tell its solutions apart in ``state``.

    Returns:
        The minimisers ``v``, shape ``[k, m]``, float64, with ``v ≥ u``.
    """
    q = H.clone() if U is None else U @ H
    x0 = None if state is None else state.load(name, q)
    solution = solve_nonneg(H, q, x0)
    if state is not None:
        state.store(name, solution.x, solution.solver, solution.iterations)
    if U is None:
        U = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    return U + solution.x


def projected_preferences(G: Tensor, name: str, norm_eps: float, reg_eps: float,
                          preferences: Callable[[int, Tensor], Tensor] | None,
                          state: WarmStart | None = None) -> Tensor:
    """Validate ``G``, then project ``Jᵀu`` onto the dual cone for each preference row ``u``.

    ``preferences(m, H)`` returns the ``[k, m]`` weights ``U`` to project (float64, on ``H``'s
    device), ``None`` means the ``m`` unit vectors (UPGrad); the result is the ``[k, m]``
    float64 minimisers of :func:`project_weights`, or an empty ``[0, 0]`` tensor for
    ``m = 0``. ``name`` is the weighting's name, for messages; ``state`` the caller's warm
    start, if any.
    """
    G = check_gramian(G, name)
    norm_eps = check_non_negative(norm_eps, "norm_eps", name)
    reg_eps = check_non_negative(reg_eps, "reg_eps", name)
    state = check_state(state, name)
    m = G.shape[0]
    if m == 0:
        return G.new_zeros(0, 0, dtype=torch.float64)
    H = normalize_and_regularize(G, norm_eps, reg_eps)
    return project_weights(None if preferences is None else preferences(m, H), H, state, name)
