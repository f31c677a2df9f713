"""``torch.einsum`` of two operands, one of them a weight, rewritten into a matmul or a ``bmm``.

# NOTE [einsum rewrite]
A ``TorchFunctionMode`` sees ``torch.einsum`` as one call, which no rule reads. When the
equation is a contraction of an activation ``x`` with a weight ``W`` over **one** index,
``W`` having at most one other index, the call is rewritten (under the tapping mode, so every
use of a leaf is still seen) into ops the linear rules know::

    "btd,dk->btk"  (W = [c, k]):  x' @ W             x' = x with c moved last
    "btd,kd->bkt"  (W = [k, c]):  F.linear(x', W)    then the output permuted
    "btd,d->bt"    (W = [c]):     x' @ W
    "bhd,hdk->bhk" (W = [g, c, k]): torch.bmm(x'', W)  x'' = x as [g, n, c]

where ``x'`` is ``x`` with the contracted index moved last (a view; no copy when it is last
already), ``x''`` has the group index first, the contracted one last and the others merged
into ``n`` (the ``bmm`` rule's grouped weight), and the result is permuted into the
equation's output order. The weight may be either operand (the second is tried first).
Anything else (an ellipsis, an index repeated in an operand, several indices shared by both
operands and the output, or one that is not a 3-D weight's first, one summed over in one
operand only, more than two operands, a weight with two kept or two contracted indices)
keeps the original call, and its parameters the fallback. Results are exact either way; the
oracle tests compare both.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def _operands(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Tensor, Tensor] | None:
    if kwargs or not args or not isinstance(args[0], str):
        return None
    rest = args[1:]
    if len(rest) == 1 and isinstance(rest[0], list | tuple):
        rest = tuple(rest[0])
    if len(rest) != 2 or not all(isinstance(t, Tensor) for t in rest):
        return None
    return args[0], rest[0], rest[1]


def _letters(equation: str) -> tuple[str, str, str] | None:
    """``(a, b, out)`` index letters of a two-operand equation, or ``None`` if unsupported."""
    equation = equation.replace(" ", "")
    if "." in equation or equation.count("->") != 1:
        return None
    inputs, out = equation.split("->")
    if inputs.count(",") != 1:
        return None
    a, b = inputs.split(",")
    if not all(s.isalpha() and len(set(s)) == len(s) for s in (a, b)) or \
            not (out.isalpha() or out == "") or len(set(out)) != len(out):
        return None
    shared = set(a) & set(b) & set(out)  # a batch index: one at most (a weight per group)
    for letter in set(a) | set(b):
        if letter not in shared and (letter in a and letter in b) == (letter in out):
            return None  # summed in one operand only
    if len(shared) > 1 or not set(out) <= set(a) | set(b):
        return None
    return a, b, out


def _plan(x: str, w: str, w_value: Tensor, out: str) -> tuple[str, str | None, bool] | None:
    """``(contracted, kept, contracted_first)`` when ``w`` is a 1-D or 2-D weight of ``x``."""
    if w_value.dim() != len(w) or len(w) not in (1, 2) or set(w) & set(x) & set(out):
        return None
    contracted = [letter for letter in w if letter in x]
    kept = [letter for letter in w if letter not in x]
    if len(contracted) != 1 or len(kept) > 1:
        return None
    return contracted[0], (kept[0] if kept else None), w[0] == contracted[0]


def rewrite_einsum(args: tuple[Any, ...], kwargs: dict[str, Any],
                   mode: AbstractContextManager[Any] | None = None) -> Any:
    """``torch.einsum(equation, x, W)`` as a matmul (NOTE [einsum rewrite]), or ``NotImplemented``.

    The whole rewrite runs in ``mode`` (the tapping mode, when given).

    Example:
        >>> import torch
        >>> x, w = torch.randn(2, 3, 4), torch.randn(5, 4)
        >>> y = rewrite_einsum(("btd,kd->bkt", x, w), {})
        >>> torch.allclose(y, torch.einsum("btd,kd->bkt", x, w), atol=1e-6)
        True
        >>> rewrite_einsum(("bij,bkj->bik", x, torch.randn(2, 5, 4)), {})
        NotImplemented
    """
    found = _operands(args, kwargs)
    if found is None:
        return NotImplemented
    equation, a_value, b_value = found
    letters = _letters(equation)
    if letters is None:
        return NotImplemented
    a, b, out = letters
    for x, x_value, w, w_value in ((a, a_value, b, b_value), (b, b_value, a, a_value)):
        if x_value.dim() != len(x):
            continue
        plan = _plan(x, w, w_value, out)
        if plan is not None:
            with mode or contextlib.nullcontext():
                return _rewritten(x, x_value, w_value, plan, out)
        if _grouped(x, w, w_value, out):
            with mode or contextlib.nullcontext():
                return _rewritten_grouped(x, x_value, w, w_value, out)
    return NotImplemented


def _grouped(x: str, w: str, w_value: Tensor, out: str) -> bool:
    """Whether ``w`` is ``[G, c, k]``: a batch index, one contracted with ``x``, one kept."""
    return (w_value.dim() == len(w) == 3 and w[0] in x and w[0] in out
            and w[1] in x and w[1] not in out and w[2] not in x and w[2] in out)


def _rewritten_grouped(x: str, x_value: Tensor, w: str, w_value: Tensor, out: str) -> Tensor:
    """``x`` as ``[G, n, c]`` (its other indices merged into ``n``) ``bmm`` ``W``."""
    group, contracted, kept = w[0], w[1], w[2]
    rest = [letter for letter in x if letter not in (group, contracted)]
    order = [x.index(group), *(x.index(letter) for letter in rest), x.index(contracted)]
    moved = x_value.permute(*order)
    sizes = moved.shape[1:-1]
    y = torch.bmm(moved.reshape(moved.shape[0], -1, moved.shape[-1]), w_value)
    y = y.reshape(y.shape[0], *sizes, y.shape[-1])
    letters = group + "".join(rest) + kept
    return y.permute(*[letters.index(letter) for letter in out])


def _rewritten(x: str, x_value: Tensor, w_value: Tensor, plan: tuple[str, str | None, bool],
               out: str) -> Tensor:
    contracted, kept, contracted_first = plan
    position = x.index(contracted)
    if position != len(x) - 1:
        x_value = x_value.movedim(position, -1)
    rest = x.replace(contracted, "")
    if kept is None or contracted_first:
        y = torch.matmul(x_value, w_value)
    else:
        y = F.linear(x_value, w_value)
    order = rest + (kept or "")
    if order != out:
        y = y.permute(*[order.index(letter) for letter in out])
    return y
