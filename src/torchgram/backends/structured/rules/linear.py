"""Rules for ``F.linear`` / ``nn.Linear`` and for matmuls against a 1-D or 2-D operand.

* ``F.linear(x, W, b)``, ``W: [d_out, d_in]``: positions are all dims of ``x`` but the last;
  ``J_W = Σ_t g_t ⊗ x_t`` (cotangent first), ``J_b = Σ_t g_t``.
* ``a @ W`` (``torch.matmul``, ``mm``, ``Tensor.matmul``, ``@``), ``W: [q, p]``: as a linear
  layer with ``Wᵀ``, so ``J_W = Σ_t a_t ⊗ g_t`` (activation first); a 1-D ``W: [q]`` is the
  case ``p = 1``.
* ``W @ b``, ``W: [p, q]``: the positions are the columns of ``b`` (``b[..., :, n]``),
  ``J_W = Σ_n g[..., :, n] ⊗ b[..., :, n]``; a 1-D ``W`` is a row vector.

A transposed view of a leaf (``W.T``, ``W.t()``, ``W.mT``, ``W.transpose(0, 1)``) is the same
use with the factors swapped; the tap machinery resolves it (see ``taps``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from torchgram.backends.structured.rules.base import Layout, Match, Operand, Rule, flat_positions


class LinearLayout(Layout):
    """``y = x Wᵀ``: cotangent ``[T, 1, d_out]`` first, activation ``[T, 1, d_in]`` second.

    Example:
        >>> import torch
        >>> layout = LinearLayout(d_in=3, d_out=2)
        >>> layout.act_factor(torch.zeros(5, 4, 3), nlead=1).shape
        torch.Size([5, 4, 1, 3])
        >>> layout.shape(out_numel=4 * 2).positions
        4
    """

    def __init__(self, d_in: int, d_out: int, *, rule: str = "linear") -> None:
        self.rule = rule
        self.act_first = False
        self.act_width = d_in
        self.cot_width = d_out

    def act_factor(self, raw: Tensor, nlead: int) -> Tensor:
        """Every dim but the last is a position."""
        return flat_positions(raw, nlead, 1, self.act_width)

    def cot_factor(self, raw: Tensor, nlead: int, act_raw: Tensor | None) -> Tensor:
        """Every dim but the last is a position (a scalar output is one position)."""
        del act_raw
        return flat_positions(raw, nlead, 1, self.cot_width)


class MatmulRightLayout(LinearLayout):
    """``y = a @ W`` with ``W: [q, p]`` (or ``[q]``): the activation comes first."""

    def __init__(self, q: int, p: int) -> None:
        super().__init__(d_in=q, d_out=p, rule="matmul")
        self.act_first = True


class MatmulLeftLayout(Layout):
    """``y = W @ b`` with ``W: [p, q]`` (or a row vector ``[q]``): positions are b's columns.

    Example:
        >>> import torch
        >>> layout = MatmulLeftLayout(p=2, q=3, act_is_vector=False)
        >>> layout.act_factor(torch.zeros(5, 3, 7), nlead=1).shape
        torch.Size([5, 7, 1, 3])
    """

    def __init__(self, p: int | None, q: int, act_is_vector: bool) -> None:
        self.rule = "matmul"
        self.act_first = p is None  # a 1-D leaf [q] is laid out as [q, 1]
        self.act_width = q
        self.cot_width = 1 if p is None else p
        self.act_is_vector = act_is_vector
        self.out_is_scalar_per_column = p is None

    def act_factor(self, raw: Tensor, nlead: int) -> Tensor:
        """Columns of ``b`` as positions (one position for a vector ``b``)."""
        if not self.act_is_vector:
            raw = raw.transpose(-1, -2)
        return flat_positions(raw, nlead, 1, self.act_width)

    def cot_factor(self, raw: Tensor, nlead: int, act_raw: Tensor | None) -> Tensor:
        """Columns of ``y`` as positions, matching :meth:`act_factor`."""
        del act_raw
        if not self.act_is_vector and not self.out_is_scalar_per_column:
            raw = raw.transpose(-1, -2)
        return flat_positions(raw, nlead, 1, self.cot_width)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str,
         default: Any = None) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


class LinearRule(Rule):
    """``F.linear(x, W, b)`` with a 2-D ``W`` (``nn.Linear``)."""

    name = "linear"
    funcs = frozenset({F.linear})

    def match(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Match | None:
        """Recognise ``F.linear`` with a 2-D weight and an optional 1-D bias."""
        x, weight = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight")
        bias = _arg(args, kwargs, 2, "bias")
        if not (isinstance(x, Tensor) and isinstance(weight, Tensor)) or weight.dim() != 2:
            return None
        if x.dim() < 1 or (bias is not None and (not isinstance(bias, Tensor) or bias.dim() != 1)):
            return None
        layout = LinearLayout(d_in=weight.shape[1], d_out=weight.shape[0])
        operands = [Operand(weight, layout, act=x)]
        if bias is not None:
            operands.append(Operand(bias, None, bias_of=layout))

        def compute(w: Tensor, b: Tensor | None = None) -> Tensor:
            return F.linear(x, w, b)

        return Match(self.name, tuple(operands), compute)


_MATMULS = frozenset({torch.matmul, torch.Tensor.matmul, torch.mm, torch.Tensor.mm,
                      torch.Tensor.__matmul__})


class MatmulRule(Rule):
    """``torch.matmul`` / ``@`` / ``mm`` where a 1-D or 2-D operand may be a parameter."""

    name = "matmul"
    funcs = _MATMULS | {torch.Tensor.__rmatmul__}

    def match(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Match | None:
        """Recognise a two-operand matmul (no ``out=``); both operands are candidates."""
        if kwargs or len(args) != 2:
            return None
        a, b = (args[1], args[0]) if func is torch.Tensor.__rmatmul__ else args
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.dim() < 1 or b.dim() < 1:
            return None
        left = None
        if a.dim() <= 2:
            left = MatmulLeftLayout(p=a.shape[0] if a.dim() == 2 else None, q=a.shape[-1],
                                    act_is_vector=b.dim() == 1)
        right = MatmulRightLayout(q=b.shape[0], p=b.shape[1] if b.dim() == 2 else 1) \
            if b.dim() <= 2 else None
        operands = (Operand(a, left, act=b), Operand(b, right, act=a))

        def compute(a_value: Tensor, b_value: Tensor) -> Tensor:
            return torch.matmul(a_value, b_value)

        return Match(self.name, operands, compute)


class AddmmRule(Rule):
    """``torch.addmm(input, mat1, mat2)`` = ``beta·input + mat1 @ mat2`` (GPT-2's ``Conv1D``).

    ``mat2`` a parameter is a matmul weight on the right (activation first), ``mat1`` one on
    the left; ``input`` is a bias broadcast to the ``[n, p]`` output (``beta`` scales it).
    ``alpha`` must be 1.
    """

    name = "addmm"
    funcs = frozenset({torch.addmm, torch.Tensor.addmm})

    def match(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Match | None:
        """Recognise ``addmm`` of 2-D operands with ``alpha=1`` (no ``out=``)."""
        if set(kwargs) - {"beta", "alpha", "input", "mat1", "mat2"} or len(args) > 3:
            return None
        bias, a, b = (_arg(args, kwargs, i, name) for i, name in enumerate(("input", "mat1",
                                                                              "mat2")))
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        if alpha != 1 or not isinstance(beta, int | float) or isinstance(beta, bool):
            return None
        if not all(isinstance(t, Tensor) for t in (bias, a, b)) or a.dim() != 2 or b.dim() != 2:
            return None
        from torchgram.backends.structured.rules.elementwise import (
            BroadcastLayout,
            broadcast_shape,
        )

        out = (a.shape[0], b.shape[1])
        if broadcast_shape(tuple(bias.shape), out) is None:
            return None
        operands = (Operand(bias, None, bias_of=BroadcastLayout(out, tuple(bias.shape),
                                                                act_ndim=None,
                                                                scale=float(beta))),
                    Operand(a, MatmulLeftLayout(p=a.shape[0], q=a.shape[1], act_is_vector=False),
                            act=b),
                    Operand(b, MatmulRightLayout(q=b.shape[0], p=b.shape[1]), act=a))

        def compute(bias_value: Tensor, a_value: Tensor, b_value: Tensor) -> Tensor:
            return torch.addmm(bias_value, a_value, b_value, beta=beta, alpha=alpha)

        return Match(self.name, operands, compute)
