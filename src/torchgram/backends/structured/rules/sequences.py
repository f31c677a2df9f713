"""An LSTM or GRU layer's steps as one autograd node, for the tapped forward of a pass.

NOTE [fused recurrences]
The recurrent rewrite (NOTE [recurrent rewrite] in ``recurrent.py``) runs an ``nn.LSTM`` or
``nn.GRU`` step by step so that the rules see its weights. What the pass needs from the steps
is only the cotangents at the layer's taps -- the input projection ``xs`` of all steps and the
recurrent projection ``hh_t = h_{t-1} W_hhᵀ + b_hh`` of every step (an LSTM's joins ``xs``'s
tap: its gates are ``xs[t] + hh_t``) -- and the steps' inputs ``h_{t-1}`` (``W_hh``'s
activations). Built from autograd-recorded ops, a step costs about eight forward ops and
sixteen backward nodes (the ``chunk`` and ``narrow`` of the gates assemble full-width gradients
with zeros and concatenations in the backward); on one CPU thread the recurrent models of
``benchmarks/real_cases.py`` (B = 16, T = 32, H = 128) spent most of their time in those ops,
not in their matrix products. :class:`LSTMSequence` and :class:`GRUSequence` run the same
equations as one autograd node each: the forward's steps without autograd recording, the
backward's hand-written back-propagation through time, the gates in the fused kernels'
order. LSTM (``i, f, g, o``)::

    gates_t = xs[t] + h_{t-1} W_hhᵀ + b_hh
    i, f, o = σ(gates_t) at their blocks;  g = tanh(gates_t) at its block
    c_t = f ⊙ c_{t-1} + i ⊙ g;  h_t = o ⊙ tanh(c_t)
    backward, last step processed first (dh, dc carried):
    dh = ∂out_t + dh;  dc = dc + dh ⊙ o ⊙ (1 - tanh²(c_t))
    δ_t = [dc ⊙ g ⊙ i(1-i), dc ⊙ c_{t-1} ⊙ f(1-f), dc ⊙ i ⊙ (1-g²), dh ⊙ tanh(c_t) ⊙ o(1-o)]
    dc = dc ⊙ f;  dh = δ_t W_hh                       (δ_t: the cotangent of xs[t] and hh_t)

GRU (``r, z, n``)::

    hh_t = h_{t-1} W_hhᵀ + b_hh (+ the tap's slice t)
    r, z = σ(xs_r + hh_r), σ(xs_z + hh_z);  n = tanh(xs_n + r ⊙ hh_n)
    h_t = (1-z) ⊙ n + z ⊙ h_{t-1}
    backward (dh carried):
    dh = ∂out_t + dh;  dn' = dh ⊙ (1-z)(1-n²);  dz' = dh ⊙ (h_{t-1} - n) z(1-z)
    dr' = dn' ⊙ hh_n r(1-r)
    ∂xs[t] = [dr', dz', dn'];  ∂hh_t = [dr', dz', dn' ⊙ r];  dh = dh ⊙ z + ∂hh_t W_hh

The coefficients that do not depend on the carried gradients are formed for all steps at
once. The backwards are written with batchable ops (the derivative checks run them under
``is_grads_batched``; NaN directions stay NaN through products) and are exact to round-off
against the step-by-step forms (``tests/backends/structured/rules/test_sequences.py``). They are
differentiable once, so the nodes are used only where the pass builds no differentiable
Gramian (:meth:`TapMode.fuses_recurrences`: not under ``torch.func`` transforms, not for a
create-graph call, not for the eager recording, whose graph is the user's, and not in passes
that only plan -- a trace, ``auto``'s planning forward), and a backward
through one that asks for a graph raises :class:`DifferentiatedTwice` (a ``BackendCannotRun``
naming the graph walk, through ``torch_refusals``): that is ``f`` differentiating its own
recurrence (``torch.autograd.grad(..., create_graph=True)`` inside ``f``), whose second
derivative the node does not have. (With ``once_differentiable`` such an ``f``'s Gramian
silently lost those terms: 0.66 off on a GRU, session 36's review. The structured pass misses
what an ``f`` that differentiates itself does with any layer's weights -- 1e-2 off on an MLP,
before this change too -- an open limitation, not this node's.)

A/B in one process (1 thread, ``benchmarks/real_cases.py``' FULL sizes, medians of 15-31
alternated calls): the per-sample Gramian of the LSTM 0.85 to 0.90 times the time (4.06× a
backward → 3.46×), of the two-layer bidirectional GRU 0.81 to 0.86 times (1.69-1.80× →
1.45-1.46×). Session 50 (NOTE [steps written in place], and the backwards' per-step views
made once): the LSTM 0.90 to 0.95 times again (3.11-3.37× → 2.86-3.04×), the GRU 0.90 to
0.95 (1.37-1.40× → 1.27-1.33×); the same matrices to the last bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from torchgram._core.errors import DifferentiatedTwice


def _processing_order(steps: int, reverse: bool) -> range:
    """The steps in the order they run (last to first for a layer's second direction)."""
    return range(steps - 1, -1, -1) if reverse else range(steps)


def step_inputs(out: Tensor, h0: Tensor, *, dim: int, reverse: bool) -> Tensor:
    """Every step's input ``h_{t-1}`` stacked along ``dim`` in step order (``W_hh``'s acts).

    Example:
        >>> out = torch.arange(3.0).reshape(1, 3, 1)  # steps along dim 1
        >>> step_inputs(out, torch.full((1, 1), -1.0), dim=1, reverse=False).flatten()
        tensor([-1.,  0.,  1.])
        >>> step_inputs(out, torch.full((1, 1), -1.0), dim=1, reverse=True).flatten()
        tensor([ 1.,  2., -1.])
    """
    steps, first = out.shape[dim], h0.unsqueeze(dim)
    if reverse:
        return torch.cat((out.narrow(dim, 1, steps - 1), first), dim)
    return torch.cat((first, out.narrow(dim, 0, steps - 1)), dim)


# NOTE [steps written in place]
# The forward of a node runs eight small ops per step (B × 4H for an LSTM), so what costs is
# the number of ops, not their arithmetic: each step's values are written by the ops that make
# them (``out=``, in-place updates) into their rows of buffers stacked over the steps, which the
# backward reads as they are, and the next step reads its ``h_{t-1}`` (and ``c_{t-1}``) from
# the row the step before wrote. Copying each value into a stacked buffer afterwards (and
# stacking the outputs at the end) took as many ops again. The buffers hold every step once:
# the node's outputs are copies (the stacked ``h_t`` in step order, the final ``h`` and ``c``),
# so that nothing the caller does to them touches what the backward reads.


# NOTE [row-major step weights]
# Every step multiplies a small ``[B, H]`` (forward) or ``[B, kH]`` (backward) matrix by the
# recurrent weight, and on CPU the BLAS (MKL, 1 thread) takes up to 3 times as long for a
# transposed right-hand operand at these sizes (``[16, 512] @ [512, 128]``: 31 µs against 11
# µs). ``W_hhᵀ`` comes in as a transposed view of the parameter, so the forward's products
# and, for a caller that passes a row-major ``W_hhᵀ``, the backward's would all be of that
# kind: each node makes its weight row-major once (``contiguous``: one copy of ``kH × H``, none
# where it already is) instead.


class _StepBuffers:
    """The stacked per-step buffers of a node's forward (NOTE [steps written in place]).

    Each :meth:`rows` call allocates one buffer ``[steps, *shape]`` (``[steps + 1, ...]``
    with ``first``, its row 0) like ``like`` (dtype, device) and returns its rows, views in
    processing order; :attr:`stacked` gives the buffers, in the order they were made.
    """

    def __init__(self, like: Tensor, steps: int) -> None:
        self._like, self._steps = like, steps
        self.stacked: list[Tensor] = []

    def rows(self, shape: Sequence[int], first: Tensor | None = None) -> tuple[Tensor, ...]:
        """A new buffer's rows (one more, holding ``first``, where it is given)."""
        buffer = self._like.new_empty((self._steps + (first is not None), *shape))
        if first is not None:
            buffer[0].copy_(first)
        self.stacked.append(buffer)
        return buffer.unbind(0)


def _outputs(states: Tensor, dim: int, reverse: bool) -> Tensor:
    """The outputs ``h_1 .. h_T`` of ``states`` ``[T + 1, ...]`` (processing order).

    A new tensor, with the steps along ``dim`` in step order (``torch.stack``'s layout): a
    copy even where a view would have that layout, since ``states`` is saved for the backward
    (an in-place change of the outputs must not reach it).
    """
    processed = states[1:]
    return (processed.flip(0) if reverse else processed).movedim(0, dim).clone(
        memory_format=torch.contiguous_format)


class _StepGrads:
    """A backward's per-step cotangents, written into their stacked tensor as they come.

    ``stacked`` has the steps along ``dim`` (``torch.stack(values, dim)``'s layout); it is
    made like the first value put (``new_empty``: batched too under ``is_grads_batched``),
    so no list of per-step values is held beside it.
    """

    def __init__(self, steps: int, dim: int) -> None:
        self._steps, self._dim = steps, dim
        self._stacked: Tensor | None = None

    def put(self, step: int, value: Tensor) -> None:
        """Step ``step``'s cotangent."""
        if self._stacked is None:
            shape = list(value.shape)
            shape.insert(self._dim, self._steps)
            self._stacked = value.new_empty(shape)
        self._stacked.select(self._dim, step).copy_(value)

    @property
    def stacked(self) -> Tensor:
        """Every step's cotangent, stacked (all steps put)."""
        assert self._stacked is not None
        return self._stacked


class LSTMSequence(torch.autograd.Function):
    """The steps of one LSTM layer and direction (NOTE [fused recurrences]).

    ``apply(xs, h0, c0, weight_t, bias, dim, reverse)``: ``xs`` ``[..., 4H]`` with the steps
    along ``dim`` (the input projection), ``h0``, ``c0`` ``[B, H]``, ``weight_t`` ``W_hhᵀ``
    ``[H, 4H]``, ``bias`` ``b_hh`` ``[4H]`` or ``None`` (added at each step: one small op
    instead of a copy of ``xs``); ``reverse`` runs the steps last to first. Returns the
    outputs ``h_t`` stacked along ``dim`` (in step order) and the final ``h``, ``c``.

    Like :class:`GRUSequence`, a node of torchgram's tapped passes, never of ``f`` under
    ``torch.func``: ``torchgram_rewrite`` keeps it out of the old-style Functions that would
    steer ``auto`` away from ``jacobian`` and ``ntvp`` (``_torch_compat.old_style_functions``).
    """

    torchgram_rewrite: ClassVar[bool] = True

    @staticmethod
    def forward(ctx: FunctionCtx, xs: Tensor, h0: Tensor, c0: Tensor, weight_t: Tensor,
                bias: Tensor | None, dim: int, reverse: bool) -> tuple[Tensor, Tensor, Tensor]:
        """The steps without autograd recording; saves what the backward reads.

        Every step writes its values straight into their rows of the stacked buffers (NOTE
        [steps written in place]): σ(gates), g, the cells ``c_0 .. c_T``, tanh(c_t) and the
        hidden states ``h_0 .. h_T``, in processing order.
        """
        steps = xs.unbind(dim)
        hidden = h0.shape[-1]
        order = _processing_order(len(steps), reverse)
        step_weight = weight_t.contiguous()  # NOTE [row-major step weights]
        gates = torch.addmm(steps[order[0]], h0, step_weight)  # the first step's: dtype, device
        buffers = _StepBuffers(gates, len(steps))
        sigmoids, g_rows = buffers.rows(gates.shape), buffers.rows(h0.shape)
        cells, tanh_cells = buffers.rows(h0.shape, first=c0), buffers.rows(h0.shape)
        states = buffers.rows(h0.shape, first=h0)
        sigmoid_all, g_all, cell_all, tanh_all, state_all = buffers.stacked
        i, f, o = (sigmoid_all[..., block * hidden:(block + 1) * hidden].unbind(0)
                   for block in (0, 1, 3))  # views made once, not a slice per step
        gates_g = gates[:, 2 * hidden:3 * hidden]  # gates is written in place at every step
        for k, t in enumerate(order):
            if k:
                torch.addmm(steps[t], states[k], step_weight, out=gates)
            if bias is not None:
                gates += bias
            torch.sigmoid(gates, out=sigmoids[k])
            g = torch.tanh(gates_g, out=g_rows[k])
            torch.mul(f[k], cells[k], out=cells[k + 1]).addcmul_(i[k], g)
            torch.mul(o[k], torch.tanh(cells[k + 1], out=tanh_cells[k]), out=states[k + 1])
        ctx.save_for_backward(sigmoid_all, g_all, cell_all[:-1], tanh_all, state_all[:-1],
                              weight_t)
        ctx.dim, ctx.reverse = dim, reverse  # type: ignore[attr-defined]
        return (_outputs(state_all, dim, reverse), state_all[-1].clone(),
                cell_all[-1].clone())

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, grad_h: Tensor,
                 grad_c: Tensor) -> tuple[Tensor | None, ...]:
        """Back-propagation through the steps: the gates' cotangents, then ``h0``'s, ``c0``'s."""
        _refuse_a_graph("LSTM")
        sigmoids, g, cells, tanh_cells, inputs, weight_t = ctx.saved_tensors
        hidden = g.shape[-1]
        i, f = sigmoids[..., :hidden], sigmoids[..., hidden:2 * hidden]
        o = sigmoids[..., 3 * hidden:]
        # per processed step k: δ = [dc, dc, dc, dh] ⊙ coefficients (gates i, f, g, o), each
        # block written in place (no four blocks beside their concatenation)
        coefficients = torch.empty_like(sigmoids)
        blocks = coefficients.split(hidden, dim=-1)
        torch.mul(g, i * (1 - i), out=blocks[0])
        torch.mul(cells, f * (1 - f), out=blocks[1])
        torch.mul(i, 1 - g * g, out=blocks[2])
        torch.mul(o * (1 - o), tanh_cells, out=blocks[3])
        dc_of_dh = o * (1 - tanh_cells * tanh_cells)
        steps = len(sigmoids)
        out_grads = grad_out.unbind(ctx.dim)
        weight = weight_t.t().contiguous()  # NOTE [row-major step weights]
        deltas = _StepGrads(steps, ctx.dim)
        dh, dc = grad_h, grad_c
        per_step = zip(dc_of_dh.unbind(0), coefficients.unbind(0), f.unbind(0), strict=True)
        for k, (dc_per_dh, coefficient, forget) in reversed(list(enumerate(per_step))):
            t = steps - 1 - k if ctx.reverse else k  # processed steps, last first
            dh = out_grads[t] + dh
            dc = torch.addcmul(dc, dh, dc_per_dh)
            delta = torch.cat((dc, dc, dc, dh), dim=-1) * coefficient
            deltas.put(t, delta)
            dc = dc * forget
            dh = delta @ weight
        grad_weight, grad_bias = _recurrent_grads(ctx, 3, inputs, deltas)
        return deltas.stacked, dh, dc, grad_weight, grad_bias, None, None


class GRUSequence(torch.autograd.Function):
    """The steps of one GRU layer and direction (NOTE [fused recurrences]).

    ``apply(xs, h0, weight_t, bias, tap, dim, reverse)``: ``xs`` ``[..., 3H]`` with the steps
    along ``dim`` (the input projection), ``h0`` ``[B, H]``, ``weight_t`` ``W_hhᵀ``
    ``[H, 3H]``, ``bias`` ``b_hh`` ``[3H]`` or ``None``, ``tap``: the recurrent projection's
    tap ``[..., 3H]`` (steps along ``dim``, added to ``hh_t``; its cotangent is ``∂hh_t``) or
    ``None``. Returns the outputs ``h_t`` stacked along ``dim`` and the final ``h``.
    """

    torchgram_rewrite: ClassVar[bool] = True

    @staticmethod
    def forward(ctx: FunctionCtx, xs: Tensor, h0: Tensor, weight_t: Tensor,
                bias: Tensor | None, tap: Tensor | None, dim: int,
                reverse: bool) -> tuple[Tensor, Tensor]:
        """The steps without autograd recording; saves what the backward reads.

        Every step writes its values straight into their rows of the stacked buffers (NOTE
        [steps written in place]): the recurrent projections ``hh_t``, σ of the reset and
        update gates, n, and the hidden states ``h_0 .. h_T``, in processing order.
        """
        steps = xs.unbind(dim)
        tap_steps = None if tap is None else tap.unbind(dim)
        hidden = h0.shape[-1]
        order = _processing_order(len(steps), reverse)
        step_weight = weight_t.contiguous()  # NOTE [row-major step weights]

        def projection(t: int, h: Tensor, out: Tensor | None = None) -> Tensor:
            if tap_steps is None:
                return torch.mm(h, step_weight, out=out)
            return torch.addmm(tap_steps[t], h, step_weight, out=out)

        first = projection(order[0], h0)  # the first step's: dtype, device
        buffers = _StepBuffers(first, len(steps))
        projections, gates = buffers.rows(first.shape), buffers.rows((*h0.shape[:-1], 2 * hidden))
        news, states = buffers.rows(h0.shape), buffers.rows(h0.shape, first=h0)
        projections[0].copy_(first)
        projection_all, gate_all, new_all, state_all = buffers.stacked
        # views made once, not slices per step
        x_gates, x_new = xs[..., :2 * hidden].unbind(dim), xs[..., 2 * hidden:].unbind(dim)
        hh_gates = projection_all[..., :2 * hidden].unbind(0)
        hh_new = projection_all[..., 2 * hidden:].unbind(0)
        reset, update = gate_all[..., :hidden].unbind(0), gate_all[..., hidden:].unbind(0)
        for k, t in enumerate(order):
            if k:
                projection(t, states[k], out=projections[k])
            if bias is not None:
                projections[k].add_(bias)
            torch.add(x_gates[t], hh_gates[k], out=gates[k]).sigmoid_()
            new = torch.addcmul(x_new[t], reset[k], hh_new[k], out=news[k]).tanh_()
            torch.lerp(new, states[k], update[k], out=states[k + 1])
        ctx.save_for_backward(state_all[:-1], gate_all[..., :hidden], gate_all[..., hidden:],
                              new_all, projection_all[..., 2 * hidden:], weight_t)
        ctx.dim, ctx.reverse = dim, reverse  # type: ignore[attr-defined]
        return _outputs(state_all, dim, reverse), state_all[-1].clone()

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, grad_h: Tensor) -> tuple[Tensor | None, ...]:
        """Back-propagation through the steps: ``∂xs``, ``∂h0``, then the tap's ``∂hh``."""
        _refuse_a_graph("GRU")
        inputs, reset, update, new, hidden_new, weight_t = ctx.saved_tensors
        of_new = (1 - update) * (1 - new * new)  # dn' per dh
        of_update = (inputs - new) * update * (1 - update)  # dz' per dh
        of_reset = hidden_new * reset * (1 - reset)  # dr' per dn'
        steps = len(inputs)
        out_grads = grad_out.unbind(ctx.dim)
        weight = weight_t.t().contiguous()  # NOTE [row-major step weights]
        grad_steps, grad_hh = _StepGrads(steps, ctx.dim), _StepGrads(steps, ctx.dim)
        keep_hh = any(ctx.needs_input_grad[2:5])  # W_hhᵀ, b_hh, the tap
        dh = grad_h
        per_step = zip(of_new.unbind(0), of_update.unbind(0), of_reset.unbind(0),
                       reset.unbind(0), update.unbind(0), strict=True)
        for k, (new_k, update_k, reset_k, r, z) in reversed(list(enumerate(per_step))):
            t = steps - 1 - k if ctx.reverse else k  # processed steps, last first
            dh = out_grads[t] + dh
            d_new = dh * new_k
            d_update = dh * update_k
            d_reset = d_new * reset_k
            grad_steps.put(t, torch.cat((d_reset, d_update, d_new), dim=-1))
            hh_t = torch.cat((d_reset, d_update, d_new * r), dim=-1)
            if keep_hh:
                grad_hh.put(t, hh_t)
            dh = torch.addmm(dh * z, hh_t, weight)
        grad_tap = grad_hh.stacked if ctx.needs_input_grad[4] else None
        grad_weight, grad_bias = _recurrent_grads(ctx, 2, inputs, grad_hh)
        return grad_steps.stacked, dh, grad_weight, grad_bias, grad_tap, None, None


def _refuse_a_graph(kind: str) -> None:
    """Raise :class:`DifferentiatedTwice` in a backward asked for a graph (``create_graph``).

    The nodes are differentiable once and run only in passes that build no graph; a
    ``create_graph`` backward through one is ``f`` differentiating its own recurrence inside
    the pass, whose second derivatives the node does not have (NOTE [fused recurrences]).
    """
    if torch.is_grad_enabled():
        raise DifferentiatedTwice(
            f"a backward with create_graph=True through an nn.{kind} (f calls "
            "torch.autograd.grad(..., create_graph=True) itself)")


def _recurrent_grads(ctx: Any, weight_index: int, inputs: Tensor,
                     grad_hh: _StepGrads) -> tuple[Tensor | None, Tensor | None]:
    """``W_hhᵀ``'s and ``b_hh``'s gradients where asked (not in a tapped pass: plain copies).

    ``Σ_t h_{t-1}ᵀ ∂hh_t`` and ``Σ_t ∂hh_t`` (``inputs`` in processing order along dim 0,
    ``grad_hh`` in step order along ``ctx.dim``).
    """
    if not (ctx.needs_input_grad[weight_index] or ctx.needs_input_grad[weight_index + 1]):
        return None, None
    processed = grad_hh.stacked.movedim(ctx.dim, 0)
    if ctx.reverse:
        processed = processed.flip(0)
    processed = processed.reshape(-1, processed.shape[-1])
    grad_weight = (inputs.reshape(-1, inputs.shape[-1]).t() @ processed
                   if ctx.needs_input_grad[weight_index] else None)
    grad_bias = processed.sum(0) if ctx.needs_input_grad[weight_index + 1] else None
    return grad_weight, grad_bias


def lstm_sequence(xs: Tensor, h0: Tensor, c0: Tensor, weight_t: Tensor, bias: Tensor | None, *,
                  dim: int, reverse: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """An LSTM layer's outputs, final ``h`` and ``c``, and the steps' inputs (:func:`step_inputs`).

    Example:
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
    out, h, c = LSTMSequence.apply(xs, h0, c0, weight_t, bias, dim, reverse)
    return out, h, c, step_inputs(out, h0, dim=dim, reverse=reverse)


def gru_sequence(xs: Tensor, h0: Tensor, weight_t: Tensor, bias: Tensor | None,
                 tap: Tensor | None, *, dim: int,
                 reverse: bool) -> tuple[Tensor, Tensor, Tensor]:
    """A GRU layer's outputs, final ``h`` and the steps' inputs (:func:`step_inputs`).

    Example:
        >>> gru = torch.nn.GRU(3, 4).double()
        >>> x = torch.randn(5, 2, 3, dtype=torch.float64)  # steps first
        >>> w_ih, w_hh, b_ih, b_hh = gru._flat_weights
        >>> xs = torch.nn.functional.linear(x, w_ih, b_ih)
        >>> zeros = torch.zeros(2, 4, dtype=torch.float64)
        >>> out, h, inputs = gru_sequence(xs, zeros, w_hh.t(), b_hh, None, dim=0,
        ...                               reverse=False)
        >>> expected, h_n = gru(x)
        >>> torch.allclose(out, expected) and torch.allclose(h, h_n[0])
        True
    """
    out, h = GRUSequence.apply(xs, h0, weight_t, bias, tap, dim, reverse)
    return out, h, step_inputs(out, h0, dim=dim, reverse=reverse)
