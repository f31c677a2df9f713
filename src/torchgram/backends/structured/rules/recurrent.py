"""Seeing inside fused recurrent layers: ``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` as their cells.

# NOTE [recurrent rewrite]
``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` call one fused kernel (``torch.lstm``, ``torch.gru``,
``torch.rnn_tanh``, ``torch.rnn_relu``) with every weight of every layer and direction; a
``TorchFunctionMode`` sees that call, not the ops inside it, so all those weights would need
the fallback (and ``vmap`` cannot batch the kernel: the per-sample pass would loop). While
the mode is active the call is *rewritten* into the cells' documented equations, written
with ``F.linear`` so the rules see the weights, per layer and direction::

    xs = linear(x, W_ih, b_ih)                       all steps at once: [T, B, G·H] ([B, T, G·H])
    for t (reversed for the second direction):       G gates per step
        gates_t = xs[t] + linear(h, W_hh, b_hh)
        LSTM:  i, f, g, o = σ, σ, tanh, σ of gates_t;  c = f ⊙ c + i ⊙ g;  h = o ⊙ tanh(c)
               (h = linear(h, W_hr) with proj_size)
        GRU:   r, z = σ(x_r + h_r), σ(x_z + h_z);  n = tanh(x_n + r ⊙ h_n);  h = (1 - z) ⊙ n + z ⊙ h
        RNN:   h = tanh(gates_t) or relu(gates_t)

The recurrent weight ``W_hh`` is used once per step; it gets one tap for all the steps
(NOTE [step taps]), so it is one use of ``T`` positions, the activation the stacked inputs
``h`` of the steps. Where the mode cannot tap it that way (the weight needs the fallback),
each step's call is tapped on its own and the contractions take the uses together (NOTE [uses
taken together]). Only the input projections run in the tapping mode; the cells' elementwise
ops, which use no parameter, run without it (they are most of the calls). Where the pass keeps
no differentiable graph, an LSTM layer without projections (its recurrent weight joining the
input projection's tap) or a GRU layer with its step tap runs its steps as one autograd node
instead (NOTE [fused recurrences] in ``sequences.py``). ``xs`` is
unbound once into its steps: indexing it per step would make every step's backward write a
full-size zero gradient of ``xs`` (``T²`` work). A ``batch_first`` input keeps its layout
(steps along dim 1, outputs stacked there): a transposed ``x`` would make the projection and
its backward batched products over the steps instead of one matrix product. The output is
then given the fused kernel's strides exactly (time-major storage, seen batch-first; size-1
dims included, ``_core/layouts``): a random op after it (``F.dropout``) lays its mask out
along its input's strides, and ops between lay their outputs out by them (``torch.einsum``),
so other strides would drop other entries than in the call being differentiated (NOTE
[draws under torch.func]).
Only the unpacked form outside autocast is rewritten (autocast casts its cells otherwise than
the rewrite's ``F.linear``: on CPU a GRU's stay float32, where the rewrite's bfloat16 gates
would not even meet its float32 state), with inter-layer dropout in training mode only on CPU,
where the rewrite draws the kernel's own masks (NOTE [inter-layer dropout]; before session 47
such a call kept the fused kernel, and a function that draws then ran the rows of the whole
batch, ~5x slower); a ``PackedSequence``, an autocast region or dropout on another device
keeps the fused call, and its weights the fallback. Results are exact either way; the oracle
tests compare both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from torchgram._core import _torch_compat
from torchgram._core.layouts import with_strides
from torchgram.backends.structured.rules.sequences import gru_sequence, lstm_sequence

State = tuple[Tensor, ...]
Linear = Callable[[Tensor, Tensor, Tensor | None], Tensor]
Cell = Callable[[Linear, Tensor, Tensor | None, State, Tensor | None], State]
"""``cell(linear, xs_t, hh_t, state, w_hr)``: the next state from the step's input projection
``xs_t`` and recurrent projection ``hh_t = linear(h, W_hh, b_hh)``. For the cells that only
add them (LSTM, RNN: :data:`_ADDITIVE`) ``hh_t`` may be ``None``: ``xs_t`` is then the sum."""


def lstm_cell(linear: Linear, xs_t: Tensor, hh_t: Tensor | None, state: State,
              w_hr: Tensor | None) -> State:
    """An LSTM cell's next ``(h, c)`` (:data:`Cell`; ``w_hr``: the projection of ``h``)."""
    _, c = state
    gates = xs_t if hh_t is None else xs_t + hh_t
    i, f, _, o = torch.sigmoid(gates).chunk(4, dim=-1)  # one call for the three σ gates
    g = torch.tanh(gates.narrow(-1, 2 * c.shape[-1], c.shape[-1]))
    c = torch.addcmul(f * c, i, g)
    h = o * torch.tanh(c)
    return (h if w_hr is None else linear(h, w_hr, None)), c


def gru_cell(linear: Linear, xs_t: Tensor, hh_t: Tensor | None, state: State,
             w_hr: Tensor | None) -> State:
    """A GRU cell's next ``(h,)`` (:data:`Cell`)."""
    del linear, w_hr
    (h,) = state
    assert hh_t is not None
    x_r, x_z, x_n = xs_t.chunk(3, dim=-1)
    h_r, h_z, h_n = hh_t.chunk(3, dim=-1)
    r = torch.sigmoid(x_r + h_r)
    z = torch.sigmoid(x_z + h_z)
    n = torch.tanh(torch.addcmul(x_n, r, h_n))
    return (torch.lerp(n, h, z),)  # (1 - z) ⊙ n + z ⊙ h


def _rnn_cell(nonlinearity: Callable[[Tensor], Tensor]) -> Cell:
    def cell(linear: Linear, xs_t: Tensor, hh_t: Tensor | None, state: State,
             w_hr: Tensor | None) -> State:
        del linear, w_hr
        return (nonlinearity(xs_t if hh_t is None else xs_t + hh_t),)

    return cell


class _Recurrence:
    """``linear(h, W_hh, b_hh)`` of every step, tapped once for all steps.

    Through one step tap when the mode can (NOTE [step taps]), else one tapped call per step.
    For an additive cell whose input projection ``xs`` has a tap (``xs_tap``), the recurrent
    projection's cotangent is ``xs``'s (both are added into the gates): its uses join that
    tap, and :meth:`step` returns the gates ``xs[t] + b_hh + h W_hhᵀ`` from one ``addmm``.
    """

    def __init__(self, linear: Linear, mode: Any, weight: Tensor, bias: Tensor | None,
                 xs: Tensor, dim: int, h0: Tensor, xs_tap: int | None, *,
                 fused_cell: str | None = None) -> None:
        self._linear, self._mode, self._weight, self._bias = linear, mode, weight, bias
        self._dim = dim  # the steps' dim of xs, of the step tap and of the activations
        self._step_tap = None
        self._inputs: list[Tensor] = []
        # a mode that marks the step nodes made outside it (the eager recording's): _made
        self._steps_made = getattr(mode, "steps_made", None)
        if hasattr(mode, "tap_steps") and h0.dtype == weight.dtype:
            self._step_tap = mode.tap_steps(self._match(h0), xs.shape[dim],
                                            (*h0.shape[:-1], weight.shape[0]), h0.dtype,
                                            h0.device, dim=dim, share=xs_tap)
        self.gates: tuple[Tensor, ...] | None = None
        self.fused: str | None = None  # "lstm", "gru": run_fused (NOTE [fused recurrences])
        if self._step_tap is not None:
            plain_weight, *plain_bias = self._step_tap.values
            self._weight_t = plain_weight.t()
            self._plain_bias = plain_bias[0] if plain_bias else None
        self._xs = xs
        # an LSTM's node takes the gates' shared tap, a GRU's its own step tap
        if fused_cell is not None and self._step_tap is not None \
                and (xs_tap is not None) == (fused_cell == "lstm") \
                and getattr(mode, "fuses_recurrences", False) \
                and not _torch_compat.functorch_transforms():
            self.fused = fused_cell
        elif self._step_tap is not None and xs_tap is not None:
            gates = xs if self._plain_bias is None else self._made(xs + self._plain_bias)
            self.gates = gates.unbind(dim)
        else:  # one backward node for all steps: NOTE [recurrent rewrite]
            self.xs = xs.unbind(dim)

    def _made(self, y: Tensor) -> Tensor:
        """``y``, a result of the step tap's aliases made outside the mode, noted to it.

        A mode that marks its nodes (``steps_made``: the eager recording's, NOTE [recorded
        nodes]) is told of every node the rewrite makes with an edge into an alias (or into
        ``W_hhᵀ``) without the mode: the gates' bias and each step's ``addmm`` here, each
        step's output through ``step_output`` otherwise.
        """
        if self._steps_made is not None:
            self._steps_made(self._step_tap, y)
        return y

    def _match(self, h: Tensor) -> Any:
        from torchgram.backends.structured.rules.linear import LinearRule

        return LinearRule().match(F.linear, (h, self._weight, self._bias), {})

    def step(self, t: int, h: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(xs_t, hh_t)`` of step ``t``, or ``(gates_t, None)`` (see the class docstring)."""
        step_tap = self._step_tap
        if step_tap is None:
            return self.xs[t], self._linear(h, self._weight, self._bias)
        self._inputs.append(h)
        if self.gates is not None:
            return self._made(torch.addmm(self.gates[t], h, self._weight_t)), None
        return self.xs[t], self._mode.step_output(step_tap, t, F.linear(h, *step_tap.values))

    def run_fused(self, state: State, reverse: bool) -> tuple[Tensor, State]:
        """The layer's steps as one node (:attr:`fused`); its outputs and final state."""
        step_tap = self._step_tap
        assert step_tap is not None
        if self.fused == "lstm":
            out, h, c, inputs = lstm_sequence(self._xs, state[0], state[1], self._weight_t,
                                              self._plain_bias, dim=self._dim, reverse=reverse)
            final: State = (h, c)
        else:
            out, h, inputs = gru_sequence(self._xs, state[0], self._weight_t, self._plain_bias,
                                          step_tap.tap, dim=self._dim, reverse=reverse)
            final = (h,)
        self._mode.record_steps(step_tap, self._match(inputs))
        return out, final

    def finish(self, reverse: bool) -> None:
        """Record the uses of the step tap, with every step's input (in step order)."""
        if self._step_tap is not None:
            inputs = self._inputs[::-1] if reverse else self._inputs
            self._mode.record_steps(self._step_tap,
                                    self._match(torch.stack(inputs, dim=self._dim)))


def _run(cell: Cell, x: Tensor, initial: Sequence[State], params: Sequence[Tensor],
         has_biases: bool, num_layers: int, bidirectional: bool, batch_first: bool,
         per_direction: int, mode: AbstractContextManager[Any] | None,
         dropout: float = 0.0) -> tuple[Tensor, list[State]]:
    """The layers and directions of a recurrent net, step by step; output and final states.

    The projections run in ``mode`` (the tapping mode, when given), the rest without it;
    ``dropout``: the probability of the inter-layer dropout in training mode (NOTE [inter-layer
    dropout]), 0 when none.
    """
    taps = getattr(getattr(mode, "recording", None), "taps", None)

    def linear(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        with mode or contextlib.nullcontext():
            return F.linear(h, weight, bias)

    dim = 1 if batch_first else 0  # the steps' dim, kept: no transposed copies
    steps = x.shape[dim]
    directions = 2 if bidirectional else 1
    finals: list[State] = []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            w = list(params[index * per_direction:(index + 1) * per_direction])
            w_ih, w_hh = w[0], w[1]
            b_ih, b_hh = (w[2], w[3]) if has_biases else (None, None)
            w_hr = w[-1] if per_direction in (3, 5) else None
            before = None if taps is None else len(taps)
            xs = linear(x, w_ih, b_ih)
            xs_tap = before if cell in _ADDITIVE and taps is not None \
                and len(taps) == (before or 0) + 1 else None
            state = initial[index]
            fused_cell = "lstm" if cell is lstm_cell and w_hr is None \
                else "gru" if cell is gru_cell else None
            recurrence = _Recurrence(linear, mode, w_hh, b_hh, xs, dim, state[0], xs_tap,
                                     fused_cell=fused_cell)
            if recurrence.fused:
                fused_out, state = recurrence.run_fused(state, reverse=direction == 1)
                outputs.append(fused_out)
                finals.append(state)
                continue
            out: list[Tensor] = [x] * steps  # placeholders, all replaced
            for t in (range(steps) if direction == 0 else reversed(range(steps))):
                state = cell(linear, *recurrence.step(t, state[0]), state, w_hr)
                out[t] = state[0]
            recurrence.finish(reverse=direction == 1)
            outputs.append(torch.stack(out, dim=dim))
            finals.append(state)
        x = outputs[0] if directions == 1 else torch.cat(outputs, dim=-1)
        if dropout > 0 and layer < num_layers - 1:
            x = x * _kernel_dropout_noise(x, batch_first, dropout)
    if batch_first:  # the fused kernel's layout: time-major storage seen batch-first
        batch, width = x.shape[0], x.shape[2]
        x = with_strides(x, (width, batch * width, 1))
    return x, finals


def _kernel_dropout_noise(x: Tensor, batch_first: bool, p: float) -> Tensor:
    """The fused kernel's inter-layer dropout factors for a layer's output ``x``.

    NOTE [inter-layer dropout]: between layers, torch's CPU kernels (``_rnn_impl`` and the
    oneDNN LSTM) call ``at::dropout(output, p, train=True)`` on the layer's output, held
    time-major and contiguous (``[T, B, D·H]``, ``batch_first`` or not): that fills a new
    contiguous tensor of the same shape and dtype with ``bernoulli(1 - p)`` and divides it by
    ``1 - p``. ``torch.dropout`` of ones of that shape, layout and dtype, from the same random
    state, consumes the same draws and returns exactly those factors; nothing else in the
    kernel draws. The rewrite multiplies its own layer output by them (seen batch-first where
    the input is), so the masks are the plain call's and later draws start where they would.
    Only CPU kernels are rewritten with dropout (:func:`_dropout_reproducible`): cuDNN and
    MIOpen draw their masks with their own dropout states.
    """
    steps, batch = (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])
    ones = torch.ones(steps, batch, x.shape[2], dtype=x.dtype, device=x.device)
    noise = torch.dropout(ones, p, True)
    return noise.transpose(0, 1) if batch_first else noise


def _dropout_reproducible(x: Tensor, dropout: float, train: bool) -> bool:
    """Whether the rewrite gives the fused call's inter-layer dropout (NOTE above)."""
    return not (train and dropout > 0) or (x.device.type == "cpu" and 0 < dropout < 1)


def _unpacked(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a fused call is the unpacked form ``(input, hx, ...)``, outside autocast."""
    return (not kwargs and len(args) == 9 and isinstance(args[0], Tensor) and args[0].dim() == 3
            and isinstance(args[2], list | tuple) and isinstance(args[4], int)
            and isinstance(args[3], bool)
            and not torch.is_autocast_enabled(args[0].device.type))


def _per_direction(params: Sequence[Tensor], has_biases: bool, layers: int,
                   directions: int) -> int | None:
    per, rest = divmod(len(params), layers * directions)
    return per if rest == 0 and per in ((4, 5) if has_biases else (2, 3)) else None


def rewrite_lstm(args: tuple[Any, ...], kwargs: dict[str, Any],
                 mode: AbstractContextManager[Any] | None = None) -> Any:
    """``torch.lstm(input, (h0, c0), params, ...)`` step by step, or ``NotImplemented``.

    Example:
        >>> import torch
        >>> lstm = torch.nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True)
        >>> x = torch.randn(2, 5, 3)
        >>> expected, (h, c) = lstm(x)
        >>> zeros = torch.zeros(4, 2, 4)
        >>> out, h_n, c_n = rewrite_lstm((x, (zeros, zeros), lstm._flat_weights, True, 2, 0.0,
        ...                               False, True, True), {})
        >>> all(torch.allclose(a, b, atol=1e-6) for a, b in ((out, expected), (h_n, h), (c_n, c)))
        True
    """
    if not _unpacked(args, kwargs):
        return NotImplemented
    x, hx, params, has_biases, layers, dropout, train, bidirectional, batch_first = args
    directions = 2 if bidirectional else 1
    per = _per_direction(params, has_biases, layers, directions)
    if per is None or not _dropout_reproducible(x, dropout, train) or len(hx) != 2:
        return NotImplemented
    h0, c0 = hx
    initial = [(h0[i], c0[i]) for i in range(layers * directions)]
    out, finals = _run(lstm_cell, x, initial, params, has_biases, layers, bidirectional,
                       batch_first, per, mode, dropout if train else 0.0)
    return out, torch.stack([s[0] for s in finals]), torch.stack([s[1] for s in finals])


def _rewrite_single_state(cell: Cell) -> Callable[..., Any]:
    def rewrite(args: tuple[Any, ...], kwargs: dict[str, Any],
                mode: AbstractContextManager[Any] | None = None) -> Any:
        if not _unpacked(args, kwargs) or not isinstance(args[1], Tensor):
            return NotImplemented
        x, h0, params, has_biases, layers, dropout, train, bidirectional, batch_first = args
        directions = 2 if bidirectional else 1
        per = _per_direction(params, has_biases, layers, directions)
        if per is None or per in (3, 5) or not _dropout_reproducible(x, dropout, train):
            return NotImplemented
        initial = [(h0[i],) for i in range(layers * directions)]
        out, finals = _run(cell, x, initial, params, has_biases, layers, bidirectional,
                           batch_first, per, mode, dropout if train else 0.0)
        return out, torch.stack([s[0] for s in finals])

    return rewrite


rnn_tanh_cell, rnn_relu_cell = _rnn_cell(torch.tanh), _rnn_cell(torch.relu)
_ADDITIVE = frozenset({lstm_cell, rnn_tanh_cell, rnn_relu_cell})
"""The cells whose gates are ``xs_t + hh_t`` (both projections share one cotangent)."""

rewrite_gru = _rewrite_single_state(gru_cell)
"""``torch.gru(input, h0, params, ...)`` step by step, or ``NotImplemented``."""
rewrite_rnn_tanh = _rewrite_single_state(rnn_tanh_cell)
"""``torch.rnn_tanh(input, h0, params, ...)`` step by step, or ``NotImplemented``."""
rewrite_rnn_relu = _rewrite_single_state(rnn_relu_cell)
"""``torch.rnn_relu(input, h0, params, ...)`` step by step, or ``NotImplemented``."""
