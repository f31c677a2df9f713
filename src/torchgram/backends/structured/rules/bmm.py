"""Rules for ``torch.bmm`` / ``torch.baddbmm`` with a weight on the right: grouped linear maps.

``y = x @ W`` with ``x: [G, n, q]`` and a parameter ``W: [G, q, p]`` applies one weight per
group ``g`` (a head, an expert, a channel group) to that group's ``n`` positions, so

    J_W[g] = Σ_t x[g, t] ⊗ ∂out/∂y[g, t]                 (activation first, G groups)

the factor structure of a grouped convolution (NOTE [factors]), with positions ``n`` and
``G`` groups. ``torch.baddbmm(input, x, W, beta=β)`` adds ``β·input`` broadcast to
``[G, n, p]``: a parameter there is a bias (``alpha`` must be 1). The samples may sit in
``n``, split or merged (``[G, B·T, q]``), like any tapped activation. A weight on the left
(``W @ x``) is not recognised: its leaf takes the fallback, exact as ever.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchgram.backends.structured.rules.base import Layout, Match, Operand, Rule


class BmmLayout(Layout):
    """``y[g] = x[g] @ W[g]``: activation ``[T, G, q]`` first, cotangent ``[T, G, p]`` second.

    Example:
        >>> import torch
        >>> layout = BmmLayout(groups=3, q=4, p=5)
        >>> layout.act_factor(torch.zeros(2, 3, 7, 4), nlead=1).shape
        torch.Size([2, 7, 3, 4])
        >>> layout.shape(out_numel=3 * 7 * 5).positions
        7
    """

    def __init__(self, groups: int, q: int, p: int, *, rule: str = "bmm") -> None:
        self.rule = rule
        self.act_first = True
        self.groups = groups
        self.act_width = q
        self.cot_width = p

    def act_factor(self, raw: Tensor, nlead: int) -> Tensor:
        """``[*lead, G, n, q]`` → ``[*lead, n, G, q]``."""
        del nlead
        return raw.movedim(-3, -2)

    def cot_factor(self, raw: Tensor, nlead: int, act_raw: Tensor | None) -> Tensor:
        """``[*lead, G, n, p]`` → ``[*lead, n, G, p]``."""
        del nlead, act_raw
        return raw.movedim(-3, -2)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


class BmmRule(Rule):
    """``torch.bmm(x, W)`` and ``torch.baddbmm(input, x, W, beta=β)`` (``alpha=1``)."""

    name = "bmm"
    funcs = frozenset({torch.bmm, torch.Tensor.bmm, torch.baddbmm, torch.Tensor.baddbmm})

    def match(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Match | None:
        """Recognise a 3-D ``x @ W`` (with ``baddbmm``'s broadcast ``input``); no ``out=``."""
        added = func in (torch.baddbmm, torch.Tensor.baddbmm)
        names = ("input", "batch1", "batch2") if added else ("input", "mat2")
        if set(kwargs) - {*names, "beta", "alpha"} or len(args) > len(names):
            return None
        values = [_arg(args, kwargs, i, name) for i, name in enumerate(names)]
        if not all(isinstance(v, Tensor) for v in values):
            return None
        x, w = values[-2], values[-1]
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        if alpha != 1 or not isinstance(beta, int | float) or isinstance(beta, bool):
            return None
        if x.dim() != 3 or w.dim() != 3 or x.shape[0] != w.shape[0] or x.shape[2] != w.shape[1]:
            return None
        groups, n, q = x.shape
        p = w.shape[2]
        operands = [Operand(w, BmmLayout(groups, q, p, rule="baddbmm" if added else "bmm"),
                            act=x), Operand(x, None)]
        if added:
            from torchgram.backends.structured.rules.elementwise import (
                BroadcastLayout,
                broadcast_shape,
            )

            bias = values[0]
            if broadcast_shape(tuple(bias.shape), (groups, n, p)) is None:
                return None
            operands.insert(0, Operand(bias, None, bias_of=BroadcastLayout(
                (groups, n, p), tuple(bias.shape), act_ndim=None, scale=float(beta))))

        def compute(*operand_values: Tensor) -> Tensor:
            if added:
                bias_value, w_value, x_value = operand_values
                return torch.baddbmm(bias_value, x_value, w_value, beta=beta, alpha=alpha)
            w_value, x_value = operand_values
            return torch.bmm(x_value, w_value)

        return Match(self.name, tuple(operands), compute)
