"""An LSTM or GRU layer's steps as one autograd node (NOTE [fused recurrences])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import torchgram as tg
from reference import dense_gramian, dense_gramian_fn
from torchgram import BackendCannotRun
from torchgram._core import _torch_compat
from torchgram._core.errors import DifferentiatedTwice
from torchgram.backends.structured.rules import recurrent, sequences
from torchgram.backends.structured.rules.sequences import (
    GRUSequence,
    LSTMSequence,
    gru_sequence,
    lstm_sequence,
    step_inputs,
)
from torchgram.backends.structured.trace import TapMode

B, T, H = 3, 5, 4


def _order(reverse: bool) -> range:
    return range(T - 1, -1, -1) if reverse else range(T)


def _lstm_steps(xs: Tensor, h0: Tensor, c0: Tensor, weight_t: Tensor, bias: Tensor, dim: int,
                reverse: bool) -> tuple[Tensor, ...]:
    """The LSTM equations one step at a time, recorded by autograd (the reference)."""
    h, c, outputs = h0, c0, {}
    for t in _order(reverse):
        i, f, g, o = (xs.select(dim, t) + h @ weight_t + bias).chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = outputs[t] = torch.sigmoid(o) * torch.tanh(c)
    return torch.stack([outputs[t] for t in range(T)], dim), h, c


def _gru_steps(xs: Tensor, h0: Tensor, weight_t: Tensor, bias: Tensor, tap: Tensor, dim: int,
               reverse: bool) -> tuple[Tensor, ...]:
    """The GRU equations one step at a time, recorded by autograd (the reference)."""
    h, outputs = h0, {}
    for t in _order(reverse):
        x_r, x_z, x_n = xs.select(dim, t).chunk(3, dim=-1)
        h_r, h_z, h_n = (h @ weight_t + bias + tap.select(dim, t)).chunk(3, dim=-1)
        r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
        n = torch.tanh(x_n + r * h_n)
        h = outputs[t] = (1 - z) * n + z * h
    return torch.stack([outputs[t] for t in range(T)], dim), h


def _inputs(kind: str, dim: int) -> tuple[Tensor, ...]:
    """The node's tensor inputs, all requiring grad (float64)."""
    generator = torch.Generator().manual_seed(0)
    gates = 4 if kind == "lstm" else 3

    def draw(*shape: int, scale: float = 1.0) -> Tensor:
        return scale * torch.randn(shape, dtype=torch.float64, generator=generator)

    steps_shape = (T, B, gates * H) if dim == 0 else (B, T, gates * H)
    xs, h0 = draw(*steps_shape), draw(B, H)
    weight_t, bias = draw(H, gates * H, scale=0.5), draw(gates * H)
    tensors = ((xs, h0, draw(B, H), weight_t, bias) if kind == "lstm"
               else (xs, h0, weight_t, bias, draw(*steps_shape, scale=0.1)))
    return tuple(t.requires_grad_() for t in tensors)


NODES: dict[str, tuple[Any, Callable[..., tuple[Tensor, ...]]]] = {
    "lstm": (LSTMSequence, _lstm_steps), "gru": (GRUSequence, _gru_steps)}
LAYOUTS = {"time_major": 0, "batch_first": 1}


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", list(NODES))
def test_node_matches_the_steps_and_their_derivatives(kind: str, layout: str,
                                                      reverse: bool) -> None:
    node, steps_of = NODES[kind]
    dim = LAYOUTS[layout]
    inputs = _inputs(kind, dim)
    fused = node.apply(*inputs, dim, reverse)
    steps = steps_of(*inputs, dim, reverse)
    for actual, expected in zip(fused, steps, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-13, atol=1e-13)
    cotangents = [torch.randn_like(t) for t in steps]
    actual_grads = torch.autograd.grad(fused, inputs, cotangents)
    expected_grads = torch.autograd.grad(steps, inputs, cotangents)
    for actual, expected in zip(actual_grads, expected_grads, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", list(NODES))
def test_outputs_changed_in_place_leave_the_backward_right(kind: str, layout: str) -> None:
    """The outputs are copies of what the backward reads (NOTE [steps written in place]):
    ``f`` writing into them (``out[0] = 0``, ``h.mul_(2)``) changes nothing it saved."""
    node, steps_of = NODES[kind]
    dim = LAYOUTS[layout]
    inputs = _inputs(kind, dim)

    def changed(outputs: tuple[Tensor, ...]) -> Tensor:
        out, last = outputs[0], outputs[1]
        out.select(dim, 0).zero_()
        last.mul_(2.0)
        return out.sum() + last.pow(2).sum()

    fused = torch.autograd.grad(changed(node.apply(*inputs, dim, False)), inputs)
    steps = torch.autograd.grad(changed(steps_of(*inputs, dim, False)), inputs)
    for actual, expected in zip(fused, steps, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("kind", list(NODES))
def test_batched_directions_and_nan_stay_in_their_sample(kind: str, reverse: bool) -> None:
    """The derivative checks run the backward under ``is_grads_batched``, NaN directions too."""
    node, steps_of = NODES[kind]
    inputs = _inputs(kind, 1)
    fused = node.apply(*inputs, 1, reverse)
    steps = steps_of(*inputs, 1, reverse)
    directions = [torch.randn(3, *t.shape, dtype=t.dtype) for t in steps]
    directions[0][2, 0] = float("nan")  # the third direction: NaN on sample 0's outputs only
    wrt = inputs[:2]  # xs and h0
    actual = torch.autograd.grad(fused, wrt, directions, is_grads_batched=True)
    expected = torch.autograd.grad(steps, wrt, directions, is_grads_batched=True)
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got[:2], want[:2], rtol=1e-12, atol=1e-12)
    xs_grad = actual[0][2]
    assert xs_grad[0].isnan().any() and not xs_grad[1:].isnan().any()


@pytest.mark.parametrize("kind", list(NODES))
def test_a_backward_with_a_graph_is_refused_not_wrong(kind: str) -> None:
    """Differentiable once: ``create_graph`` through a node raises, never a wrong number."""
    node, _ = NODES[kind]
    inputs = _inputs(kind, 1)
    out = node.apply(*inputs, 1, False)[0]
    torch.autograd.grad(out.pow(2).sum(), inputs[0], retain_graph=True)  # first order: fine
    with pytest.raises(DifferentiatedTwice, match="create_graph=True through an nn."):
        torch.autograd.grad(out.pow(2).sum(), inputs[0], create_graph=True)


@pytest.mark.parametrize("kind", list(NODES))
def test_f_differentiating_its_own_recurrence(kind: str) -> None:
    """``f`` calling ``torch.autograd.grad(create_graph=True)`` through its LSTM / GRU.

    The node has no second derivative: structured declines, naming the graph walk, which
    ``auto`` then takes (session 36's review: once-differentiable nodes lost those terms
    without a word, 0.055 off on an LSTM, 0.66 on a GRU).
    """
    torch.manual_seed(0)
    module = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[kind](3, H, batch_first=True).double()
    fn, params = tg.functionalize(module)

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        with torch.enable_grad():
            xr = x.detach().requires_grad_()
            out = fn(p, xr)[0]
            (gx,) = torch.autograd.grad(out.pow(2).sum(), xr, create_graph=True)
        return gx.pow(2).sum((1, 2)) + out[:, -1].sum(-1)

    params = {k: v.detach() for k, v in params.items()}
    x = torch.randn(B, T, 3, dtype=torch.float64)
    with pytest.raises(BackendCannotRun, match="backend='graph'"):
        tg.gramian(f, backend="structured", batch_dim=0)(params, x)
    expected = dense_gramian(f, (params, x)).gramian
    G = tg.gramian(f, backend="auto", batch_dim=0)(params, x)
    torch.testing.assert_close(G / expected.abs().max(), expected / expected.abs().max(),
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_step_inputs_are_h0_then_the_outputs_in_step_order(reverse: bool) -> None:
    xs, h0, c0, weight_t, bias = (t.detach() for t in _inputs("lstm", 1))
    out, _, _, inputs = lstm_sequence(xs, h0, c0, weight_t, bias, dim=1, reverse=reverse)
    first = T - 1 if reverse else 0
    torch.testing.assert_close(inputs[:, first], h0)
    for t in range(T):
        if t != first:
            torch.testing.assert_close(inputs[:, t], out[:, t + 1 if reverse else t - 1])
    torch.testing.assert_close(step_inputs(out, h0, dim=1, reverse=reverse), inputs)
    xs, h0, weight_t, bias, tap = (t.detach() for t in _inputs("gru", 1))
    out, _, inputs = gru_sequence(xs, h0, weight_t, bias, tap, dim=1, reverse=reverse)
    torch.testing.assert_close(inputs, step_inputs(out, h0, dim=1, reverse=reverse))


def _rnn_losses(kind: str, **options: Any) -> tuple[Callable[..., Tensor], dict[str, Tensor],
                                                     Tensor]:
    torch.manual_seed(0)
    module = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[kind](3, H, batch_first=True,
                                                               **options).double()
    fn, params = tg.functionalize(module)

    def losses(p: dict[str, Tensor], x: Tensor) -> Tensor:
        out, state = fn(p, x)
        h_n = state[0] if isinstance(state, tuple) else state
        return torch.tanh(out[:, -1]).sum(-1) + h_n.pow(2).sum((0, 2))

    return losses, {k: v.detach() for k, v in params.items()}, torch.randn(B, T, 3,
                                                                            dtype=torch.float64)


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Records each fused run of a layer: ``(kind, reverse)``."""
    calls: list[tuple[str, bool]] = []

    def counted(kind: str, run: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append((kind, kwargs["reverse"]))
            return run(*args, **kwargs)

        return call

    monkeypatch.setattr(recurrent, "lstm_sequence", counted("lstm", sequences.lstm_sequence))
    monkeypatch.setattr(recurrent, "gru_sequence", counted("gru", sequences.gru_sequence))
    return calls


OPTIONS = {"one_layer": {}, "bidirectional_2_layers": {"bidirectional": True, "num_layers": 2},
           "no_bias": {"bias": False}}


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("kind", list(NODES))
@pytest.mark.parametrize("backend", ["auto", "structured"])
def test_per_sample_gramian_runs_the_fused_layers(fused_calls: list[tuple[str, bool]],
                                                  backend: str, kind: str,
                                                  options: str) -> None:
    losses, params, x = _rnn_losses(kind, **OPTIONS[options])
    G = tg.gramian(losses, backend=backend, batch_dim=0)(params, x)
    expected = dense_gramian(losses, (params, x)).gramian
    torch.testing.assert_close(G / expected.abs().max(), expected / expected.abs().max(),
                               rtol=1e-10, atol=1e-10)
    layers = 4 if options == "bidirectional_2_layers" else 1  # layers × directions
    assert len(fused_calls) >= layers and {k for k, _ in fused_calls} == {kind}
    assert any(reverse for _, reverse in fused_calls) == (layers == 4)


@pytest.mark.parametrize("kind", list(NODES))
def test_create_graph_and_recording_keep_the_steps(fused_calls: list[tuple[str, bool]],
                                                   kind: str) -> None:
    """Where the Gramian must be differentiable, or the graph is the user's, no fused node."""
    losses, params, x = _rnn_losses(kind)
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    G = tg.gramian(losses, backend="structured", batch_dim=0)(leaves, x)
    expected = dense_gramian_fn(losses)(leaves, x)
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-10)
    (actual_grad,) = torch.autograd.grad(G.pow(2).sum(), [leaves["weight_hh_l0"]])
    (expected_grad,) = torch.autograd.grad(expected.pow(2).sum(), [leaves["weight_hh_l0"]])
    torch.testing.assert_close(actual_grad, expected_grad, rtol=1e-9, atol=1e-9)
    assert fused_calls == []
    module = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[kind](3, H, batch_first=True).double()
    with tg.autograd.record():
        out, _ = module(x)
        rows = out[:, -1].sum(-1)
    G_eager = tg.autograd.gramian(rows, list(module.parameters()), batch_dim=0)
    assert fused_calls == []
    fn, params = tg.functionalize(module)
    expected = dense_gramian(lambda p, x: fn(p, x)[0][:, -1].sum(-1), (params, x)).gramian
    torch.testing.assert_close(G_eager, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", list(NODES))
def test_fused_nodes_leave_autos_choice_as_the_steps_do(monkeypatch: pytest.MonkeyPatch,
                                                        kind: str) -> None:
    """The nodes are torchgram's, not old-style Functions of ``f`` (session 36's review).

    Counted as ``f``'s, they moved ``jacobian`` and ``ntvp`` behind the graph walk for every
    LSTM (and made ``auto`` raise torch's error under forward-mode dual inputs).
    """
    node, _ = NODES[kind]
    out = node.apply(*_inputs(kind, 1), 1, False)[0]
    assert type(out.grad_fn).__name__.endswith("Backward")  # the node is in the graph
    assert _torch_compat.old_style_functions(out.sum()) == []
    torch.manual_seed(0)
    module = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[kind](8, 16, batch_first=True).double()
    fn, params = tg.functionalize(module)

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return fn(p, x)[0][:, -1]

    x = torch.randn(16, 8, 8, dtype=torch.float64)
    fused = tg.explain(f)(params, x).backend
    monkeypatch.setattr(TapMode, "fuses_recurrences", property(lambda self: False))
    assert tg.explain(f)(params, x).backend == fused
