"""Structured rules: ops whose parameter Jacobians are sums of outer products (DESIGN.md §1).

One module per family: ``linear`` (``F.linear``, matmuls, ``addmm``), ``bmm`` (``bmm`` and
``baddbmm`` with a weight per group), ``conv`` (``conv{1,2,3}d``),
``embedding``, ``norm`` (layer / group / RMS / batch norm affine parameters), ``elementwise``
(parameters multiplied, added or expanded with broadcasting); ``attention``, ``recurrent``
and ``einsum`` rewrite self-attention, fused RNN / LSTM / GRU calls and two-operand
``torch.einsum`` contractions with a weight into ops these rules see. ``base`` says what a
rule reports (NOTE [factors]); ``torchgram.backends.structured.trace`` runs a function under a
``TorchFunctionMode`` that finds the calls the rules recognise and taps their outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F

from torchgram.backends.structured.rules.attention import (
    rewrite_multi_head_attention,
    takes_torch_steps,
)
from torchgram.backends.structured.rules.base import Layout, Match, Operand, Rule, UseShape
from torchgram.backends.structured.rules.bmm import BmmRule
from torchgram.backends.structured.rules.cells import (
    CELL_KERNELS,
    rewrite_gru_cell,
    rewrite_lstm_cell,
    rewrite_rnn_relu_cell,
    rewrite_rnn_tanh_cell,
)
from torchgram.backends.structured.rules.conv import ConvRule
from torchgram.backends.structured.rules.einsum import rewrite_einsum
from torchgram.backends.structured.rules.elementwise import AddRule, ExpandRule, MulRule
from torchgram.backends.structured.rules.embedding import EmbeddingRule
from torchgram.backends.structured.rules.linear import AddmmRule, LinearRule, MatmulRule
from torchgram.backends.structured.rules.norm import (
    BatchNormRule,
    GroupNormRule,
    LayerNormRule,
    RMSNormRule,
)
from torchgram.backends.structured.rules.recurrent import (
    rewrite_gru,
    rewrite_lstm,
    rewrite_rnn_relu,
    rewrite_rnn_tanh,
)
from torchgram.backends.structured.rules.recurrent_saves import RECURRENT_KERNELS

RULES: tuple[Rule, ...] = (LinearRule(), MatmulRule(), AddmmRule(), BmmRule(), ConvRule(),
                           EmbeddingRule(), LayerNormRule(), GroupNormRule(), RMSNormRule(),
                           BatchNormRule(), MulRule(), AddRule(), ExpandRule())
_BY_FUNC: dict[Any, Rule] = {func: rule for rule in RULES for func in rule.funcs}
Rewrite = Callable[[tuple[Any, ...], dict[str, Any], AbstractContextManager[Any] | None], Any]
"""``rewrite(args, kwargs, mode)``: the call re-expressed, entering ``mode`` (the tapping mode)
around the calls the rules must see; ``NotImplemented`` when it does not apply."""

REWRITES: dict[Any, Rewrite] = {
    F.multi_head_attention_forward: rewrite_multi_head_attention,
    torch.lstm: rewrite_lstm,
    torch.gru: rewrite_gru,
    torch.rnn_tanh: rewrite_rnn_tanh,
    torch.rnn_relu: rewrite_rnn_relu,
    torch.einsum: rewrite_einsum,
    torch.lstm_cell: rewrite_lstm_cell,
    torch.gru_cell: rewrite_gru_cell,
    torch.rnn_tanh_cell: rewrite_rnn_tanh_cell,
    torch.rnn_relu_cell: rewrite_rnn_relu_cell,
}
"""Composite functions re-expressed (under the mode) in ops the rules see, when possible."""

SETTLED_PER_TRACE: frozenset[Any] = RECURRENT_KERNELS | CELL_KERNELS | {
    F.multi_head_attention_forward, torch.einsum}
"""Rewrites whose agreement with the original call one comparison per trace settles: each
writes the same equations as the original (the recurrent layers and cells; self-attention's
projections and ``scaled_dot_product_attention`` without masks or extra biases, which ``_supported``
checks on every call, and with dropout torch's own steps; einsum's matrix products), so they
agree whatever the values of the call's tensors, and what else the rewrite depends on
(shapes, dtypes, options, which weights it taps) a replay of the trace checks. Strides, which
only random draws see, are NOTE [rewritten layouts]'s. A rewrite added to ``REWRITES`` and not
listed here has its values compared on every call (NOTE [when the values are compared])."""


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


def rewrite_keeps_layout(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the rewrite of this call gives the call's own output layout and draws.

    The recurrent rewrites (NOTE [recurrent rewrite], NOTE [inter-layer dropout]), the cells'
    (NOTE [cell rewrite]) and the attention rewrite with dropout, which takes torch's own
    steps (NOTE [attention dropout]): they need no run with the original layouts (NOTE
    [rewritten layouts]).
    """
    if func in RECURRENT_KERNELS or func in CELL_KERNELS:
        return True
    return func is F.multi_head_attention_forward and takes_torch_steps(args, kwargs)


def rewrite_for(func: Any) -> Rewrite | None:
    """The rewrite of the composite function ``func``, if any (NOTE [attention rewrite])."""
    try:
        return REWRITES.get(func)
    except TypeError:
        return None


__all__ = ["REWRITES", "RULES", "SETTLED_PER_TRACE", "Layout", "Match", "Operand", "Rule",
           "UseShape", "rewrite_for", "rewrite_keeps_layout", "rule_for"]
