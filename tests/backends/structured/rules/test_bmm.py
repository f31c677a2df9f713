"""``torch.bmm`` / ``torch.baddbmm`` with a weight per group, against the dense oracle."""

from __future__ import annotations

import pytest
import torch

import torchgram as tg

B, T, G, Q, P = 3, 2, 4, 5, 2


def _randn(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def _heads(p, x):  # x [B, G, q]: the samples split in dim 1 of [G, B, q]
    return torch.tanh(torch.bmm(x.transpose(0, 1), p["w"])).sum((0, 2))


def _tokens_merged(p, x):  # x [B, T, G, q]: the samples merged in dim 1 of [G, B·T, q]
    y = torch.bmm(x.permute(2, 0, 1, 3).reshape(G, -1, Q), p["w"])
    return torch.tanh(y.reshape(G, x.shape[0], T, P)).sum((0, 2, 3))


def _baddbmm(p, x):
    y = torch.baddbmm(p["b"], x.transpose(0, 1), p["w"], beta=0.5)
    return torch.tanh(y).sum((0, 2))


def _method(p, x):
    return torch.tanh(x.transpose(0, 1).bmm(p["w"])).sum((0, 2))


def _weight_on_left(p, x):  # not recognised: the fallback, still exact
    return torch.tanh(torch.bmm(p["w"].transpose(1, 2), x.permute(1, 2, 0))).sum((0, 1))


CASES = {  # name: (f, parameter shapes, input shape, fallback leaves)
    "heads": (_heads, {"w": (G, Q, P)}, (B, G, Q), ()),
    "tokens_merged": (_tokens_merged, {"w": (G, Q, P)}, (B, T, G, Q), ()),
    "baddbmm_bias": (_baddbmm, {"w": (G, Q, P), "b": (G, 1, P)}, (B, G, Q), ()),
    "method": (_method, {"w": (G, Q, P)}, (B, G, Q), ()),
    "weight_on_left": (_weight_on_left, {"w": (G, Q, P)}, (B, G, Q), ("w",)),
}


@pytest.mark.parametrize("way", ["ghost", "materialize", None])
@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch", "dense"])
@pytest.mark.parametrize("name", list(CASES))
def test_bmm_against_oracle(name, batch_dim, way, check):
    f, shapes, x_shape, fallback = CASES[name]
    torch.manual_seed(0)
    params = {key: _randn(*shape) for key, shape in shapes.items()}
    args = (params, _randn(*x_shape))
    check(f, args, force=way, batch_dim=batch_dim)
    check(f, args, force=way, batch_dim=batch_dim, diagonal=True)
    assert tg.explain(f, backend="structured", batch_dim=batch_dim)(*args).fallback == fallback


def test_samples_merged_in_the_positions_run_batched():
    f, shapes, x_shape, _ = CASES["tokens_merged"]
    args = ({"w": _randn(*shapes["w"])}, _randn(*x_shape))
    report = tg.explain(f, backend="structured", batch_dim=0, run=True)(*args)
    assert report.ran is not None and report.ran.way == "batched"
    assert report.leaves[0].rules == ("bmm",)
