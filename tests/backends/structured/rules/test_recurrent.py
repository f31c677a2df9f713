"""Fused ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``: rewritten into cells, or kept fused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchgram as tg
from helpers import assert_batched_on_every_draw
from torchgram.backends.structured.rules.recurrent import (
    _dropout_reproducible,
    rewrite_gru,
    rewrite_lstm,
    rewrite_rnn_relu,
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


def test_packed_sequences_keep_the_fused_call():
    zeros = torch.zeros(1, B, H, dtype=torch.float64)
    flat = [torch.randn(4 * H, F_IN), torch.randn(4 * H, H)]
    x = torch.randn(T, B, F_IN, dtype=torch.float64)
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


DROPOUT_CONFIGS = {
    "lstm_2_layers": ("lstm", {"num_layers": 2}),
    "lstm_bidirectional_batch_first_3_layers": ("lstm", {"num_layers": 3, "bidirectional": True,
                                                         "batch_first": True}),
    "lstm_proj": ("lstm", {"num_layers": 2, "proj_size": 2, "batch_first": True}),
    "gru_bidirectional_2_layers": ("gru", {"num_layers": 2, "bidirectional": True}),
    "rnn_relu_batch_first": ("rnn", {"num_layers": 2, "nonlinearity": "relu",
                                     "batch_first": True}),
}


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", list(DROPOUT_CONFIGS))
def test_rewrite_draws_the_fused_kernels_inter_layer_dropout(name, dtype):
    """NOTE [inter-layer dropout]: the same outputs and the same random state after, as the
    fused call from the same state (float32 LSTMs run oneDNN's kernel)."""
    kind, options = DROPOUT_CONFIGS[name]
    torch.manual_seed(0)
    rnn = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind](F_IN, H, dropout=0.4,
                                                              **options).to(dtype).train()
    x = torch.randn(B, T, F_IN, dtype=dtype)
    if not options.get("batch_first", False):
        x = x.transpose(0, 1).contiguous()
    torch.manual_seed(7)
    expected, after = rnn(x)[0], torch.rand(4)
    directions = 2 if options.get("bidirectional", False) else 1
    layers = options["num_layers"]
    hidden = torch.zeros(layers * directions, B, options.get("proj_size", 0) or H, dtype=dtype)
    args = (x, hidden, rnn._flat_weights, True, layers, 0.4, True, directions == 2,
            options.get("batch_first", False))
    if kind == "lstm":
        cell = torch.zeros(layers * directions, B, H, dtype=dtype)
        args = (x, (hidden, cell), *args[2:])
    rewrite = {"lstm": rewrite_lstm, "gru": rewrite_gru,
               "rnn": lambda *a: rewrite_rnn_relu(*a)}[kind]
    torch.manual_seed(7)
    out = rewrite(args, {})
    assert out is not NotImplemented
    torch.testing.assert_close(out[0], expected, rtol=1e-5 if dtype == torch.float32 else 1e-12,
                               atol=1e-6 if dtype == torch.float32 else 1e-14)
    assert torch.equal(torch.rand(4), after)  # later draws are the plain call's


@pytest.mark.parametrize("backend", ["structured", "auto"])
@pytest.mark.parametrize("name", list(DROPOUT_CONFIGS))
def test_recurrent_with_inter_layer_dropout_is_batched_and_matches_oracle(name, backend):
    """Stacked recurrent layers with dropout in training mode, a dropout after them too: the
    batched pass without fallback, every call the Gramian of its plain call's draw (the rows
    of the whole batch, ~5x slower, before session 47)."""
    kind, options = DROPOUT_CONFIGS[name]
    torch.manual_seed(0)
    rnn = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind](F_IN, H, dropout=0.4,
                                                              **options).double().train()
    fn, params = tg.functionalize(rnn)
    batch_first = options.get("batch_first", False)

    def f(p, x):
        out = torch.nn.functional.dropout(fn(p, x)[0], 0.3)
        return torch.tanh(out[:, -1] if batch_first else out[-1]).sum(-1)

    shape = (B, T, F_IN) if batch_first else (T, B, F_IN)
    assert_batched_on_every_draw(f, params, [torch.randn(shape, dtype=torch.float64)
                                             for _ in range(3)],
                                 backend=backend, in_dims=0 if batch_first else 1)


def test_dropout_on_an_accelerator_keeps_the_fused_call():
    """cuDNN and MIOpen draw their masks with dropout states of their own (NOTE [inter-layer
    dropout]): only CPU kernels are rewritten with dropout in training mode."""
    on_cpu, elsewhere = torch.zeros(T, B, F_IN), torch.zeros(T, B, F_IN, device="meta")
    assert _dropout_reproducible(on_cpu, 0.5, True)
    assert not _dropout_reproducible(elsewhere, 0.5, True)
    assert _dropout_reproducible(elsewhere, 0.5, False)  # eval mode: no draw
    assert _dropout_reproducible(elsewhere, 0.0, True)
    assert not _dropout_reproducible(on_cpu, 1.0, True)  # everything dropped: kept fused


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
