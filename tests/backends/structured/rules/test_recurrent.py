"""Fused ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``: rewritten into cells, or kept fused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchgram as tg
from torchgram.backends.structured.rules.recurrent import (
    rewrite_gru,
    rewrite_lstm,
    rewrite_rnn_tanh,
)

WAYS = ["ghost", "materialize", None]

B, T, F_IN, H = 3, 4, 3, 5


def _model(kind, **options):
    torch.manual_seed(0)
    rnn = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind](F_IN, H, **options).double()
    fn, params = tg.functionalize(rnn)
    batch_first = options.get("batch_first", False)

    def f(p, x):
        out, state = fn(p, x)
        h_n = state[0] if isinstance(state, tuple) else state
        last = out[:, -1] if batch_first else out[-1]
        return torch.tanh(last).sum(-1) + h_n.pow(2).sum((0, 2))

    x = torch.randn((B, T, F_IN) if batch_first else (T, B, F_IN), dtype=torch.float64)
    in_dims = 0 if batch_first else 1
    return f, params, x, in_dims


CONFIGS = {
    "lstm": ("lstm", {}),
    "lstm_batch_first_2_layers": ("lstm", {"batch_first": True, "num_layers": 2}),
    "lstm_bidirectional_no_bias": ("lstm", {"bidirectional": True, "bias": False}),
    "lstm_proj": ("lstm", {"proj_size": 2, "batch_first": True}),
    "gru_bidirectional_2_layers": ("gru", {"bidirectional": True, "num_layers": 2,
                                           "batch_first": True}),
    "rnn_tanh": ("rnn", {}),
    "rnn_relu_bidirectional": ("rnn", {"nonlinearity": "relu", "bidirectional": True}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("way", ["ghost", "materialize", None], ids=["ghost", "mat", "auto"])
@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "batch"])
def test_recurrent_matches_oracle(check, name, way, batch_dim):
    kind, options = CONFIGS[name]
    f, params, x, in_dims = _model(kind, **options)
    if batch_dim is None:
        check(f, (params, x), force=way, batch_dim=None)
    else:
        check(f, (params, x), force=way, batch_dim=0, in_dims=in_dims)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_recurrent_weights_are_structured_and_batched(name):
    kind, options = CONFIGS[name]
    f, params, x, in_dims = _model(kind, **options)
    report = tg.explain(f, backend="structured", batch_dim=0, in_dims=in_dims,
                        run=True)(params, x)
    assert report.fallback == ()
    assert report.ran is not None and report.ran.way == "batched"
    assert "fallback" not in report.ran.leaf_ways


def test_dropout_in_training_mode_and_packed_sequences_keep_the_fused_call(check):
    f, params, x, in_dims = _model("lstm", num_layers=2, dropout=0.5)
    assert tg.explain(f, backend="structured")(params, x).fallback  # train mode: dropout 0.5
    zeros = torch.zeros(1, B, H, dtype=torch.float64)
    flat = [torch.randn(4 * H, F_IN), torch.randn(4 * H, H)]
    assert rewrite_lstm((x, (zeros, zeros), flat, False, 1, 0.5, True, False, False), {}) \
        is NotImplemented
    assert rewrite_gru((x, torch.tensor([2, 1]), zeros, flat, False, 1, 0.0, False, False),
                       {}) is NotImplemented
    rnn = nn.GRU(F_IN, H).double()
    fn, params = tg.functionalize(rnn)
    lengths = torch.tensor([T] * B)

    def packed(p, x):
        sequence = nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
        return fn(p, sequence)[1].sum((0, 2))

    report = tg.explain(packed, backend="structured")(params, x)
    assert len(report.fallback) == len(params)


# NOTE [step taps]: the recurrent weight is tapped once for all steps, one use of T positions,
# in every way a run can take; a weight the mode does not tap is left to its carrier.

@pytest.mark.parametrize("name", ["lstm_bidirectional_no_bias", "lstm_proj",
                                  "gru_bidirectional_2_layers", "rnn_tanh"])
def test_recurrent_weight_is_one_use_of_all_steps(name):
    kind, options = CONFIGS[name]
    f, params, x, in_dims = _model(kind, **options)
    report = tg.explain(f, backend="structured", batch_dim=0, in_dims=in_dims)(params, x)
    for leaf in report.leaves:
        if "weight_hh" in leaf.name or "bias_hh" in leaf.name:
            assert leaf.rules == ("linear",), (leaf.name, leaf.rules)


def _with_extra_use(kind, options, which):
    """The recurrent model with ``which`` (a parameter name) also used in an unknown op."""
    f, params, x, in_dims = _model(kind, **options)

    def g(p, x):
        return f(p, x) + torch.sin(p[which]).sum()

    return g, params, x, in_dims


@pytest.mark.parametrize("which", ["weight_hh_l0", "weight_ih_l0", "bias_hh_l0"])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "batch"])
def test_recurrent_with_a_leaf_on_the_fallback_matches_oracle(check, kind, which, batch_dim):
    # a fallback leaf sends the per-sample pass one sample at a time (pre-made taps);
    # the recurrent weight on the fallback is tapped step by step, not through one tap
    g, params, x, in_dims = _with_extra_use(kind, {"bidirectional": True}, which)
    for way in WAYS:
        if batch_dim is None:
            check(g, (params, x), force=way, batch_dim=None)
        else:
            check(g, (params, x), force=way, batch_dim=0, in_dims=in_dims)


def test_recurrent_step_taps_with_loops_only(check):
    f, params, x, in_dims = _model("lstm", batch_first=True)

    def g(p, x):
        return f(p, x) + torch.sin(p["bias_ih_l0"]).sum()

    check(g, (params, x), force=None, batch_dim=0, in_dims=in_dims, chunk_size=1)


@pytest.mark.parametrize("kind", ["lstm", "rnn"])
def test_recurrent_without_an_input_projection_tap_matches_oracle(check, kind):
    # no tap on xs (W_ih on the fallback, no bias): W_hh gets a step tap of its own
    g, params, x, in_dims = _with_extra_use(kind, {"bias": False}, "weight_ih_l0")
    for way in WAYS:
        check(g, (params, x), force=way, batch_dim=0, in_dims=in_dims)
        check(g, (params, x), force=way, batch_dim=None)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["time_major", "batch_first"])
@pytest.mark.parametrize("sizes", [(1, 1, 1), (3, 1, 1), (1, 2, 1), (3, 2, 2)],
                         ids=lambda sizes: "B{}_T{}_H{}".format(*sizes))
def test_rewrite_gives_the_fused_kernels_strides(kind, batch_first, sizes):
    """Size-1 dims included: ops after it lay their outputs out by them (NOTE [recurrent
    rewrite], ``_core/layouts``)."""
    batch, steps, hidden = sizes
    torch.manual_seed(0)
    rnn = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind](
        2, hidden, bidirectional=True, batch_first=batch_first)
    x = torch.randn((batch, steps, 2) if batch_first else (steps, batch, 2))
    expected, _ = rnn(x)
    zeros = torch.zeros(2, batch, hidden)
    args = (x, zeros, rnn._flat_weights, True, 1, 0.0, False, True, batch_first)
    if kind == "lstm":
        out = rewrite_lstm((x, (zeros, zeros), *args[2:]), {})[0]
    else:
        out = (rewrite_gru if kind == "gru" else rewrite_rnn_tanh)(args, {})[0]
    torch.testing.assert_close(out, expected)
    assert out.stride() == expected.stride()
