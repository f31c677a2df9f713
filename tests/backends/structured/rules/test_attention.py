"""``nn.MultiheadAttention``: the self-attention rewrite, and the fallback for the rest."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchgram as tg
from helpers import assert_batched_on_every_draw
from reference import dense_gramian
from torchgram.backends.structured.rules.attention import rewrite_multi_head_attention

B, T, E = 3, 4, 6


def _attention(batch_first, bias, call):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, 2, bias=bias, batch_first=batch_first).double()
    fn, params = tg.functionalize(mha)

    def f(p, x):
        out = call(lambda *a, **k: fn(p, *a, **k), x)
        return torch.tanh(out).sum((1, 2)) if out.dim() == 3 else torch.tanh(out).sum()[None]

    return f, params


def _self(attn, x):
    return attn(x, x, x, need_weights=False)[0]


def _with_weights(attn, x):
    out, weights = attn(x, x, x)  # need_weights=True by default
    return out * weights.sum()


def _per_head_weights(attn, x):
    out, weights = attn(x, x, x, average_attn_weights=False)
    return out + weights.mean()


def _cross(attn, x):
    return attn(x, x.flip(-1), x.flip(-1), need_weights=False)[0]


def _padding_mask(attn, x):
    mask = torch.zeros(x.shape[0], x.shape[1], dtype=torch.bool)
    mask[:, -1] = True
    return attn(x, x, x, key_padding_mask=mask, need_weights=False)[0]


CALLS = {"self": _self, "with_weights": _with_weights, "per_head_weights": _per_head_weights,
         "cross": _cross, "padding_mask": _padding_mask}
REWRITTEN = {"self", "with_weights", "per_head_weights"}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "batch"])
def test_multihead_attention_matches_oracle(check, ways, call, bias, batch_dim):
    f, params = _attention(batch_first=True, bias=bias, call=CALLS[call])
    x = torch.randn(B, T, E, dtype=torch.float64)
    check(f, (params, x), force=None, batch_dim=batch_dim)
    in_proj = sorted(params).index("in_proj_weight")
    expected = "fallback" if call not in REWRITTEN else "materialize"
    assert ways(f, (params, x), batch_dim=batch_dim)[in_proj] == expected


def test_sequence_first_and_unbatched_inputs(check):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, 2).double()  # [T, B, E] inside and out
    fn, params = tg.functionalize(mha)

    def f(p, x):
        return torch.tanh(fn(p, x, x, x, need_weights=False)[0]).sum((0, 2))  # [B]

    x = torch.randn(T, B, E, dtype=torch.float64)
    check(f, (params, x), force=None, batch_dim=None)
    check(f, (params, x), force=None, batch_dim=0, in_dims=1)

    def unbatched(p, x):  # x: [T, E]
        return torch.tanh(fn(p, x, x, x, need_weights=False)[0]).sum(-1)  # [T]

    check(unbatched, (params, torch.randn(T, E, dtype=torch.float64)), force=None,
          batch_dim=None)


def test_rewrite_declines_what_it_does_not_cover():
    mha = nn.MultiheadAttention(E, 2)
    x = torch.randn(T, B, E)
    base = (x, x, x, E, 2, mha.in_proj_weight, mha.in_proj_bias, None, None, False, 0.0,
            mha.out_proj.weight, mha.out_proj.bias)
    assert rewrite_multi_head_attention(base, {"need_weights": False}) is not NotImplemented
    dropout = base[:10] + (0.1,) + base[11:]
    assert rewrite_multi_head_attention(dropout, {}) is not NotImplemented  # torch's own steps
    assert rewrite_multi_head_attention(dropout, {"training": False}) is not NotImplemented
    assert rewrite_multi_head_attention(base, {"is_causal": True}) is NotImplemented
    assert rewrite_multi_head_attention(base[:1] + (x.clone(),) + base[2:], {}) \
        is NotImplemented
    assert rewrite_multi_head_attention(base[:5], {}) is NotImplemented  # cannot bind



@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize(("need_weights", "average"), [(False, False), (True, False),
                                                       (True, True)],
                         ids=["sdpa", "weights", "mean-weights"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_rewrite_with_dropout_draws_what_the_call_draws(dtype, need_weights, average, batched):
    """NOTE [attention dropout]: from the same random state, the rewrite's outputs, weights and
    strides are the call's, and the state after it too (later draws are the plain call's)."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, 2, dropout=0.3).to(dtype)
    x = torch.randn((T, B, E) if batched else (T, E), dtype=dtype)
    args = (x, x, x, E, 2, mha.in_proj_weight, mha.in_proj_bias, None, None, False, 0.3,
            mha.out_proj.weight, mha.out_proj.bias)
    options = {"training": True, "need_weights": need_weights, "average_attn_weights": average}
    torch.manual_seed(7)
    expected, expected_weights = torch.nn.functional.multi_head_attention_forward(*args,
                                                                                  **options)
    after = torch.rand(4)
    torch.manual_seed(7)
    out, weights = rewrite_multi_head_attention(args, options)
    assert torch.equal(torch.rand(4), after)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12,
                                                                             "atol": 1e-14}
    torch.testing.assert_close(out, expected, **tolerance)
    assert out.stride() == expected.stride()
    if need_weights:
        torch.testing.assert_close(weights, expected_weights, **tolerance)
        assert weights.stride() == expected_weights.stride()


def _encoder_with_dropout(batch_first: bool, norm_first: bool):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, 2, dim_feedforward=8, dropout=0.2,
                                       batch_first=batch_first, norm_first=norm_first)
    fn, params = tg.functionalize(layer.double().train())

    def f(p, x):
        h = torch.nn.functional.dropout(fn(p, x), 0.1)
        return torch.tanh(h).sum((1, 2) if batch_first else (0, 2))

    return f, params


@pytest.mark.parametrize("backend", ["structured", "auto"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "sequence-first"])
def test_encoder_layer_with_dropout_is_batched_and_matches_oracle(backend, batch_first,
                                                                  norm_first):
    """``nn.TransformerEncoderLayer`` in training mode with its default kind of dropout (on the
    attention weights and after each block) and one more after it: every call the Gramian
    of its plain call's draw, on the batched pass without fallback (before session 47, the
    rows of the whole batch: ~34x the backward on the benchmark transformer)."""
    f, params = _encoder_with_dropout(batch_first, norm_first)
    shape = (B, T, E) if batch_first else (T, B, E)
    assert_batched_on_every_draw(f, params, [torch.randn(shape, dtype=torch.float64)
                                             for _ in range(3)],
                                 backend=backend, in_dims=0 if batch_first else 1)


def test_an_original_run_beside_a_rewrite_leaves_the_draws_alone(monkeypatch):
    """NOTE [rewritten layouts]: where a rewrite's layout is not known to be the call's, the
    call runs again beside it for its layout; if that call draws, the generators are put back
    after it, so later draws stay the plain call's (here the attention rewrite with dropout is
    made to ask for that run)."""
    from torchgram.backends.structured import trace

    monkeypatch.setattr(trace, "rewrite_keeps_layout", lambda *args: False)
    f, params = _encoder_with_dropout(True, False)
    x = torch.randn(B, T, E, dtype=torch.float64)
    torch.manual_seed(3)
    expected = dense_gramian(f, (params, x)).gramian
    torch.manual_seed(3)
    actual = tg.gramian(f, backend="structured", batch_dim=0)(params, x)
    scale = expected.abs().max()
    torch.testing.assert_close(actual / scale, expected / scale, rtol=1e-10, atol=1e-10)
