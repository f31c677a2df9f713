"""Structured rules: ops whose parameter Jacobians are sums of outer products (DESIGN.md §1).

One module per family: :mod:`~torchgram.rules.linear` (``F.linear``, matmuls),
:mod:`~torchgram.rules.conv` (``conv{1,2,3}d``), :mod:`~torchgram.rules.embedding`;
:mod:`~torchgram.rules.taps` runs a function under a ``TorchFunctionMode`` that finds the
calls these rules recognise and taps their outputs.
"""

from __future__ import annotations

from typing import Any

from torchgram.rules.base import Layout, Match, Operand, Rule, UseShape
from torchgram.rules.conv import ConvRule
from torchgram.rules.embedding import EmbeddingRule
from torchgram.rules.linear import LinearRule, MatmulRule

RULES: tuple[Rule, ...] = (LinearRule(), MatmulRule(), ConvRule(), EmbeddingRule())
_BY_FUNC: dict[Any, Rule] = {func: rule for rule in RULES for func in rule.funcs}


def rule_for(func: Any) -> Rule | None:
    """The rule that handles the torch function ``func``, if any.

    Example:
        >>> import torch
        >>> rule_for(torch.nn.functional.linear).name
        'linear'
        >>> rule_for(torch.tanh) is None
        True
    """
    try:
        return _BY_FUNC.get(func)
    except TypeError:  # unhashable callables
        return None


__all__ = ["RULES", "Layout", "Match", "Operand", "Rule", "UseShape", "rule_for"]
