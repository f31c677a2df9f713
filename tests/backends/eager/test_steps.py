"""Fused recurrent layers in a recorded eager forward: one tap per weight for all the steps.

Each model runs ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` (float64) under ``tg.autograd.record()``;
its Gramian with ``batch_dim=0`` is compared with the dense oracle (``reference.dense_gramian``:
one plain backward per row of the same function, so a random draw is the one it sees), and
the recording must show the step taps of NOTE [eager step taps]: the recurrent weight is one
use of all the steps, read from the input projection's tap or from a tap of the steps'
outputs, and every parameter's block comes from the recorded factors (no walk).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import torchgram as tg
from reference import dense_gramian
from torchgram.backends.eager.record import Recording
from torchgram.backends.eager.steps import StepSlots, gather_steps, slot_edges

DOUBLE = torch.float64
B, T, F_IN, H, CLASSES = 3, 5, 4, 6, 3


def assert_close(actual: Tensor, expected: Tensor, tol: float = 1e-10) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = expected.abs().max().clamp_min(1e-30)
    error = float((actual.detach() - expected).abs().max() / scale)
    assert error <= tol, error


class Classifier(nn.Module):
    """``rnn`` → a head on the last output step and the final hidden states (both read)."""

    def __init__(self, rnn: nn.RNNBase) -> None:
        super().__init__()
        self.rnn = rnn
        directions = 2 if rnn.bidirectional else 1
        width = rnn.proj_size or rnn.hidden_size
        self.head = nn.Linear(width * directions, CLASSES)

    def forward(self, x: Tensor, state: Any = None) -> Tensor:
        out, final = self.rnn(x, state)
        h_n = final[0] if isinstance(final, tuple) else final
        last = out[:, -1] if self.rnn.batch_first else out[-1]
        return self.head(last).pow(2).sum(-1) + h_n.pow(2).sum((0, 2))


def build(kind: str, **options: Any) -> tuple[Classifier, Tensor]:
    torch.manual_seed(0)
    rnn = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind](F_IN, H, **options)
    model = Classifier(rnn).to(DOUBLE)
    shape = (B, T, F_IN) if options.get("batch_first") else (T, B, F_IN)
    return model, torch.randn(shape, dtype=DOUBLE)


def oracle(model: nn.Module, losses: Callable[[Callable[..., Tensor]], Tensor],
           seed: int | None = None) -> Tensor:
    fn, params = tg.functionalize(model)

    def f(p: dict[str, Tensor]) -> Tensor:
        if seed is not None:
            torch.manual_seed(seed)
        return losses(lambda *a: fn(p, *a))

    return dense_gramian(f, (params,)).shaped()


def recorded(model: nn.Module, losses: Callable[[Callable[..., Tensor]], Tensor],
             seed: int | None = None) -> tuple[Tensor, Recording, tg.autograd.EagerExplanation]:
    if seed is not None:
        torch.manual_seed(seed)
    with tg.autograd.record() as recording:
        rows = losses(model)
    explanation = tg.autograd.explain(rows, list(model.named_parameters()), batch_dim=0)
    return explanation.gramian, recording, explanation


def walked(explanation: tg.autograd.EagerExplanation) -> list[str]:
    return [row.name for row in explanation.inputs if row.way == "walk"]


CONFIGS = {
    "lstm": ("lstm", {}),
    "lstm_batch_first": ("lstm", {"batch_first": True}),
    "lstm_2_layers_bidirectional": ("lstm", {"num_layers": 2, "bidirectional": True}),
    "lstm_batch_first_bidirectional_no_bias": ("lstm", {"batch_first": True, "bias": False,
                                                         "bidirectional": True}),
    "lstm_2_layers_dropout_eval": ("lstm", {"num_layers": 2, "dropout": 0.5,
                                            "batch_first": True}),
    "lstm_proj": ("lstm", {"proj_size": 2, "batch_first": True}),
    "gru": ("gru", {}),
    "gru_batch_first": ("gru", {"batch_first": True}),
    "gru_2_layers_bidirectional": ("gru", {"num_layers": 2, "bidirectional": True,
                                           "batch_first": True}),
    "gru_2_layers_dropout_eval": ("gru", {"num_layers": 2, "dropout": 0.5}),
    "rnn_relu_bidirectional": ("rnn", {"nonlinearity": "relu", "bidirectional": True}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_recurrent_is_one_tap_per_weight_and_matches_oracle(name: str) -> None:
    kind, options = CONFIGS[name]
    model, x = build(kind, **options)
    model.eval()
    G, recording, explanation = recorded(model, lambda m: m(x))
    assert_close(G, oracle(model, lambda m: m(x)))
    assert walked(explanation) == []
    rnn = model.rnn
    for name_, param in rnn.named_parameters():
        leaf = recording.leaf_index(param)
        uses = [use for use in recording.uses if use.leaf == leaf]
        if "_hh_" in name_:  # one use of all the steps (not one per step)
            assert len(uses) == 1, (name_, len(uses))
            tap = recording.taps[uses[0].tap]
            steps_dim = 1 if options.get("batch_first") else 0
            assert tap.shape[steps_dim] == T
            # a GRU's recurrent projection is not added to the input projection: its own
            # tap of the steps' outputs; the others join the input projection's tap
            assert (tap.steps is not None) == (kind == "gru")


@pytest.mark.parametrize("expanded", [False, True], ids=["leaf", "expanded"])
def test_learned_initial_state_matches_oracle(expanded: bool) -> None:
    model, x = build("gru", batch_first=True, num_layers=2)
    model.register_parameter("h0", nn.Parameter(torch.randn(2, 1 if expanded else B, H,
                                                            dtype=DOUBLE)))

    def losses(m: Callable[..., Tensor], h0: Tensor) -> Tensor:
        return m(x, h0.expand(2, B, H) if expanded else h0)

    G, _, explanation = recorded(model, lambda m: losses(m, model.h0))
    fn, params = tg.functionalize(model)
    expected = dense_gramian(lambda p: losses(lambda *a: fn(p, *a), p["h0"]),
                             (params,)).shaped()
    assert_close(G, expected)
    # selected per layer inside the rewrite, a leaf state is walked; expanded, it is read
    # where it is expanded (NOTE [eager shared taps]); the weights are recorded either way
    assert walked(explanation) == ([] if expanded else ["h0"])


def test_lstm_without_input_projection_tap_and_rnn_applied_twice() -> None:
    model, x = build("lstm", batch_first=True)
    model.rnn.weight_ih_l0.requires_grad_(False)
    model.rnn.bias_ih_l0.requires_grad_(False)
    y = torch.randn(B, T, F_IN, dtype=DOUBLE)

    def losses(m: Callable[..., Tensor]) -> Tensor:  # the same weights over two sequences
        return m(x) * m(y)

    params = [p for p in model.parameters() if p.requires_grad]
    with tg.autograd.record() as recording:
        rows = losses(model)
    G = tg.autograd.gramian(rows, params, batch_dim=0)
    fn, all_params = tg.functionalize(model)
    frozen = {k: v for k, v in all_params.items() if "_ih_" in k}
    trainable = {k: v for k, v in all_params.items() if "_ih_" not in k}
    expected = dense_gramian(lambda p: losses(lambda *a: fn({**p, **frozen}, *a)),
                             (trainable,)).shaped()
    assert_close(G, expected)
    hh = recording.leaf_index(model.rnn.weight_hh_l0)
    taps = [recording.taps[use.tap] for use in recording.uses if use.leaf == hh]
    assert len(taps) == 2 and all(tap.steps is not None for tap in taps)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_dropout_in_training_mode_is_exact(kind: str) -> None:
    model, x = build(kind, num_layers=2, dropout=0.5, batch_first=True)
    model.train()
    G, _, _ = recorded(model, lambda m: m(x), seed=3)
    assert_close(G, oracle(model, lambda m: m(x), seed=3))


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_packed_sequences_are_exact(kind: str) -> None:
    model, x = build(kind, batch_first=True, num_layers=2, dropout=0.5)
    model.train()
    lengths = torch.tensor([T, 2, 3])

    def losses(m: nn.Module) -> Tensor:
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = m.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True)
        return m.head(out[torch.arange(B), lengths - 1]).pow(2).sum(-1)

    torch.manual_seed(4)
    with tg.autograd.record():
        rows = losses(model)
    G = tg.autograd.gramian(rows, list(model.parameters()), batch_dim=0, retain_graph=True)
    params = list(model.parameters())  # the oracle of the same graph: a backward per row
    jacobian = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        rows[i], params, retain_graph=True)]) for i in range(B)])
    assert_close(G, jacobian @ jacobian.T)


def snapshot(module: nn.Module) -> dict[str, Any]:
    """A module's attributes by identity (lists and dicts: of their items), and its hooks."""
    def ident(value: Any) -> Any:
        if isinstance(value, list | tuple):
            return tuple(id(item) for item in value)
        if isinstance(value, dict):
            return {key: id(item) for key, item in value.items()}
        return id(value)

    return {key: ident(value) for key, value in vars(module).items()} | {
        "hooks": (len(module._forward_hooks), len(module._backward_hooks),
                  len(module._forward_pre_hooks), len(module._backward_pre_hooks))}


def test_nothing_left_behind_and_backward_writes_the_weighted_gradient() -> None:
    model, x = build("gru", num_layers=2, bidirectional=True, batch_first=True)
    state = {name: snapshot(m) for name, m in model.named_modules()}
    params = list(model.parameters())
    with tg.autograd.record():
        rows = model(x)
    weights = torch.linspace(0.5, 1.5, B, dtype=DOUBLE)
    tg.autograd.backward(rows, params, lambda G: weights)
    for name, m in model.named_modules():
        assert snapshot(m) == state[name]
    fn, named = tg.functionalize(model)
    expected = torch.func.grad(lambda p: (fn(p, x) * weights).sum())(named)
    for name, param in model.named_parameters():
        assert param.grad is not None
        assert_close(param.grad, expected[name])
        assert param._backward_hooks is None and param.requires_grad


class FirstStep(Classifier):
    """The head on the first output step only: the later steps reach no output."""

    def forward(self, x: Tensor, state: Any = None) -> Tensor:
        return self.head(self.rnn(x, state)[0][:, 0]).pow(2).sum(-1)


def test_steps_whose_outputs_are_not_read_match_oracle() -> None:
    torch.manual_seed(0)
    model = FirstStep(nn.GRU(F_IN, H, batch_first=True)).to(DOUBLE)
    x = torch.randn(B, T, F_IN, dtype=DOUBLE)
    G, _, explanation = recorded(model, lambda m: m(x))
    assert_close(G, oracle(model, lambda m: m(x)))
    assert walked(explanation) == []  # the stacked outputs still reach them: zero cotangents


def test_gather_steps_stacks_each_step_tap_and_fills_missing_steps() -> None:
    a, b, c = (torch.full((2, 3, 4), float(v)) for v in (1, 2, 3))
    slots = [(None, 0), StepSlots(((None, 0),) * 3, dim=1), StepSlots(((None, 0),) * 2, 0)]
    single, steps, missing = gather_steps(slots, [a, b, None, c, None, None])
    assert single is a and missing is None
    assert steps is not None and steps.shape == (2, 3, 3, 4)  # [c, B, T, ...]: steps at 1
    assert torch.equal(steps[:, :, 0], b) and torch.equal(steps[:, :, 2], c)
    assert not steps[:, :, 1].any()
    assert len(slot_edges(slots)) == 6


def test_autocast_keeps_the_fused_call_and_is_exact() -> None:
    torch.manual_seed(0)  # on CPU a fused GRU under autocast stays float32; the rewrite's
    model = Classifier(nn.GRU(F_IN, H, batch_first=True))  # bfloat16 gates failed
    x = torch.randn(B, T, F_IN)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        plain = model(x)
        with tg.autograd.record():
            rows = model(x)
    assert torch.equal(rows, plain)  # the forward the user's code runs
    params = list(model.parameters())
    G = tg.autograd.gramian(rows, params, batch_dim=0, retain_graph=True)
    jacobian = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        rows[i], params, retain_graph=True)]) for i in range(B)])
    assert_close(G, jacobian @ jacobian.T, tol=1e-3)  # the head runs in bfloat16
