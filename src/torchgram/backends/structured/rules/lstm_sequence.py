"""An LSTM layer's recurrence as one autograd node, for the tapped forward of a batched pass.

NOTE [fused LSTM recurrence]
The recurrent rewrite (NOTE [recurrent rewrite] in ``recurrent.py``) runs an ``nn.LSTM`` step by
step so that the rules see its weights. Where the recurrent projection shares the input
projection's tap (the gates ``xs[t] + b_hh + h W_hhᵀ`` of an additive cell), what the pass
needs from the steps is only the cotangent of the gates at every step, ``δ_t`` (the tap's), and
the steps' inputs ``h_{t-1}`` (``W_hh``'s activations). Built from autograd-recorded ops, each
step costs about eight forward ops and sixteen backward nodes (the ``chunk`` and ``narrow`` of
the gates assemble a full-width gradient in the backward); on one CPU thread the LSTM of
``benchmarks/real_cases.py`` (B = 16, T = 32, H = 128) spends most of its time in those ops,
not in its matrix products. :class:`LSTMSequence` runs the same equations as one autograd
node: the forward's steps under no autograd recording (seven ops each), the backward's
hand-written back-propagation through time (seven ops each), ``i, f, g, o`` in the fused
kernel's order::

    gates_t = xs[t] + h_{t-1} W_hhᵀ + b_hh          (xs: the input projection, all steps)
    i, f, o = σ(gates_t) at their blocks;  g = tanh(gates_t) at its block
    c_t = f ⊙ c_{t-1} + i ⊙ g;  h_t = o ⊙ tanh(c_t)

and backward, from the last step processed to the first (``dh``, ``dc`` carried)::

    dh = ∂out_t + dh;  dc = dc + dh ⊙ o ⊙ (1 - tanh²(c_t))
    δ_t = [dc ⊙ g ⊙ i(1-i), dc ⊙ c_{t-1} ⊙ f(1-f), dc ⊙ i ⊙ (1-g²), dh ⊙ tanh(c_t) ⊙ o(1-o)]
    dc = dc ⊙ f;  dh = δ_t W_hh

The coefficients that do not depend on the carried gradients are formed for all steps at
once. The backward is written with batchable ops (the derivative checks run it under
``is_grads_batched``; NaN directions stay NaN through products) and is exact to round-off
against the step-by-step form (tests/backends/structured/test_lstm_sequence.py). It is
differentiable once (``once_differentiable``): the node is used only where the pass builds no
differentiable Gramian (:meth:`TapMode.fuses_recurrences`: not under ``torch.func`` transforms,
not for a create-graph call, not for the eager recording, whose graph is the user's).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable


class LSTMSequence(torch.autograd.Function):
    """The steps of one LSTM layer and direction (NOTE [fused LSTM recurrence]).

    ``apply(gates_in, h0, c0, weight_t, bias, dim, reverse)``: ``gates_in`` ``[..., 4H]`` with
    the steps along ``dim`` (the input projection), ``h0``, ``c0`` ``[B, H]``, ``weight_t``
    ``W_hhᵀ`` ``[H, 4H]``, ``bias`` ``b_hh`` ``[4H]`` or ``None`` (added at each step: one
    small op instead of a copy of ``gates_in``); ``reverse`` runs the steps last to first.
    Returns the outputs ``h_t`` stacked along ``dim`` (in step order) and the final ``h``,
    ``c``.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, gates_in: Tensor, h0: Tensor, c0: Tensor,
                weight_t: Tensor, bias: Tensor | None, dim: int,
                reverse: bool) -> tuple[Tensor, Tensor, Tensor]:
        """The steps without autograd recording; saves what the backward reads."""
        steps = gates_in.unbind(dim)
        hidden = h0.shape[-1]
        order = range(len(steps) - 1, -1, -1) if reverse else range(len(steps))
        h, c = h0, c0
        outputs: list[Tensor] = [h0] * len(steps)  # placeholders, all replaced
        inputs, cells, sigmoids, g_gates, tanh_cells = [], [], [], [], []
        for t in order:
            gates = torch.addmm(steps[t], h, weight_t)
            if bias is not None:
                gates += bias
            sigmoid = torch.sigmoid(gates)
            g = torch.tanh(gates[:, 2 * hidden:3 * hidden])
            inputs.append(h)
            cells.append(c)
            c = torch.addcmul(sigmoid[:, hidden:2 * hidden] * c, sigmoid[:, :hidden], g)
            tanh_cell = torch.tanh(c)
            h = sigmoid[:, 3 * hidden:] * tanh_cell
            outputs[t] = h
            sigmoids.append(sigmoid)
            g_gates.append(g)
            tanh_cells.append(tanh_cell)
        ctx.save_for_backward(torch.stack(sigmoids), torch.stack(g_gates), torch.stack(cells),
                              torch.stack(tanh_cells), torch.stack(inputs), weight_t)
        ctx.dim, ctx.reverse = dim, reverse  # type: ignore[attr-defined]
        return torch.stack(outputs, dim), h, c

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor, grad_h: Tensor,
                 grad_c: Tensor) -> tuple[Tensor | None, ...]:
        """Back-propagation through the steps: the gates' cotangents, then ``h0``'s, ``c0``'s."""
        sigmoids, g, cells, tanh_cells, inputs, weight_t = ctx.saved_tensors
        hidden = g.shape[-1]
        i, f = sigmoids[..., :hidden], sigmoids[..., hidden:2 * hidden]
        o = sigmoids[..., 3 * hidden:]
        # per processed step k: δ = [dc, dc, dc, dh] ⊙ coefficients (gates i, f, g, o)
        coefficients = torch.cat((g * i * (1 - i), cells * f * (1 - f), i * (1 - g * g),
                                  o * (1 - o) * tanh_cells), dim=-1)
        dc_of_dh = o * (1 - tanh_cells * tanh_cells)
        steps = len(sigmoids)
        out_grads = grad_out.unbind(ctx.dim)
        weight = weight_t.t()
        deltas: list[Tensor] = [grad_h] * steps  # placeholders, all replaced
        dh, dc = grad_h, grad_c
        for k in range(steps - 1, -1, -1):  # processed steps, last first
            t = steps - 1 - k if ctx.reverse else k
            dh = out_grads[t] + dh
            dc = torch.addcmul(dc, dh, dc_of_dh[k])
            delta = torch.cat((dc, dc, dc, dh), dim=-1) * coefficients[k]
            deltas[t] = delta
            dc = dc * f[k]
            dh = delta @ weight
        grad_gates = torch.stack(deltas, ctx.dim)
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[3]:  # Σ_t h_{t-1}ᵀ δ_t (processing order on both sides)
            processed = torch.stack(deltas[::-1] if ctx.reverse else deltas)
            grad_weight = inputs.reshape(-1, hidden).t() @ processed.reshape(-1, 4 * hidden)
        if ctx.needs_input_grad[4]:
            grad_bias = grad_gates.reshape(-1, 4 * hidden).sum(0)
        return grad_gates, dh, dc, grad_weight, grad_bias, None, None


def lstm_sequence(gates_in: Tensor, h0: Tensor, c0: Tensor, weight_t: Tensor,
                  bias: Tensor | None, *, dim: int,
                  reverse: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The layer's outputs, final ``h`` and ``c``, and the steps' inputs ``h_{t-1}``.

    The inputs are stacked along ``dim`` in step order (``h0`` at the first step processed),
    from the outputs: they are ``W_hh``'s activations.

    Example:
        >>> import torch
        >>> lstm = torch.nn.LSTM(3, 4, batch_first=True).double()
        >>> x = torch.randn(2, 5, 3, dtype=torch.float64)
        >>> w_ih, w_hh, b_ih, b_hh = lstm._flat_weights
        >>> xs = torch.nn.functional.linear(x, w_ih, b_ih)
        >>> zeros = torch.zeros(2, 4, dtype=torch.float64)
        >>> out, h, c, inputs = lstm_sequence(xs, zeros, zeros, w_hh.t(), b_hh, dim=1,
        ...                                   reverse=False)
        >>> expected, (h_n, c_n) = lstm(x)
        >>> torch.allclose(out, expected) and torch.allclose(c, c_n[0]), inputs.shape
        (True, torch.Size([2, 5, 4]))
    """
    out, h, c = LSTMSequence.apply(gates_in, h0, c0, weight_t, bias, dim, reverse)
    steps = out.shape[dim]
    first = h0.unsqueeze(dim)
    if reverse:
        inputs = torch.cat((out.narrow(dim, 1, steps - 1), first), dim)
    else:
        inputs = torch.cat((first, out.narrow(dim, 0, steps - 1)), dim)
    return out, h, c, inputs
