"""``nn.MultiheadAttention``: the self-attention rewrite, and the fallback for the rest."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchgram as tg
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
    assert rewrite_multi_head_attention(dropout, {}) is NotImplemented
    assert rewrite_multi_head_attention(dropout, {"training": False}) is not NotImplemented
    assert rewrite_multi_head_attention(base, {"is_causal": True}) is NotImplemented
    assert rewrite_multi_head_attention(base[:1] + (x.clone(),) + base[2:], {}) \
        is NotImplemented
    assert rewrite_multi_head_attention(base[:5], {}) is NotImplemented  # cannot bind
