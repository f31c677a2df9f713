"""Recurrent cells (``nn.LSTMCell``, ``nn.GRUCell``, ``nn.RNNCell``) seen as their projections.

# NOTE [cell rewrite]
``torch.lstm_cell``, ``torch.gru_cell``, ``torch.rnn_tanh_cell`` and ``torch.rnn_relu_cell`` are
one kernel each, with the cell's weights as arguments: a ``TorchFunctionMode`` sees the call,
not the products inside it, so the weights would need the fallback, and ``vmap`` has no
batching rule for the kernels (the per-sample pass then loops over the samples: a 32-step
``nn.LSTMCell`` loop was 21x its backward, 7.7x with dropout, before session 47). While the
mode is active a call on a batch (``[B, D]`` input, ``[B, H]`` state) is *rewritten* into its
two projections, written with ``F.linear`` so the rules see the weights, and the cell's
documented equations (the same cells as NOTE [recurrent rewrite])::

    xs = linear(x, W_ih, b_ih);  hh = linear(h, W_hh, b_hh)
    LSTM:  i, f, g, o = σ, σ, tanh, σ of xs + hh;  c' = f ⊙ c + i ⊙ g;  h' = o ⊙ tanh(c')
    GRU:   r, z = σ(x_r + h_r), σ(x_z + h_z);  n = tanh(x_n + r ⊙ h_n);  h' = (1 - z) ⊙ n + z ⊙ h
    RNN:   h' = tanh(xs + hh) or relu(xs + hh)

A loop of cells uses each weight once per step: the rules take those uses together (NOTE
[uses taken together]). The outputs are contiguous ``[B, H]`` like the kernels', and the
cells draw nothing, so random ops after them see the plain call's layout
(``rules.rewrite_keeps_layout``). The equations hold for any values
(``rules.SETTLED_PER_TRACE``). Anything else (an unbatched call, mixed dtypes) keeps the
kernel, and its weights the fallback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from torchgram.backends.structured.rules.recurrent import (
    Cell,
    gru_cell,
    lstm_cell,
    rnn_relu_cell,
    rnn_tanh_cell,
)

_NAMES = ("input", "hx", "w_ih", "w_hh", "b_ih", "b_hh")


def _arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The call's arguments by name, or ``None`` if they are not a cell call's."""
    if len(args) > len(_NAMES) or any(name not in _NAMES for name in kwargs):
        return None
    bound = dict(zip(_NAMES, args, strict=False)) | kwargs
    bound.setdefault("b_ih", None)
    bound.setdefault("b_hh", None)
    return bound if all(name in bound for name in _NAMES) else None


def _plain(x: Any, states: tuple[Any, ...], tensors: tuple[Any, ...]) -> bool:
    """A batched call (``[B, D]`` input, ``[B, H]`` states), one floating dtype throughout."""
    if not isinstance(x, Tensor) or x.dim() != 2 or not x.is_floating_point():
        return False
    if not all(isinstance(s, Tensor) and s.dim() == 2 and s.shape[0] == x.shape[0]
               for s in states):
        return False
    return all(t is None or (isinstance(t, Tensor) and t.dtype == x.dtype)
               for t in (*states, *tensors))


def _rewrite(cell: Cell, lstm: bool) -> Callable[..., Any]:
    def rewrite(args: tuple[Any, ...], kwargs: dict[str, Any],
                mode: AbstractContextManager[Any] | None = None) -> Any:
        a = _arguments(args, kwargs)
        if a is None:
            return NotImplemented
        hx = a["hx"]
        states = tuple(hx) if lstm and isinstance(hx, list | tuple) else (hx,)
        if len(states) != (2 if lstm else 1):
            return NotImplemented
        weights = (a["w_ih"], a["w_hh"], a["b_ih"], a["b_hh"])
        if not _plain(a["input"], states, weights):
            return NotImplemented
        with mode or contextlib.nullcontext():
            xs = F.linear(a["input"], a["w_ih"], a["b_ih"])
            hh = F.linear(states[0], a["w_hh"], a["b_hh"])
        state = cell(F.linear, xs, hh, states, None)
        return state if lstm else state[0]

    return rewrite


rewrite_lstm_cell = _rewrite(lstm_cell, lstm=True)
"""``torch.lstm_cell(input, (hx, cx), w_ih, w_hh, b_ih, b_hh)`` rewritten, or ``NotImplemented``.

Example:
    >>> cell = torch.nn.LSTMCell(3, 4)
    >>> x, h, c = torch.randn(2, 3), torch.randn(2, 4), torch.randn(2, 4)
    >>> expected = cell(x, (h, c))
    >>> out = rewrite_lstm_cell((x, (h, c), cell.weight_ih, cell.weight_hh, cell.bias_ih,
    ...                          cell.bias_hh), {})
    >>> all(torch.allclose(a, b, atol=1e-6) for a, b in zip(out, expected))
    True
"""
rewrite_gru_cell = _rewrite(gru_cell, lstm=False)
"""``torch.gru_cell(input, hx, w_ih, w_hh, b_ih, b_hh)`` rewritten, or ``NotImplemented``."""
rewrite_rnn_tanh_cell = _rewrite(rnn_tanh_cell, lstm=False)
"""``torch.rnn_tanh_cell(input, hx, w_ih, w_hh, b_ih, b_hh)`` rewritten, or ``NotImplemented``."""
rewrite_rnn_relu_cell = _rewrite(rnn_relu_cell, lstm=False)
"""``torch.rnn_relu_cell(input, hx, w_ih, w_hh, b_ih, b_hh)`` rewritten, or ``NotImplemented``."""

CELL_KERNELS: frozenset[Any] = frozenset({torch.lstm_cell, torch.gru_cell, torch.rnn_tanh_cell,
                                          torch.rnn_relu_cell})
"""The cell kernels this module rewrites."""
