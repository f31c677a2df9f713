"""Shared argument checks of the weightings: every message names the public function."""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from torchgram._core._torch_compat import is_batched

_PREFIX = "torchgram.weighting."
# From this many rows, G's transpose is read through a contiguous copy (NOTE [transposed reads]).
_BLOCKED_TRANSPOSE_FROM = 512
_HOW_TO = (
    "Pass G = J @ J.T, where J is the [m, n] Jacobian with one row per loss "
    "(or torchgram.gramian's result for a function with m outputs)."
)


def symmetry_rtol(dtype: torch.dtype) -> float:
    """Relative tolerance on ``max |G - Gᵀ|`` (and on negative diagonal entries) for a dtype.

    ``sqrt(eps)`` is loose enough for Gramians summed block by block in the given precision
    (about 3e-4 for float32, 1.5e-8 for float64) and still catches a matrix that is not a Gramian.
    """
    return math.sqrt(torch.finfo(dtype).eps)


def check_gramian(G: object, name: str) -> Tensor:
    """Checks that ``G`` is a finite, square, symmetric floating-point matrix that may be a Gramian.

    The value checks (finite entries, symmetry, non-negative diagonal) cost one host
    synchronisation in total; they are reduced to a single boolean tensor first.

    Args:
        G: The candidate Gramian.
        name: Name of the public function, for the error messages.

    Returns:
        ``G`` detached and exactly symmetrised, ``(G + Gᵀ) / 2``.

    Raises:
        TypeError: If ``G`` is not a real floating-point tensor with the dense layout.
        NotImplementedError: If ``G`` is batched by ``torch.func.vmap``.
        ValueError: If ``G`` is on the meta device (no values), is not square and 2-D, has
            NaN or infinite entries, is not symmetric up to :func:`symmetry_rtol`, has a
            negative diagonal entry or an entry larger than its row's and column's norms allow
            (``|G[i, j]| > sqrt(G[i, i] G[j, j])``, up to the same tolerance).
    """
    api = _PREFIX + name
    if not isinstance(G, Tensor):
        raise TypeError(
            f"{api}: expected the Gramian as a torch.Tensor, got {type(G).__name__}. {_HOW_TO}"
        )
    if is_batched(G):  # NOTE [weights are not differentiable] in _derivatives.py
        raise NotImplementedError(
            f"{api}: expected a Gramian outside torch.func.vmap, got a batched one: the weighting "
            "decides its iterations on the host, which vmap cannot batch. Call it on each "
            f"Gramian, e.g. torch.stack([{api}(G) for G in gramians])."
        )
    if not G.is_floating_point():
        raise TypeError(
            f"{api}: expected a real floating-point Gramian, got dtype {G.dtype}. "
            "Convert it first, e.g. G.to(torch.float32)."
        )
    if G.layout != torch.strided:
        raise TypeError(
            f"{api}: expected a dense Gramian (layout torch.strided), got layout {G.layout}. "
            "Convert it first, e.g. G.to_dense()."
        )
    if G.is_meta:
        raise ValueError(
            f"{api}: expected a Gramian with values, got a tensor of shape {tuple(G.shape)} on "
            "the meta device (shapes only). Compute it on a real device first."
        )
    if G.ndim != 2 or G.shape[0] != G.shape[1]:
        raise ValueError(
            f"{api}: expected a square symmetric [m, m] Gramian, got shape "
            f"{tuple(G.shape)}. {_HOW_TO}"
        )
    G = G.detach()
    if G.numel() == 0:
        return G
    lowest, highest = G.aminmax()  # NaN if G has a NaN
    largest = torch.maximum(-lowest, highest)
    tol = symmetry_rtol(G.dtype) * largest
    # Computed once, checked, then removed. NOTE [transposed reads]: ``G - G.T`` reads G down
    # its columns, which thrashes the cache where rows are a large power of two apart: 7.7 ms
    # at m = 1024 against 1.2 ms at m = 1000 (float64, one CPU thread; 56 ms at m = 2048).
    # torch's blocked transposing copy does not: ``G - G.T.contiguous()`` 2.3 ms at m = 1024.
    transposed = G.T.contiguous() if G.shape[0] >= _BLOCKED_TRANSPOSE_FROM else G.T
    asymmetry = G - transposed
    asymmetry_low, asymmetry_high = asymmetry.aminmax()
    norms = G.diagonal().clamp_min(0).sqrt()
    # Reductions to one value each (``isfinite(G).all()`` and ``.any()`` of a comparison took
    # 190 and 90 µs at m = 256 on one CPU thread, the whole check 3 times as long)
    bad = torch.stack(
        [
            ~torch.isfinite(largest),  # inf for ±inf entries, NaN for a NaN
            torch.maximum(-asymmetry_low, asymmetry_high) > tol,
            G.diagonal().amin() < -tol,
            torch.addcmul(G.abs(), norms[:, None], norms[None, :], value=-1).amax() > tol,
        ]
    )
    not_finite, not_symmetric, negative_diagonal, too_large = bad.tolist()  # The one sync.
    if not_finite:
        nan = bool(G.isnan().any())
        overflow = "" if nan else (
            f" Infinite entries alone can also be an overflow of G's {G.dtype} (above "
            f"{torch.finfo(G.dtype).max:.3g}: squared gradient norms) while the gradients "
            "are finite: scale the losses down or compute in float64.")
        raise ValueError(
            f"{api}: expected a Gramian with finite entries, got "
            f"{'NaN' if nan else 'infinite'} values. Check the losses and the Jacobian for "
            f"NaN/inf first.{overflow}"
        )
    if not_symmetric:
        asym = float(asymmetry.abs().amax())
        raise ValueError(
            f"{api}: expected a square symmetric [m, m] Gramian, got max |G - G.T| = {asym:.3g}, "
            f"above the tolerance {float(tol):.3g} (= {symmetry_rtol(G.dtype):.3g} * max |G|). "
            f"{_HOW_TO}"
        )
    if negative_diagonal:
        low = float(G.diagonal().amin())
        raise ValueError(
            f"{api}: expected a positive semi-definite Gramian, got the negative "
            f"diagonal entry {low:.3g} (G[i, i] = |J[i]|² >= 0). {_HOW_TO}"
        )
    if too_large:  # Cauchy-Schwarz: |G[i, j]| = |<J[i], J[j]>| <= |J[i]| |J[j]|
        excess = G.abs() - norms[:, None] * norms[None, :]
        i, j = divmod(int(excess.argmax()), G.shape[0])
        raise ValueError(
            f"{api}: expected a positive semi-definite Gramian, got |G[{i}, {j}]| = "
            f"{float(G[i, j].abs()):.3g} above sqrt(G[{i}, {i}] G[{j}, {j}]) = "
            f"{float(norms[i] * norms[j]):.3g} (|<J[i], J[j]>| <= |J[i]| |J[j]|). {_HOW_TO}"
        )
    # (G + Gᵀ) / 2 without overflow near the dtype's largest value.
    return torch.add(G, asymmetry, alpha=-0.5)


def check_non_negative(value: float, argument: str, name: str) -> float:
    """``value`` as a float; a ValueError naming ``name`` if it is negative, NaN or inf.

    A TypeError if it is no real number (a string: torch's "'<=' not supported" before
    session 59); a one-element real tensor reads as its number.
    """
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
        value = float(value.detach())  # a one-element tensor reads as its number
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{_PREFIX}{name}: expected {argument} to be a number, got "
                        f"{type(value).__name__} {value!r:.40}. Pass e.g. {argument}=1e-4.")
    if not 0.0 <= value < math.inf:
        raise ValueError(f"{_PREFIX}{name}: expected a finite {argument} >= 0, got {value!r}. "
                         f"Pass a finite non-negative number, e.g. {argument}=1e-4.")
    return float(value)


def scaled_by_a_power_of_two(G: Tensor) -> tuple[Tensor, Tensor]:
    """``G · 2^-e`` with ``2^(e-1) <= max |G| < 2^e``, and ``e`` (an int32 tensor).

    Only the exponents of the entries change, so quotients of entries and sums (a trace) of the
    scaled matrix are those of ``G`` scaled, to the bit, unless ``G``'s own sum overflowed:
    for the weightings that ``G -> c G`` leaves unchanged, a finite ``G`` of entries near the
    dtype's largest (a trace of 4.5e38 in float32) then gives their answer, not the one of a
    zero ``G`` (session 54: uniform weights, without a word). No host synchronisation.

    Example:
        >>> G = torch.tensor([[3e38, -1e38], [-1e38, 3e38]])
        >>> G.diagonal().sum()  # overflows
        tensor(inf)
        >>> scaled, exponent = scaled_by_a_power_of_two(G)
        >>> scaled.diagonal().sum(), exponent
        (tensor(1.7632), tensor(128, dtype=torch.int32))
    """
    _, exponent = torch.frexp(G.abs().amax())
    return torch.ldexp(G, -exponent), exponent
