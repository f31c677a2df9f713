"""Free sets for the batched non-negative QPs: a few ADMM iterations with one shared inverse.

NOTE [ADMM face identification]
The direct solver (``_qp.py``, NOTE [batched QP solver]) solves ``min ½ xᵀHx + qᵀx`` s.t.
``x ≥ 0`` exactly, one face per problem and round; what it costs is the number of rounds (each
a batch of gathered Cholesky factorisations, about 1 ms for ``k = m = 64`` on one CPU thread),
and its primal-dual active-set steps from ``x = 0`` need 4 (random Gramians) to 20 (rank-
deficient ones, where they cycle and the slower descent phase takes over). This module guesses
the faces first, cheaply, so that one round (rarely two or three) finishes the job; the answer
is the direct solver's, exact and sign-checked, whatever the guess.

The guess is ADMM (Douglas-Rachford splitting of ``x = z``, ``z ≥ 0``) on the Jacobi-scaled
problem (``H → DHD``, ``D = diag(H)^{-1/2}``), with one shared ``M = (H + ρI)⁻¹`` for all
problems. Its scaled iterates ``x, z = max(0, x + u), u`` fold into one variable
``v = x + u`` (``z - u = |v|``, ``u = min(v, 0)``):

    v ← c + ½ v + |v| (ρM - ½I),      c = -q M,

and over-relaxed (``v ← v + λ (T(v) - v)`` for that map ``T``, ``λ = _RELAXATION``):

    v ← λ c + (1 - λ/2) v + |v| λ (ρM - ½I),

three tensor operations per iteration (one ``[k, m] × [m, m]`` GEMM); the free sets are
``{v > 0}``. At a fixed point ``s = Hz + q = -ρu``, so ``v = z - s / ρ``: a warm start ``x0``
enters as ``v = x0 - s(x0) / ρ`` (a fixed point if ``x0`` is the solution), a cold one as
``v = 0`` (``z = u = 0``; ``u = -q / ρ`` instead identified fewer faces, none on rank-1 and
ill-conditioned Gramians). ``ρ = _RHO_FACTOR · √(λ_min λ_max)`` of the scaled ``H`` (one
``eigvalsh``): the geometric mean of the spectrum is the classic choice for ADMM on a QP, and
the measured best ``ρ`` (fewest direct rounds after a fixed number of iterations) was 0.3 to 1
times it on the benchmark's five Gramian families for m = 16 to 128 (random and training ones
prefer the larger, rank-deficient and ill-conditioned ones the smaller). Every
``_CHECK_EVERY`` iterations (one host synchronisation) the signs of ``v`` are compared with
those ``_SETTLE`` iterations earlier; the iterations stop when at most one problem in
``_UNSETTLED_PER`` changed, or after ``iterations``. With ``λ = 1.8`` instead of 1 (same
``ρ``) the guess needed fewer iterations (m = 64: 180 instead of 240 over the five families)
and left fewer wrong faces: of the 15 cases m = 64, 128, 256, 9 needed a second direct round
with ``λ = 1``, 2 with ``λ = 1.8`` (1.5: 5; 1.6: 3 at m = 256).
"""

from __future__ import annotations

import torch
from torch import Tensor

_RHO_FACTOR = 0.5
# Over-relaxation λ of the Douglas-Rachford step (1 is plain ADMM; OSQP's default is 1.6).
_RELAXATION = 1.8
_ITERATIONS = 60
_CHECK_EVERY = 15
_SETTLE = 5
# ... or when at most one problem in this many still changed (it costs the direct solver one
# more round, on a batch of a few problems).
_UNSETTLED_PER = 64
# The iterations in float32 from this many variables on (a guess needs no more; the GEMMs are
# twice as fast). From 32 (was 128) on: A/B on the benchmark's five Gramian families, the same
# faces and bit-identical weights, the whole upgrad call 1.0-1.2 times faster at m = 32 to 96.
_FLOAT32_FROM = 32
# ρ is at least this fraction of λ_max (H singular: reg_eps = 0 and a rank-deficient Gramian).
_MIN_RHO = 1e-6


def admm_faces(H: Tensor, q: Tensor, x0: Tensor | None = None,
               iterations: int = _ITERATIONS) -> Tensor:
    """Guesses the free sets of ``min ½ xᵀHx + qᵀx`` s.t. ``x ≥ 0`` for the rows of ``q``.

    See NOTE [ADMM face identification] at the top of this module.

    Args:
        H: Symmetric positive-definite float64 matrix of shape ``[m, m]``.
        q: Float64 tensor of shape ``[k, m]``.
        x0: A starting point (float64 ``[k, m]``, ``≥ 0``), e.g. a previous solution.
        iterations: Largest number of ADMM iterations.

    Returns:
        Boolean ``[k, m]``: the variables guessed positive at each solution (all ``False`` if
        ``H`` is too far from positive-definite for the shared inverse).

    Example:
        >>> import torch
        >>> H = torch.tensor([[2.0, -1.0], [-1.0, 2.0]], dtype=torch.float64)
        >>> admm_faces(H, torch.tensor([[-2.0, 2.0], [1.0, -1.0]], dtype=torch.float64))
        tensor([[ True, False],
                [False,  True]])
    """
    m = H.shape[0]
    scale = H.diagonal().clamp(min=torch.finfo(H.dtype).tiny).rsqrt()
    H_scaled = H * scale.unsqueeze(-1) * scale
    eigenvalues = torch.linalg.eigvalsh(H_scaled)
    largest = eigenvalues[-1]
    rho = _RHO_FACTOR * (eigenvalues[0].clamp(min=_MIN_RHO * largest) * largest).sqrt()
    eye = torch.eye(m, dtype=H.dtype, device=H.device)
    # Where the factorisation fails (H not positive-definite, e.g. zero with reg_eps = 0), M = 0:
    # v stays zero, every free set empty (the direct solver's rounds from x = 0); without a host
    # synchronisation (the identity stands in for the factor, cholesky_inverse raises on zeros).
    factor, info = torch.linalg.cholesky_ex(torch.addcmul(H_scaled, rho, eye))
    factorised = info == 0
    M = torch.where(factorised, torch.cholesky_inverse(torch.where(factorised, factor, eye)), 0.0)
    work = torch.float32 if m >= _FLOAT32_FROM else H.dtype
    step = torch.addcmul(-0.5 * eye, rho, M).mul_(_RELAXATION).to(work)
    q_scaled = q * scale
    c = (q_scaled @ M).mul_(-_RELAXATION).to(work)
    # Cold: from z = u = 0 (starting from the multipliers' guess u = -q / ρ instead identified
    # fewer faces: none for rank-1 and ill-conditioned Gramians). Warm, for the problems whose
    # x0 is not zero: from the point v = x0 - s / ρ, which is fixed if x0 is the solution.
    if x0 is None:
        v = torch.zeros_like(c)
    else:
        x_scaled = x0 / scale
        v = torch.addmm(q_scaled, x_scaled, H_scaled).div_(-rho).add_(x_scaled)
        v = v.mul_((x0 > 0).any(dim=-1, keepdim=True)).to(work)
    settled = v > 0
    allowed = q.shape[0] // _UNSETTLED_PER
    for iteration in range(1, iterations + 1):
        v = torch.addmm(torch.add(c, v, alpha=1.0 - 0.5 * _RELAXATION), v.abs(), step)
        if iteration % _CHECK_EVERY == _CHECK_EVERY - _SETTLE:
            settled = v > 0
        elif iteration % _CHECK_EVERY == 0 and iteration < iterations:
            unsettled = (settled != (v > 0)).any(dim=-1).sum()
            if int(unsettled) <= allowed:  # Host synchronisation.
                break
    return v > 0
