"""PCGrad (Yu et al., 2020): gradient surgery, computed from the Gramian only."""

from __future__ import annotations

import torch
from torch import Tensor

from ._validation import check_gramian


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
    tensor code (``m`` steps, ``O(m³)`` in total) in float64 on ``G``'s device, each with its own
    random order.

    Args:
        G: The Gramian ``J Jᵀ`` of shape ``[m, m]``, symmetric positive semi-definite.
        generator: Source of the random visiting orders (any device; the orders are moved to
            ``G``'s device). ``None`` uses the global generator of ``G``'s device.

    Returns:
        The weights ``w``, shape ``[m]``, with ``G``'s dtype and device. Without conflicts
        (``G ≥ 0`` entrywise) they are all one. They are not differentiable with respect to ``G``.

    Raises:
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


def _pcgrad_with_orders(G: Tensor, orders: Tensor) -> Tensor:
    """PCGrad weights for given visiting orders; ``orders[i]`` is a permutation of ``range(m)``."""
    G64 = G.to(torch.float64)  # float64: the projections are chained m - 1 times.
    m = G64.shape[0]
    rows = torch.arange(m, device=G.device)
    coefficients = torch.eye(m, dtype=G64.dtype, device=G.device)  # Row i: c_i.
    squared_norms = G64.diagonal()
    safe_norms = torch.where(squared_norms > 0, squared_norms, 1.0)
    for step in range(m):
        j = orders[:, step]
        inner = (G64[j] * coefficients).sum(dim=1)  # ⟨g_i^PC, g_j⟩ = (G c_i)_j.
        conflict = (j != rows) & (inner < 0)
        shift = torch.where(conflict, inner / safe_norms[j], 0.0)
        coefficients[rows, j] -= shift
    return coefficients.sum(dim=0).to(G.dtype)
