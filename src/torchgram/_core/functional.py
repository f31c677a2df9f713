"""Typed shorthands for the ``torch.func`` calls used across backends.

``torch.func.vjp`` returns a pair or a triple depending on ``has_aux``, which a type checker
cannot tell apart; these wrappers say which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor

VjpFn = Callable[..., tuple[Tensor, ...]]
"""A vector-Jacobian product: cotangent(s) → one gradient per primal."""


def vjp(fn: Callable[..., Tensor], *primals: Tensor) -> tuple[Tensor, VjpFn]:
    """``torch.func.vjp(fn, *primals)``: the output and its vjp."""
    return cast(tuple[Tensor, VjpFn], torch.func.vjp(fn, *primals))


def vjp_with_aux(fn: Callable[..., tuple[Tensor, Any]],
                 *primals: Tensor) -> tuple[Tensor, VjpFn, Any]:
    """``torch.func.vjp(fn, *primals, has_aux=True)``: the output, its vjp and the aux."""
    return cast(tuple[Tensor, VjpFn, Any], torch.func.vjp(fn, *primals, has_aux=True))
