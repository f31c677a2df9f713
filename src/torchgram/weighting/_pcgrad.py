"""PCGrad (Yu et al., 2020): gradient surgery, computed from the Gramian only."""

from __future__ import annotations

import torch
from torch import Tensor

from torchgram._core.functional import public_math

from ._derivatives import refusing_derivatives
from ._validation import check_gramian


@refusing_derivatives("pcgrad")
@public_math  # NOTE [autocast], NOTE [the caller's function modes]
def pcgrad(G: Tensor, /, *, generator: torch.Generator | None = None) -> Tensor:
    r"""Weights of PCGrad: each gradient projected off the gradients it conflicts with, summed.

    From "Gradient Surgery for Multi-Task Learning" (Yu et al., NeurIPS 2020,
    https://arxiv.org/abs/2001.06782), Algorithm 1. For every row ``g_i`` of ``J``, starting
    from ``g_i^PC = g_i`` and visiting the other rows ``g_j`` in a random order,

    .. math::

        \text{if } \langle g_i^{PC}, g_j \rangle < 0: \quad
        g_i^{PC} \leftarrow g_i^{PC} - \frac{\langle g_i^{PC}, g_j \rangle}{|g_j|^2}\, g_j,

    and the update is ``Σ_i g_i^PC``. Every ``g_i^PC`` stays a combination ``Jᵀc_i`` of the
    rows, with ``⟨g_i^PC, g_j⟩ = (G c_i)_j`` and ``|g_j|² = G_jj``, so the whole algorithm runs on
    ``G``: ``w = Σ_i c_i``. As in torchjd's ``PCGradWeighting``, the row itself is skipped and the
    projected rows are summed (not averaged). The ``m`` rows are processed together, as batched
    tensor code (``m`` steps of ``O(m)`` work per row, and one ``[m, m] × [m, m]`` GEMM every 64
    steps: ``O(m³)`` in total) in float64 on ``G``'s device, each with its own random order.

    Args:
        G: The Gramian ``J Jᵀ`` of shape ``[m, m]``, symmetric positive semi-definite.
        generator: Source of the random visiting orders (any device; the orders are moved to
            ``G``'s device). ``None`` uses the global generator of ``G``'s device.

    Returns:
        The weights ``w``, shape ``[m]``, with ``G``'s dtype and device. Without conflicts
        (``G ≥ 0`` entrywise) they are all one. They are not differentiable with respect to ``G``.

    Raises:
        NotImplementedError: If a derivative reaches the weights through ``G`` (a backward,
            ``torch.func.grad`` or ``jvp``: pass ``G.detach()`` to hold them constant), or
            ``G`` is batched by ``torch.func.vmap``.
        TypeError: If ``G`` is not a real floating-point tensor or ``generator`` is not a
            ``torch.Generator``.
        ValueError: If ``G`` is not a finite, square, symmetric matrix.

    Example:
        With two rows the order does not matter: each is projected off the other.

        >>> import torch
        >>> import torchgram.weighting as weighting
        >>> J = torch.tensor([[1.0, 0.0], [-1.0, 1.0]])
        >>> weighting.pcgrad(J @ J.T, generator=torch.Generator().manual_seed(0))
        tensor([2.0000, 1.5000])
    """
    G = check_gramian(G, "pcgrad")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            "torchgram.weighting.pcgrad: expected generator to be a torch.Generator or None, "
            f"got {type(generator).__name__}."
        )
    m = G.shape[0]
    device = G.device if generator is None else generator.device
    keys = torch.rand((m, m), generator=generator, device=device, dtype=torch.float64)
    orders = keys.argsort(dim=1).to(G.device)  # Row i: the order in which row i visits the others.
    return _pcgrad_with_orders(G, orders)


# Steps of the visiting orders handled between two updates of all inner products (NOTE [blocked
# PCGrad]): each block costs one [m, m] × [m, m] GEMM, each step a few operations on [m, block].
_BLOCK = 64


def _pcgrad_with_orders(G: Tensor, orders: Tensor) -> Tensor:
    """PCGrad weights for given visiting orders; ``orders[i]`` is a permutation of ``range(m)``.

    NOTE [blocked PCGrad]
    Row ``i`` keeps ``g_i^PC = Jᵀc_i`` through its coefficients ``c_i`` and the inner products
    ``y_i = G c_i`` with every row (``⟨g_i^PC, g_j⟩ = y_ij``). Step ``t`` of row ``i`` visits
    ``j = orders[i, t]`` and, on a conflict, changes the single coefficient ``c_ij`` by
    ``-δ = -y_ij / G_jj``, hence ``y_i`` by ``-δ G_j`` (``O(m)`` per row and step: ``O(m³)`` in all,
    in ``m`` sequential steps). The steps are taken in blocks of ``_BLOCK``: within a block, row
    ``i`` only needs its inner products with the rows ``J_i`` it visits there, ``y_ij`` at the
    block's start less the changes of the block's earlier steps (``Σ_u δ_u G[j, j_u]``, from
    ``G[J_i, J_i]``, gathered once per block as an ``[m, block, block]`` tensor), and at the
    block's end one GEMM brings every ``y_i`` up to date (``y -= Δ G``, ``Δ`` the block's changes
    of the coefficients). The same arithmetic as the step-by-step algorithm, up to the order of
    the float64 additions.
    """
    G64 = G.to(torch.float64)  # float64: the projections are chained m - 1 times.
    m = G64.shape[0]
    rows = torch.arange(m, device=G.device)
    squared_norms = G64.diagonal()
    safe_norms = torch.where(squared_norms > 0, squared_norms, 1.0)
    inner = G64.clone()  # Row i: y_i = G c_i, with c_i = e_i to start with.
    weights = torch.ones(m, dtype=G64.dtype, device=G.device)  # Σ_i c_i.
    for start in range(0, m, _BLOCK):
        block = orders[:, start:start + _BLOCK]  # [m, b]: the rows each row visits in the block.
        # Row i: G restricted to the rows it visits in the block, [m, b, b].
        block_gramians = torch.take(G64, block.unsqueeze(-1) * m + block.unsqueeze(-2))
        start_inner = inner.gather(1, block)  # ⟨g_i^PC, g_j⟩ at the block's start, [m, b].
        is_self = block == rows.unsqueeze(-1)
        norms = safe_norms[block]
        changes = torch.zeros_like(start_inner)
        for step in range(block.shape[1]):
            # ⟨g_i^PC, g_j⟩ now: at the block's start, less the block's earlier changes.
            current = start_inner[:, step] - (block_gramians[:, step] * changes).sum(dim=-1)
            conflict = (current < 0) & ~is_self[:, step]
            changes[:, step] = torch.where(conflict, current / norms[:, step], 0.0)
        delta_c = torch.zeros_like(inner).scatter_(1, block, changes)  # c_i -= Δ_i.
        inner -= delta_c @ G64
        weights -= delta_c.sum(dim=0)
    return weights.to(G.dtype)
