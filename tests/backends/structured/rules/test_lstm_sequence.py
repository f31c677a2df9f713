"""An LSTM layer's steps as one autograd node (NOTE [fused LSTM recurrence])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import torchgram as tg
from reference import dense_gramian, dense_gramian_fn
from torchgram.backends.structured.rules import recurrent
from torchgram.backends.structured.rules.lstm_sequence import LSTMSequence, lstm_sequence

B, T, H = 3, 5, 4


def _step_by_step(gates_in: Tensor, h0: Tensor, c0: Tensor, weight_t: Tensor, bias: Tensor,
                  dim: int, reverse: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The LSTM equations one step at a time, recorded by autograd (the reference)."""
    h, c = h0, c0
    outputs: dict[int, Tensor] = {}
    order = range(T - 1, -1, -1) if reverse else range(T)
    for t in order:
        gates = gates_in.select(dim, t) + h @ weight_t + bias
        i, f, g, o = gates.chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outputs[t] = h
    return torch.stack([outputs[t] for t in range(T)], dim), h, c


def _inputs(dim: int) -> tuple[Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    shape = (T, B, 4 * H) if dim == 0 else (B, T, 4 * H)
    gates_in = torch.randn(shape, dtype=torch.float64, generator=generator)
    h0, c0 = (torch.randn(B, H, dtype=torch.float64, generator=generator) for _ in range(2))
    weight_t = 0.5 * torch.randn(H, 4 * H, dtype=torch.float64, generator=generator)
    bias = torch.randn(4 * H, dtype=torch.float64, generator=generator)
    return tuple(t.requires_grad_() for t in (gates_in, h0, c0, weight_t, bias))


LAYOUTS = {"time_major": 0, "batch_first": 1}


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sequence_matches_the_steps_and_their_derivatives(layout: str, reverse: bool) -> None:
    dim = LAYOUTS[layout]
    inputs = _inputs(dim)
    fused = LSTMSequence.apply(*inputs, dim, reverse)
    steps = _step_by_step(*inputs, dim, reverse)
    for actual, expected in zip(fused, steps, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-13, atol=1e-13)
    cotangents = [torch.randn_like(t) for t in steps]
    actual_grads = torch.autograd.grad(fused, inputs, cotangents)
    expected_grads = torch.autograd.grad(steps, inputs, cotangents)
    for actual, expected in zip(actual_grads, expected_grads, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_batched_directions_and_nan_stay_in_their_sample(reverse: bool) -> None:
    """The derivative checks run the backward under ``is_grads_batched``, NaN directions too."""
    inputs = _inputs(1)
    fused = LSTMSequence.apply(*inputs, 1, reverse)
    steps = _step_by_step(*inputs, 1, reverse)
    directions = [torch.randn(3, *t.shape, dtype=t.dtype) for t in steps]
    directions[0][2, 0] = float("nan")  # the third direction: NaN on sample 0's outputs only
    actual = torch.autograd.grad(fused, inputs[:3], directions, is_grads_batched=True)
    expected = torch.autograd.grad(steps, inputs[:3], directions, is_grads_batched=True)
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got[:2], want[:2], rtol=1e-12, atol=1e-12)
    gates_grad = actual[0][2]
    assert gates_grad[0].isnan().any() and not gates_grad[1:].isnan().any()


def test_second_derivatives_are_refused_not_wrong() -> None:
    """Differentiable once: a second derivative raises instead of giving a wrong number."""
    inputs = _inputs(1)
    out, _, _ = LSTMSequence.apply(*inputs, 1, False)
    (grad,) = torch.autograd.grad(out.pow(2).sum(), inputs[0], create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad.sum().backward()
    with pytest.raises(RuntimeError):
        torch.autograd.grad(grad.sum(), inputs[3])


def test_inputs_are_the_steps_inputs_in_step_order() -> None:
    gates_in, h0, c0, weight_t, bias = (t.detach() for t in _inputs(1))
    for reverse in (False, True):
        out, _, _, inputs = lstm_sequence(gates_in, h0, c0, weight_t, bias, dim=1,
                                          reverse=reverse)
        first = T - 1 if reverse else 0
        torch.testing.assert_close(inputs[:, first], h0)
        for t in range(T):
            if t != first:
                torch.testing.assert_close(inputs[:, t], out[:, t + 1 if reverse else t - 1])


def _lstm_losses(**options: Any) -> tuple[Callable[..., Tensor], dict[str, Tensor], Tensor]:
    torch.manual_seed(0)
    module = torch.nn.LSTM(3, H, batch_first=True, **options).double()
    fn, params = tg.functionalize(module)

    def losses(p: dict[str, Tensor], x: Tensor) -> Tensor:
        out, (h_n, _) = fn(p, x)
        return torch.tanh(out[:, -1]).sum(-1) + h_n.pow(2).sum((0, 2))

    return losses, {k: v.detach() for k, v in params.items()}, torch.randn(B, T, 3,
                                                                            dtype=torch.float64)


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Records each fused run of an LSTM layer (``recurrent.lstm_sequence``)."""
    calls: list[bool] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["reverse"])
        return lstm_sequence(*args, **kwargs)

    monkeypatch.setattr(recurrent, "lstm_sequence", counted)
    return calls


@pytest.mark.parametrize("options", [{}, {"bidirectional": True, "num_layers": 2}],
                         ids=["one_layer", "bidirectional_2_layers"])
@pytest.mark.parametrize("backend", ["auto", "structured"])
def test_per_sample_gramian_runs_the_fused_layers(fused_calls: list[bool], backend: str,
                                                  options: dict[str, Any]) -> None:
    losses, params, x = _lstm_losses(**options)
    G = tg.gramian(losses, backend=backend, batch_dim=0)(params, x)
    expected = dense_gramian(losses, (params, x)).gramian
    torch.testing.assert_close(G / expected.abs().max(), expected / expected.abs().max(),
                               rtol=1e-10, atol=1e-10)
    layers = 4 if options else 1  # layers × directions
    assert len(fused_calls) >= layers  # the trace's run and the batched one
    assert (True in fused_calls) == bool(options)  # the second direction runs reversed


def test_create_graph_and_recording_keep_the_steps(fused_calls: list[bool]) -> None:
    """Where the Gramian must be differentiable, or the graph is the user's, no fused node.

    (The trace of a create-graph call may fuse: its rows only plan the pass.)
    """
    losses, params, x = _lstm_losses()
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    G = tg.gramian(losses, backend="structured", batch_dim=0)(leaves, x)
    expected = dense_gramian_fn(losses)(leaves, x)
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-10)
    (actual_grad,) = torch.autograd.grad(G.pow(2).sum(), [leaves["weight_hh_l0"]])
    (expected_grad,) = torch.autograd.grad(expected.pow(2).sum(), [leaves["weight_hh_l0"]])
    torch.testing.assert_close(actual_grad, expected_grad, rtol=1e-9, atol=1e-9)
    fused_calls.clear()
    module = torch.nn.LSTM(3, H, batch_first=True).double()
    with tg.autograd.record():
        out, _ = module(x)
        rows = out[:, -1].sum(-1)
    G_eager = tg.autograd.gramian(rows, list(module.parameters()), batch_dim=0)
    assert fused_calls == []
    fn, params = tg.functionalize(module)
    expected = dense_gramian(lambda p, x: fn(p, x)[0][:, -1].sum(-1), (params, x)).gramian
    torch.testing.assert_close(G_eager, expected, rtol=1e-10, atol=1e-10)
