"""Calling a user's weighting ``G -> w``, checked the same way by every step API."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from torchgram._core import checks


def check_weighting(api: str, weighting: Any) -> None:
    """Reject a weighting that is not callable (e.g. its result passed by mistake)."""
    if not callable(weighting):
        checks.fail(api, "a weighting callable G -> w (e.g. torchgram.weighting.upgrad)",
                    type(weighting).__name__, "Pass the function itself, not its result.",
                    TypeError)


def call_weighting(api: str, weighting: Callable[[Tensor], Tensor], matrix: Tensor) -> Tensor:
    """``weighting(matrix)``, checked to be ``[m]`` weights, in the Gramian's dtype."""
    weights = weighting(matrix)
    num_rows = matrix.shape[0]
    if not isinstance(weights, Tensor) or weights.shape != (num_rows,):
        got = (f"shape {tuple(weights.shape)}" if isinstance(weights, Tensor)
               else type(weights).__name__)
        checks.fail(api, f"the weighting to return a tensor of shape ({num_rows},), one "
                    "weight per output entry", got,
                    "A weighting maps the [m, m] Gramian to [m] weights.", TypeError)
    return weights.to(matrix.dtype)
