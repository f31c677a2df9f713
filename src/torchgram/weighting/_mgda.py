"""MGDA (Désidéri, 2012): the min-norm point of the convex hull of the rows of J."""

from __future__ import annotations

import torch
from torch import Tensor

from torchgram._core.functional import public_math

from ._derivatives import refusing_derivatives
from ._qp import solve_simplex_qp
from ._validation import check_gramian, scaled_by_a_power_of_two
from ._warm_start import WarmStart, check_state


@refusing_derivatives("mgda")
@public_math  # NOTE [autocast], NOTE [the caller's function modes]
def mgda(G: Tensor, /, *, state: WarmStart | None = None) -> Tensor:
    r"""Weights of MGDA: the minimum-norm point of the convex hull of the rows of ``J``.

    From "Multiple-gradient descent algorithm (MGDA) for multiobjective optimization"
    (Désidéri, 2012, https://doi.org/10.1016/j.crma.2012.03.014), popularised for multi-task
    learning by Sener & Koltun (2018, https://arxiv.org/abs/1810.04650):

    .. math::

        w = \operatorname*{argmin}_{w \ge 0,\ \mathbf 1^\top w = 1} w^\top G w .

    ``Jᵀw`` is the common descent direction of largest guaranteed decrease (zero at a Pareto
    stationary point). The optimality (KKT) conditions, which the result satisfies to about
    1e-10 relative to ``trace(G)`` in float64 (the solver regularises each row in its own
    units, so rows whose norms spread over several decades are resolved too: NOTE [jitter in
    each row's units]; once ``G``'s diagonal spans more than float64's 16 digits, a vertex
    of the shortest rows can lie below ``G``'s round-off and the answer is then optimal to
    that bound only, as any float64 solver's), are
    ``w ≥ 0``, ``Σ w = 1`` and ``(G w)_i ≥ wᵀGw`` for every ``i``, with equality where
    ``w_i > 0``. A zero row gives its vertex (``Jᵀw = 0``).

    Unlike torchjd's ``MGDAWeighting`` (Frank–Wolfe, stopped after ``max_iters`` iterations or a
    step below ``epsilon``), the quadratic program is solved exactly, by an active-set method
    that ends with an exact solve on the support, in float64, as tensor code on ``G``'s device
    (NOTE [batched QP solver] in ``torchgram/weighting/_qp.py``); from ``m = 512``, on
    Gramians of a few directions and where the active set fails, the support is sought by
    Wolfe's min-norm-point algorithm, and its exact face solution is kept only if its signs
    check (NOTE [choosing the min-norm start]).
    ``G`` is first divided by its trace, which leaves the minimiser unchanged.

    When rows of ``J`` are linearly dependent the minimiser ``Jᵀw`` is unique but ``w`` may not
    be; one of the minimisers is returned. A zero Gramian (every point is a minimiser) gives the
    uniform weights ``1 / m``.

    Args:
        G: The Gramian ``J Jᵀ`` of shape ``[m, m]``, symmetric positive semi-definite.
        state: A :class:`WarmStart` that a training loop passes to every call: the active-set
            method then starts from the previous call's support (the losses with ``w_i > 0``)
            instead of all of them, which saves rounds when consecutive Gramians are close.
            The update ``Jᵀw`` does not depend on it (nor do the weights, unless the Gramian is
            rank-deficient and its minimising weights are not unique).

    Returns:
        The weights ``w`` in the probability simplex, shape ``[m]``, with ``G``'s dtype and
        device. They are not differentiable with respect to ``G``.

    Raises:
        NotImplementedError: If a derivative reaches the weights through ``G`` (a backward,
            ``torch.func.grad`` or ``jvp``: pass ``G.detach()`` to hold them constant), or
            ``G`` is batched by ``torch.func.vmap``.
        TypeError: If ``G`` is not a real floating-point tensor, or ``state`` not a WarmStart.
        ValueError: If ``G`` is not a finite, square, symmetric matrix.

    Example:
        The min-norm point of the segment between ``(1, 0)`` and ``(0, 2)`` is ``(0.8, 0.4)``,
        i.e. ``0.8 · (1, 0) + 0.2 · (0, 2)``:

        >>> import torch
        >>> import torchgram.weighting as weighting
        >>> J = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
        >>> w = weighting.mgda(J @ J.T)
        >>> w
        tensor([0.8000, 0.2000])
        >>> J.T @ w
        tensor([0.8000, 0.4000])
    """
    G = check_gramian(G, "mgda")
    state = check_state(state, "mgda")
    m = G.shape[0]
    if m == 0:
        return G.new_zeros(0)
    # float64: the support is decided by the signs of exact solves on candidate supports, up to
    # a few ulps, and the Gramian may be singular; float32 would resolve neither.
    G64 = scaled_by_a_power_of_two(G.to(torch.float64))[0]  # a trace that cannot overflow
    trace = G64.diagonal().sum()
    if bool(trace > 0):  # Host synchronisation (the solver has many).
        H = G64 / trace
        previous = None if state is None else state.load("mgda", H[0])
        w = solve_simplex_qp(H, None if previous is None or not previous.any() else previous > 0)
    else:  # A zero Gramian: every point minimises; the uniform one.
        w = torch.full((m,), 1.0 / m, dtype=torch.float64, device=G.device)
    if state is not None:
        state.store("mgda", w, "direct", 0)
    return w.to(G.dtype)
