"""When the batched pass compares outputs with samples run apart.

NOTE [when the values are compared] in ``backends/structured/per_sample.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchgram as tg
from reference import dense_gramian

B, D = 5, 4


def _params():
    torch.manual_seed(0)
    return {"w": torch.randn(D, D, dtype=torch.float64),
            "v": torch.randn(D, D, dtype=torch.float64),
            "w4": torch.randn(4 * D, D, dtype=torch.float64) / 2,
            "v4": torch.randn(4 * D, D, dtype=torch.float64) / 2,
            "w3": torch.randn(3 * D, D, dtype=torch.float64) / 2,
            "v3": torch.randn(3 * D, D, dtype=torch.float64) / 2}


def _inputs(seed):
    return torch.randn(B, 3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _mlp(p, x):
    return torch.tanh(F.linear(torch.tanh(F.linear(x, p["w"])), p["v"])).sum((1, 2))


def _einsum(p, x):  # torch.einsum is rewritten under the mode (NOTE [rewritten layouts])
    return torch.tanh(torch.einsum("btd,ed->bte", torch.tanh(F.linear(x, p["w"])),
                                   p["v"])).sum((1, 2))


def _attention(p, x):  # self-attention is rewritten under the mode (NOTE [attention rewrite])
    h = torch.tanh(F.linear(x, p["w"])).transpose(0, 1)  # [T, B, D]
    out, _ = F.multi_head_attention_forward(h, h, h, D, 2, p["w3"], None, None, None, False, 0.0,
                                            p["v"], None, need_weights=False)
    return torch.tanh(out).sum((0, 2))


def _lstm(p, x):  # torch.lstm is rewritten into its cells (NOTE [recurrent rewrite])
    zeros = x.new_zeros(1, x.shape[0], D)
    out, *_ = torch.lstm(x, (zeros, zeros),
                        [p["w4"], p["v4"]], False, 1, 0.0, False, False, True)
    return torch.tanh(F.linear(out, p["v"])).sum((1, 2))


def _gru(p, x):
    out, _ = torch.gru(x, x.new_zeros(1, x.shape[0], D), [p["w3"], p["v3"]], False, 1, 0.0, False,
                       False, True)
    return torch.tanh(F.linear(out, p["v"])).sum((1, 2))


def _detached_statistic(p, x):  # samples meet in values only, never in derivatives
    h = torch.tanh(F.linear(x, p["w"]))
    return (F.linear(h, p["v"]) * h.detach().mean(0)).sum((1, 2))


def _counting(f, sizes):
    def counted(p, x):
        sizes.append(x.shape[0])
        return f(p, x)
    return counted


def _assert_oracle(f, p, x, actual):
    expected = dense_gramian(f, (p, x)).gramian
    scale = expected.abs().max()
    torch.testing.assert_close(actual / scale, expected / scale, rtol=1e-10, atol=1e-10)


def _calls_sizes(f, backend):
    """The batch sizes ``f`` was evaluated at: on the first call, then per later call.

    Every later call's Gramian is compared with the oracle.
    """
    sizes: list[int] = []
    gram = tg.gramian(_counting(f, sizes), backend=backend, batch_dim=0)
    p = _params()
    gram(p, _inputs(0))
    per_call = [list(sizes)]
    for seed in (1, 2):
        sizes.clear()
        x = _inputs(seed)
        _assert_oracle(f, p, x, gram(p, x))
        per_call.append(list(sizes))
    return per_call


@pytest.mark.parametrize("backend", ["structured", "auto"])
@pytest.mark.parametrize("f", [_mlp, _lstm, _gru, _attention, _einsum],
                         ids=["mlp", "lstm", "gru", "attention", "einsum"])
def test_later_calls_of_a_checked_trace_evaluate_f_once(f, backend):
    """Rewritten calls too: the trace settles them (``rules.SETTLED_PER_TRACE``)."""
    first, *later = _calls_sizes(f, backend)
    assert 2 in first  # the first call compares the first and the last sample's outputs
    for sizes in later:
        assert sizes == [B]  # the batched run only


@pytest.mark.parametrize("backend", ["structured", "auto"])
def test_calls_that_rewrite_a_call_not_settled_per_trace_compare_values_every_time(
        backend, monkeypatch):
    """A rewrite left out of ``SETTLED_PER_TRACE`` (the default for a new one)."""
    from torchgram.backends.structured import trace

    monkeypatch.setattr(trace, "SETTLED_PER_TRACE", trace.SETTLED_PER_TRACE - {torch.einsum})
    _, *later = _calls_sizes(_einsum, backend)
    for sizes in later:
        assert sizes.count(B) == 1 and 2 in sizes


@pytest.mark.parametrize("backend", ["structured", "auto"])
def test_samples_that_meet_in_values_only_give_the_oracle_on_every_call(backend):
    gram = tg.gramian(_detached_statistic, backend=backend, batch_dim=0)
    p = _params()
    for seed in (0, 1, 2):
        x = _inputs(seed)
        _assert_oracle(_detached_statistic, p, x, gram(p, x))


def _mlp_logits(p, x):
    return F.linear(torch.tanh(F.linear(x, p["w"])), p["v"])


def _dropout_logits(p, x):
    return F.linear(F.dropout(torch.tanh(F.linear(x, p["w"])), 0.3), p["v"])


@pytest.mark.parametrize("draws", [False, True], ids=["deterministic", "dropout"])
def test_kernels_check_later_calls_only_where_f_draws(monkeypatch, draws):
    from torchgram.backends.structured import cross

    checked: list[int] = []
    real = cross.check_leaks

    def counted(*args, **kwargs):
        checked.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cross, "check_leaks", counted)
    f = _dropout_logits if draws else _mlp_logits
    ntk_fn = tg.ntk.empirical_ntk_fn(f, trace_axes=(), backend="structured")
    p = _params()
    x = torch.randn(B, D, dtype=torch.float64)
    ntk_fn(x, None, p)
    assert checked  # the first call: the thorough check
    checked.clear()
    torch.manual_seed(3)
    kernel = ntk_fn(x, None, p)
    assert bool(checked) == draws
    if not draws:
        expected = dense_gramian(lambda q, z: f(q, z).reshape(-1), (p, x)).gramian
        torch.testing.assert_close(kernel.permute(0, 2, 1, 3).reshape(B * D, B * D), expected,
                                   rtol=1e-10, atol=1e-10)
