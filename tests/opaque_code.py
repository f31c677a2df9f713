"""Code inside ``f`` whose calls torchgram's modes cannot see: TorchScript and ``torch.compile``.

A TorchScript function runs its ops in TorchScript's interpreter, past every torch-function
mode (NOTE [unseen uses]); ``torch.compile``'d code runs through dynamo, which torchgram's
evaluations switch to eager (NOTE [compiled code in f]).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor


def _linear(h: Tensor, w: Tensor) -> Tensor:
    return h @ w.t()


def _bias_gelu(bias: Tensor, y: Tensor) -> Tensor:  # Megatron's fused helper
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1.0 + 0.044715 * x * x)))


def _layer(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    return torch.tanh(x @ weight.T + bias)


with warnings.catch_warnings():  # torch >= 2.11: torch.jit.script is deprecated
    warnings.simplefilter("ignore", DeprecationWarning)
    scripted_linear: Callable[[Tensor, Tensor], Tensor] = torch.jit.script(_linear)
    """``h @ wᵀ`` in TorchScript."""
    scripted_bias_gelu: Callable[[Tensor, Tensor], Tensor] = torch.jit.script(_bias_gelu)
    """``gelu(bias + y)`` (tanh approximation) in TorchScript."""

compiled_linear: Callable[[Tensor, Tensor], Tensor] = torch.compile(_linear, backend="eager")
"""``h @ wᵀ`` compiled by dynamo (graphs run eagerly: no C++ compiler needed)."""
compiled_layer: Callable[[Tensor, Tensor, Tensor], Tensor] = torch.compile(_layer,
                                                                            backend="eager")
"""``tanh(x @ weightᵀ + bias)``, compiled, graphs run eagerly."""
aot_compiled_layer: Callable[[Tensor, Tensor, Tensor], Tensor] = torch.compile(
    _layer, backend="aot_eager")
"""The same through AOTAutograd (one compiled backward node)."""
