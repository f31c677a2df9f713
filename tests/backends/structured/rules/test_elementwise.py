"""Parameters used elementwise with broadcasting (``*``, ``+``, ``-``, ``expand``) vs the oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchgram.backends.structured.rules.elementwise import AddRule, BroadcastLayout, MulRule
from torchgram.backends.structured.trace import TapMode

B, T, D = 4, 3, 5
WAYS = ["materialize", None]


def _randn(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def _rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


CASES = {
    # RMSNorm as LLaMA writes it: weight * normalised input
    "rms_weight": (lambda p, x: torch.tanh(p["w"] * _rms(x)).sum((1, 2)), {"w": (D,)}, (B, T, D)),
    # LayerScale: a learned per-channel gain on a residual branch
    "layer_scale": (lambda p, x: (x + p["g"] * torch.tanh(F.linear(x, p["W"]))).sin().sum((1, 2)),
                    {"g": (D,), "W": (D, D)}, (B, T, D)),
    "scale_as_view": (lambda p, x: (x * p["s"].view(1, -1, 1)).cos().sum((1, 2)),
                      {"s": (T,)}, (B, T, D)),
    "scale_indexed_none": (lambda p, x: (p["s"][None, :, None] * x).cos().sum((1, 2)),
                           {"s": (T,)}, (B, T, D)),
    "scale_unsqueezed": (lambda p, x: torch.mul(x, p["s"].unsqueeze(-1)).cos().sum((1, 2)),
                         {"s": (T,)}, (B, T, D)),
    "matrix_scale": (lambda p, x: (x * p["m"]).tanh().sum((1, 2)), {"m": (T, D)}, (B, T, D)),
    "two_parameters": (lambda p, x: (x * (p["a"] * p["b"])).sin().sum(-1),
                       {"a": (D,), "b": (D,)}, (B, D)),
    "same_parameter_twice": (lambda p, x: (x * p["a"] * p["a"] + p["a"]).sin().sum(-1),
                             {"a": (D,)}, (B, D)),
    "bias_added": (lambda p, x: torch.tanh(x + p["b"]).sum(-1), {"b": (D,)}, (B, D)),
    "bias_radd_sub_rsub": (lambda p, x: torch.tanh((p["b"] + x) * (x - p["c"]) * (p["c"] - x))
                           .sum(-1), {"b": (D,), "c": (D,)}, (B, D)),
    "bias_alpha": (lambda p, x: torch.tanh(torch.add(x, p["b"], alpha=2.0)
                                           - torch.sub(x, p["b"], alpha=0.5)).sum(-1),
                   {"b": (D,)}, (B, D)),
    "position_embedding": (lambda p, x: torch.tanh(x + p["pos"]).sum((1, 2)), {"pos": (1, T, D)},
                           (B, T, D)),
    "cls_token": (lambda p, x: torch.tanh(torch.cat([p["cls"].expand(x.shape[0], -1, -1), x],
                                                    dim=1)).pow(2).sum((1, 2)),
                  {"cls": (1, 1, D)}, (B, T, D)),
    "expand_as_and_broadcast_to": (
        lambda p, x: (p["q"].expand_as(x) * x + torch.broadcast_to(p["r"], x.shape)).sin()
        .sum((1, 2)), {"q": (1, D), "r": (T, 1)}, (B, T, D)),
    "identity_cast": (lambda p, x: (x * p["w"].to(torch.float64).contiguous()).sin().sum(-1),
                      {"w": (D,)}, (B, D)),
    "scale_and_linear": (lambda p, x: (F.linear(x, p["W"]) * p["W"][0]).sin().sum(-1),
                         {"W": (D, D)}, (B, D)),
    "in_place_add": (lambda p, x: torch.tanh(F.linear(x, p["W"]).add_(p["b"])).sum(-1),
                     {"W": (D, D), "b": (D,)}, (B, D)),
}
STRUCTURED = {"rms_weight", "layer_scale", "scale_as_view", "scale_indexed_none",
              "scale_unsqueezed", "matrix_scale", "two_parameters", "same_parameter_twice",
              "bias_added", "bias_radd_sub_rsub", "bias_alpha", "position_embedding",
              "cls_token", "expand_as_and_broadcast_to", "identity_cast"}
"""Cases whose every parameter is covered by a rule (the others need the fallback somewhere)."""


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("way", WAYS, ids=["materialize", "auto"])
@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "batch"])
@pytest.mark.parametrize("diagonal", [False, True], ids=["full", "diag"])
def test_elementwise_matches_oracle(check, name, way, batch_dim, diagonal):
    torch.manual_seed(0)
    f, shapes, x_shape = CASES[name]
    params = {k: _randn(*s) for k, s in shapes.items()}
    check(f, (params, _randn(*x_shape)), force=way, batch_dim=batch_dim, diagonal=diagonal)


@pytest.mark.parametrize("name", sorted(STRUCTURED))
def test_elementwise_parameters_are_structured(ways, name):
    f, shapes, x_shape = CASES[name]
    params = {k: _randn(*s) for k, s in shapes.items()}
    assert "fallback" not in ways(f, (params, _randn(*x_shape)), batch_dim=0)


def test_in_place_uses_stay_on_the_fallback_and_indexed_rows_are_lookups(ways):
    for name, expected in (("in_place_add", ["ghost", "fallback"]),
                           # W[0]: a row of W read as a lookup (NOTE [row gathers])
                           ("scale_and_linear", ["materialize"])):
        f, shapes, x_shape = CASES[name]
        params = {k: _randn(*s) for k, s in sorted(shapes.items())}
        assert ways(f, (params, _randn(*x_shape)), batch_dim=0) == expected


def test_ntk_rows(check):
    f = lambda p, x: torch.stack([(x * p["w"]).sum(-1), (x + p["b"]).pow(2).sum(-1)], 1)  # noqa: E731
    params = {"w": _randn(D), "b": _randn(D)}
    for way in WAYS:
        check(f, (params, _randn(B, D)), force=way, batch_dim=0)
        check(f, (params, _randn(B, D)), force=way, batch_dim=None)


def test_views_of_a_parameter_are_the_parameter():
    s = _randn(T)
    with TapMode([s], [s], taps="trace") as mode:
        x = _randn(B, T, D)
        (x * s.view(1, T, 1)).sum()
        (x + s[None, :, None]).sum()
        _ = s.view(T, 1).T  # a transpose of a view does not keep the order: another use
    assert [use.rule for use in mode.recording.uses] == ["mul", "add"]
    assert mode.recording.unrecognised == {0: ["Tensor.T"]}


def test_layout_width_dims_and_scale():
    layout = BroadcastLayout((2, 3, 4), (3, 1), act_ndim=None, scale=-2.0)
    assert layout.width_dims == (1,) and layout.shape(24).positions == 8
    g = _randn(1, 2, 2, 3, 4)  # [rows, samples, *y]
    cot = layout.cot_factor(g, 2, None)
    torch.testing.assert_close(cot.sum(2)[..., 0, :], -2.0 * g.sum((2, 4)))


def test_rules_decline_what_they_do_not_cover():
    x = _randn(2, 3)
    assert MulRule().match(torch.mul, (x, 2.0), {}) is None  # a number is no parameter
    assert MulRule().match(torch.mul, (x, x.float()), {}) is None  # mixed dtypes
    assert MulRule().match(torch.mul, (x, _randn(4)), {}) is None  # no broadcast
    assert AddRule().match(torch.add, (x, x), {"alpha": x}) is None
    assert AddRule().match(torch.add, (x, x), {"out": x}) is None
