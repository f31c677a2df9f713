"""Rules for the affine parameters of ``F.layer_norm`` and ``F.group_norm``.

``y = x̂ ⊙ w + b`` with ``x̂`` the normalised input: the weight is an *elementwise* use
(NOTE [factors]), ``J_w = Σ_t x̂_t ⊙ g_t`` over the positions ``t`` the weight is broadcast
over, and ``J_b = Σ_t g_t``. Both are vectors the size of the parameter, so they are always
materialized (per row, ``T·d`` multiply-adds). ``x̂`` is recomputed from the saved input by
the same function without the affine part.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import Tensor

from torchgram.backends.structured.rules.base import Layout, Match, Operand, Rule, flat_positions


def _args(names: tuple[str, ...], defaults: tuple[Any, ...], args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> list[Any]:
    return [args[i] if i < len(args) else kwargs.get(name, default)
            for i, (name, default) in enumerate(zip(names, defaults, strict=True))]


class LayerNormLayout(Layout):
    """``x̂`` and the cotangent, both ``[T, 1, d]`` over the normalised dims.

    Example:
        >>> import torch
        >>> layout = LayerNormLayout((3, 4), eps=1e-5)
        >>> layout.act_factor(torch.randn(2, 5, 3, 4), nlead=1).shape
        torch.Size([2, 5, 1, 12])
    """

    def __init__(self, normalized_shape: tuple[int, ...], eps: float) -> None:
        self.rule = "layer_norm"
        self.elementwise = True
        self.act_first = True
        self.normalized_shape = normalized_shape
        self.eps = eps
        self.act_width = self.cot_width = math.prod(normalized_shape)

    def act_factor(self, raw: Tensor, nlead: int) -> Tensor:
        """The normalised input."""
        normed = F.layer_norm(raw, self.normalized_shape, None, None, self.eps)
        return flat_positions(normed, nlead, 1, self.act_width)

    def cot_factor(self, raw: Tensor, nlead: int, act_raw: Tensor | None) -> Tensor:
        """The output's cotangent."""
        del act_raw
        return flat_positions(raw, nlead, 1, self.cot_width)


class GroupNormLayout(Layout):
    """``x̂`` and the cotangent, both ``[T, 1, C]``: channels last, (batch, spatial) positions.

    Example:
        >>> import torch
        >>> layout = GroupNormLayout(channels=4, groups=2, eps=1e-5)
        >>> layout.act_factor(torch.randn(2, 3, 4, 5), nlead=1).shape
        torch.Size([2, 15, 1, 4])
    """

    def __init__(self, channels: int, groups: int, eps: float) -> None:
        self.rule = "group_norm"
        self.elementwise = True
        self.act_first = True
        self.channels, self.norm_groups, self.eps = channels, groups, eps
        self.act_width = self.cot_width = channels

    def act_factor(self, raw: Tensor, nlead: int) -> Tensor:
        """The normalised input, channels last."""
        lead = raw.shape[:nlead]
        x = raw.reshape(-1, *raw.shape[nlead + 1:])  # [N, C, *] with the lead dims in N
        normed = F.group_norm(x, self.norm_groups, None, None, self.eps)
        return normed.movedim(1, -1).reshape(*lead, -1, 1, self.channels)

    def cot_factor(self, raw: Tensor, nlead: int, act_raw: Tensor | None) -> Tensor:
        """The output's cotangent, channels last."""
        del act_raw
        lead = raw.shape[:nlead]
        g = raw.reshape(-1, *raw.shape[nlead + 1:])
        return g.movedim(1, -1).reshape(*lead, -1, 1, self.channels)


class LayerNormRule(Rule):
    """``F.layer_norm(x, normalized_shape, weight, bias, eps)``."""

    name = "layer_norm"
    funcs = frozenset({F.layer_norm})
    _NAMES = ("input", "normalized_shape", "weight", "bias", "eps")
    _DEFAULTS = (None, None, None, None, 1e-5)

    def match(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Match | None:
        """Recognise a layer norm whose weight and bias have the normalised shape."""
        x, shape, weight, bias, eps = _args(self._NAMES, self._DEFAULTS, args, kwargs)
        if not isinstance(x, Tensor) or not x.is_floating_point():
            return None
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return _affine_match(self.name, x, weight, bias, shape, LayerNormLayout(shape, float(eps)),
                             lambda w, b: F.layer_norm(x, shape, w, b, eps))


class GroupNormRule(Rule):
    """``F.group_norm(x, num_groups, weight, bias, eps)`` (``x: [N, C, *]``)."""

    name = "group_norm"
    funcs = frozenset({F.group_norm})
    _NAMES = ("input", "num_groups", "weight", "bias", "eps")
    _DEFAULTS = (None, None, None, None, 1e-5)

    def match(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Match | None:
        """Recognise a group norm with a per-channel weight and bias."""
        x, groups, weight, bias, eps = _args(self._NAMES, self._DEFAULTS, args, kwargs)
        if not isinstance(x, Tensor) or x.dim() < 2 or not isinstance(groups, int):
            return None
        channels = x.shape[1]
        layout = GroupNormLayout(channels, groups, float(eps))
        return _affine_match(self.name, x, weight, bias, (channels,), layout,
                             lambda w, b: F.group_norm(x, groups, w, b, eps))


def _affine_match(name: str, x: Tensor, weight: Any, bias: Any, shape: tuple[int, ...],
                  layout: Layout,
                  norm: Callable[[Tensor | None, Tensor | None], Tensor]) -> Match | None:
    """The match of a norm's affine ``weight``/``bias`` (either may be ``None``) of ``shape``.

    ``norm(w, b)`` recomputes the call with the given affine parameters.
    """
    operands = []
    for value, is_weight in ((weight, True), (bias, False)):
        if value is None:
            continue
        if not isinstance(value, Tensor) or tuple(value.shape) != shape:
            return None
        operands.append(Operand(value, layout, act=x) if is_weight
                        else Operand(value, None, bias_of=layout))
    if not operands:
        return None

    def compute(*values: Tensor) -> Tensor:
        supplied = iter(values)
        w = next(supplied) if weight is not None else None
        b = next(supplied) if bias is not None else None
        return norm(w, b)

    return Match(name, tuple(operands), compute)
