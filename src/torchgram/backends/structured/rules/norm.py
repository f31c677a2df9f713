"""Rules for the affine parameters of layer, group, RMS and batch norms.

``y = x̂ ⊙ w + b`` with ``x̂`` the normalised input: the weight is an *elementwise* use
(NOTE [factors]), ``J_w = Σ_t x̂_t ⊙ g_t`` over the positions ``t`` the weight is broadcast
over, and ``J_b = Σ_t g_t``. Both are vectors the size of the parameter, so they are always
materialized (per row, ``T·d`` multiply-adds). ``x̂`` is recomputed from the saved input by
the same function without the affine part: ``F.layer_norm``, ``F.group_norm``,
``F.rms_norm`` and ``F.batch_norm``. For batch-norm, ``x̂`` uses the running statistics in
eval mode and the statistics of the batch it normalised in training mode (the per-sample
passes never see that case: it makes samples interact, NOTE [per-sample]; the rows of the
whole batch then get the same rule, and ``x̂`` does not depend on the parameters).
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
        return self.normalized(x).movedim(1, -1).reshape(*lead, -1, 1, self.channels)

    def cot_factor(self, raw: Tensor, nlead: int, act_raw: Tensor | None) -> Tensor:
        """The output's cotangent, channels last."""
        del act_raw
        lead = raw.shape[:nlead]
        g = raw.reshape(-1, *raw.shape[nlead + 1:])
        return g.movedim(1, -1).reshape(*lead, -1, 1, self.channels)

    def normalized(self, x: Tensor) -> Tensor:
        """``x̂`` of ``x: [N, C, *]``."""
        return F.group_norm(x, self.norm_groups, None, None, self.eps)

    def materialize(self, act_raw: Tensor | None, cot_raw: Tensor, bias: bool) -> Tensor | None:
        """``Σ x̂ ⊙ g`` (``Σ g``) over the (inner batch, spatial) positions, channels in place.

        The same sums as the factors', without moving the channels last (two copies).
        """
        lead = cot_raw.shape[:2]
        g = cot_raw.reshape(*lead, -1, self.channels, math.prod(cot_raw.shape[4:]))
        if not bias:
            assert act_raw is not None
            x = act_raw.reshape(-1, *act_raw.shape[2:])  # [B·n, C, *]
            g = g * self.normalized(x).reshape(1, *g.shape[1:])
        return g.sum((2, 4))


class RMSNormLayout(LayerNormLayout):
    """As :class:`LayerNormLayout`, with ``x̂ = x / rms(x)`` (``F.rms_norm``)."""

    def __init__(self, normalized_shape: tuple[int, ...], eps: float | None) -> None:
        super().__init__(normalized_shape, 0.0)
        self.rule = "rms_norm"
        self.rms_eps = eps

    def act_factor(self, raw: Tensor, nlead: int) -> Tensor:
        """The normalised input."""
        normed = F.rms_norm(raw, self.normalized_shape, None, self.rms_eps)
        return flat_positions(normed, nlead, 1, self.act_width)


class BatchNormLayout(GroupNormLayout):
    """``x̂`` and the cotangent, both ``[T, 1, C]`` (``F.batch_norm``, channels at dim 1).

    Example:
        >>> import torch
        >>> layout = BatchNormLayout(3, torch.zeros(3), torch.ones(3), False, 0.0)
        >>> x = torch.randn(2, 4, 3, 5)
        >>> layout.act_factor(x, nlead=1).shape, torch.allclose(
        ...     layout.act_factor(x, 1), x.movedim(2, -1).reshape(2, -1, 1, 3))
        (torch.Size([2, 20, 1, 3]), True)
    """

    def __init__(self, channels: int, running_mean: Tensor | None, running_var: Tensor | None,
                 batch_stats: bool, eps: float) -> None:
        super().__init__(channels, 1, eps)
        self.rule = "batch_norm"
        self.running_mean, self.running_var = running_mean, running_var
        self.batch_stats = batch_stats

    def normalized(self, x: Tensor) -> Tensor:
        """``x̂`` of ``x: [N, C, *]`` (running or batch statistics, as the call used)."""
        if self.batch_stats:
            return F.batch_norm(x, None, None, None, None, True, 0.0, self.eps)
        # x may be in the contraction's dtype (wider than the call's: mixed-dtype leaves)
        mean, var = (None if t is None else t.to(x.dtype)
                     for t in (self.running_mean, self.running_var))
        return F.batch_norm(x, mean, var, None, None, False, 0.0, self.eps)


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


class RMSNormRule(Rule):
    """``F.rms_norm(x, normalized_shape, weight, eps)`` (``nn.RMSNorm``)."""

    name = "rms_norm"
    funcs = frozenset({F.rms_norm})
    _NAMES = ("input", "normalized_shape", "weight", "eps")
    _DEFAULTS = (None, None, None, None)

    def match(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Match | None:
        """Recognise an RMS norm whose weight has the normalised shape."""
        x, shape, weight, eps = _args(self._NAMES, self._DEFAULTS, args, kwargs)
        if not isinstance(x, Tensor) or not x.is_floating_point():
            return None
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return _affine_match(self.name, x, weight, None, shape, RMSNormLayout(shape, eps),
                             lambda w, b: F.rms_norm(x, shape, w, eps))


class BatchNormRule(Rule):
    """``F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)``."""

    name = "batch_norm"
    funcs = frozenset({F.batch_norm})
    _NAMES = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum",
              "eps")
    _DEFAULTS = (None, None, None, None, None, False, 0.1, 1e-5)

    def match(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Match | None:
        """Recognise a batch norm with a per-channel weight and bias (``x: [N, C, *]``)."""
        x, mean, var, weight, bias, training, momentum, eps = _args(self._NAMES, self._DEFAULTS,
                                                                    args, kwargs)
        if not isinstance(x, Tensor) or x.dim() < 2 or not x.is_floating_point():
            return None
        batch_stats = bool(training) or mean is None or var is None
        layout = BatchNormLayout(x.shape[1], mean, var, batch_stats, float(eps))
        return _affine_match(self.name, x, weight, bias, (x.shape[1],), layout,
                             lambda w, b: F.batch_norm(x, mean, var, w, b, training, momentum,
                                                       eps))


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
