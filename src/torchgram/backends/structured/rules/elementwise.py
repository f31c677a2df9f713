"""Rules for parameters used elementwise, with broadcasting: ``x * p``, ``x ± p``, ``p.expand``.

* ``y = x ⊙ p`` (``torch.mul``, ``*``): ``p`` broadcast against ``x`` is an *elementwise*
  use (NOTE [factors]): ``J_p = Σ_t x_t ⊙ g_t`` over the positions ``t`` along which ``p``
  is broadcast (RMSNorm, LayerScale and batch-norm-like scales, learned gates).
* ``y = x ± α p`` (``torch.add`` / ``sub`` / ``rsub``, ``+``, ``-``) and ``y = p.expand(...)``
  (``expand``, ``expand_as``, ``broadcast_to``): a *bias* use, ``J_p = ±α Σ_t g_t`` (biases
  added anywhere, position embeddings added to the tokens, a cls token or learned queries
  expanded over the batch before ``torch.cat``).

A parameter reshaped first (``p.view(1, 1, -1)``, ``p[None, :, None]``, ``p.unsqueeze(0)``)
is the same use: such views keep the order of the entries (NOTE [taps]). Both operands may
be parameters (``p * q``: each is the other's activation). In-place variants (``x.add_(p)``,
``x += p``) are left to the fallback: a tap would have to return a new tensor.

Layout: the dims of ``y`` along which ``p`` has its own (non-broadcast) sizes are the
*width* dims, in order (the entries of ``p`` in row-major order); every other dim is a
position. For ``x ⊙ p`` the product ``x ⊙ g`` is formed when the cotangent factor is made,
where both are at hand and broadcast against each other, so the activation factor is 1.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from torchgram.backends.structured.rules.base import Layout, Match, Operand, Rule


class BroadcastLayout(Layout):
    """A parameter of shape ``param_shape`` broadcast to ``out_shape`` (module docstring).

    Args:
        out_shape: The op's output shape.
        param_shape: The parameter operand's shape (right-aligned to ``out_shape``).
        act_ndim: For ``x ⊙ p``, the number of dims of ``x`` (``None`` for a bias use).
        scale: The factor the parameter is multiplied by (``-1`` for ``x - p``, ``alpha``).

    Example:
        >>> import torch
        >>> layout = BroadcastLayout((2, 5, 3), (3,), act_ndim=3)
        >>> layout.width_dims, layout.shape(2 * 5 * 3).positions
        ((2,), 10)
        >>> g, x = torch.randn(1, 4, 2, 5, 3), torch.randn(4, 2, 5, 3)
        >>> layout.cot_factor(g, 2, x).shape
        torch.Size([1, 4, 10, 1, 3])
    """

    premultiplied = True
    """The activation is multiplied into the cotangent factor (the act factor is 1)."""

    def __init__(self, out_shape: tuple[int, ...], param_shape: tuple[int, ...], *,
                 act_ndim: int | None, scale: float = 1.0) -> None:
        n, k = len(out_shape), len(param_shape)
        self.rule = "mul" if act_ndim is not None else "add"
        self.elementwise = act_ndim is not None
        self.act_first = True
        self.out_ndim = n
        self.act_ndim = act_ndim
        self.scale = scale
        self.width_dims = tuple(i for i in range(max(0, n - k), n)
                                if param_shape[i - (n - k)] != 1)
        self.act_width = self.cot_width = math.prod(param_shape)
        positions = [i for i in range(n) if i not in self.width_dims]
        self._order = (*positions, *self.width_dims)

    def _flat(self, raw: Tensor, nlead: int) -> Tensor:
        order = (*range(nlead), *(nlead + i for i in self._order))
        return raw.permute(order).reshape(*raw.shape[:nlead], -1, 1, self.cot_width)

    def act_factor(self, raw: Tensor, nlead: int) -> Tensor:
        """Ones ``[*lead, 1, 1, width]``: the activation is in the cotangent factor."""
        return raw.new_ones(*raw.shape[:nlead], 1, 1, self.act_width)

    def _product(self, raw: Tensor, nlead: int, act_raw: Tensor | None) -> Tensor:
        """``scale · g`` (bias) or ``scale · x ⊙ g`` (elementwise), broadcast to ``y``."""
        if self.act_ndim is not None:
            assert act_raw is not None
            act_lead = act_raw.dim() - self.act_ndim
            act = act_raw.reshape(*act_raw.shape[:act_lead], *(1,) * (self.out_ndim
                                                                        - self.act_ndim),
                                  *act_raw.shape[act_lead:])
            act = act.reshape(*(1,) * (nlead - act_lead), *act.shape)
            raw = torch.broadcast_to(raw, torch.broadcast_shapes(raw.shape, act.shape)) * act
        return raw * self.scale if self.scale != 1.0 else raw

    def cot_factor(self, raw: Tensor, nlead: int, act_raw: Tensor | None) -> Tensor:
        """``scale · g`` (bias) or ``scale · x ⊙ g`` (elementwise), ``[*lead, T, 1, width]``."""
        return self._flat(self._product(raw, nlead, act_raw), nlead)

    def materialize(self, act_raw: Tensor | None, cot_raw: Tensor, bias: bool) -> Tensor | None:
        """The sums over the positions straight from ``y``'s layout (no permuted copy)."""
        del bias  # the layout knows whether it multiplies
        product = self._product(cot_raw, 2, act_raw)
        positions = [2 + i for i in range(self.out_ndim) if i not in self.width_dims]
        summed = product.sum(positions) if positions else product
        return summed.reshape(*cot_raw.shape[:2], self.cot_width)


_MUL = frozenset({torch.mul, torch.multiply, torch.Tensor.mul, torch.Tensor.multiply,
                  torch.Tensor.__mul__, torch.Tensor.__rmul__})
_ADD = frozenset({torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__})
_SUB = frozenset({torch.sub, torch.subtract, torch.Tensor.sub, torch.Tensor.subtract,
                  torch.Tensor.__sub__})
_RSUB = frozenset({torch.rsub, torch.Tensor.__rsub__})
_EXPAND = frozenset({torch.Tensor.expand, torch.Tensor.expand_as, torch.broadcast_to,
                     torch.Tensor.broadcast_to})


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, Tensor) and value.is_floating_point() else None


def _broadcast_pair(a: Any, b: Any
                    ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """The shapes of two floating tensors of one dtype and their broadcast shape, or ``None``."""
    shape_a, shape_b = _shape(a), _shape(b)
    if shape_a is None or shape_b is None or a.dtype != b.dtype:
        return None
    out = broadcast_shape(shape_a, shape_b)
    return None if out is None else (shape_a, shape_b, out)


def broadcast_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    """``torch.broadcast_shapes(a, b)`` for two shapes, or ``None`` where they do not broadcast.

    Plain Python: ``torch.broadcast_shapes`` goes through ``torch._refs`` (tens of µs a call),
    and the rules match every product and sum a recorded forward makes with a parameter.

    Example:
        >>> broadcast_shape((2, 1, 3), (4, 1)), broadcast_shape((2, 3), (4,))
        ((2, 4, 3), None)
    """
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for x, y in zip(a, b, strict=True):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None
    return tuple(out)


class MulRule(Rule):
    """``x * p`` (either operand may be the parameter; both tensors)."""

    name = "mul"
    funcs = _MUL

    def match(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Match | None:
        """Recognise a product of two floating tensors (no ``out=``)."""
        if kwargs or len(args) != 2:
            return None
        a, b = args
        shapes = _broadcast_pair(a, b)
        if shapes is None:
            return None
        shape_a, shape_b, out = shapes
        operands = (Operand(a, BroadcastLayout(out, shape_a, act_ndim=len(shape_b)), act=b),
                    Operand(b, BroadcastLayout(out, shape_b, act_ndim=len(shape_a)), act=a))

        def compute(a_value: Tensor, b_value: Tensor) -> Tensor:
            return func(a_value, b_value)

        return Match(self.name, operands, compute)


class AddRule(Rule):
    """``x + α p``, ``x - α p``, ``p - x`` (either operand may be the parameter)."""

    name = "add"
    funcs = _ADD | _SUB | _RSUB

    def match(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Match | None:
        """Recognise a sum or difference of two floating tensors, with a number ``alpha``."""
        if len(args) != 2 or set(kwargs) - {"alpha"}:
            return None
        alpha = kwargs.get("alpha", 1)
        if not isinstance(alpha, int | float) or isinstance(alpha, bool):
            return None
        a, b = args
        shapes = _broadcast_pair(a, b)
        if shapes is None:
            return None
        shape_a, shape_b, out = shapes
        if func in _ADD:
            scales = (1.0, float(alpha))
        elif func in _SUB:
            scales = (1.0, -float(alpha))
        else:  # rsub(a, b) = b - alpha * a
            scales = (-float(alpha), 1.0)
        operands = tuple(Operand(value, None, bias_of=BroadcastLayout(out, shape, act_ndim=None,
                                                                      scale=scale))
                         for value, shape, scale in ((a, shape_a, scales[0]),
                                                     (b, shape_b, scales[1])))

        def compute(a_value: Tensor, b_value: Tensor) -> Tensor:
            return func(a_value, b_value, **kwargs)

        return Match(self.name, operands, compute)


class ExpandRule(Rule):
    """``p.expand(...)``, ``p.expand_as(x)``, ``torch.broadcast_to(p, shape)``."""

    name = "expand"
    funcs = _EXPAND

    def match(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Match | None:
        """Recognise a broadcast of a floating tensor to a bigger shape."""
        if not args or _shape(args[0]) is None:
            return None
        p, rest = args[0], args[1:]
        try:
            out = tuple(func(p, *rest, **kwargs).shape)  # a view: no copy, no gradient kept
        except (RuntimeError, TypeError):
            return None
        layout = BroadcastLayout(out, tuple(p.shape), act_ndim=None)

        def compute(p_value: Tensor) -> Tensor:
            return func(p_value, *rest, **kwargs)

        return Match(self.name, (Operand(p, None, bias_of=layout),), compute)
