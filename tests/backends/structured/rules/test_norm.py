"""Layer norm and group norm affine parameters, alone and in a model, against the oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchgram.backends.structured.rules.norm import GroupNormRule, LayerNormRule

B = 4
WAYS = ["materialize", None]


def _params(*shapes):
    return {name: torch.randn(*shape, dtype=torch.float64) for name, shape in shapes}


CASES = {
    "layer_norm": (lambda p, x: F.layer_norm(x, (6,), p["w"], p["b"]).tanh().sum((1, 2)),
                   [("w", (6,)), ("b", (6,))], (B, 3, 6)),
    "layer_norm_2d_shape": (lambda p, x: F.layer_norm(x, (3, 6), p["w"], p["b"], 1e-3)
                            .sin().sum((1, 2)), [("w", (3, 6)), ("b", (3, 6))], (B, 3, 6)),
    "layer_norm_weight_only": (lambda p, x: F.layer_norm(x, (6,), p["w"]).pow(2).sum((1, 2)),
                               [("w", (6,))], (B, 3, 6)),
    "layer_norm_ntk": (lambda p, x: F.layer_norm(x, (6,), p["w"], p["b"])[:, 0, :3],
                       [("w", (6,)), ("b", (6,))], (B, 3, 6)),
    "layer_norm_reused": (lambda p, x: F.layer_norm(F.layer_norm(x, (6,), p["w"], p["b"]).tanh(),
                                                    (6,), p["w"], p["b"]).sum((1, 2)),
                          [("w", (6,)), ("b", (6,))], (B, 3, 6)),
    "group_norm": (lambda p, x: F.group_norm(x, 2, p["w"], p["b"]).tanh().sum((1, 2, 3)),
                   [("w", (4,)), ("b", (4,))], (B, 4, 3, 2)),
    "group_norm_1d": (lambda p, x: F.group_norm(x, 4, p["w"], p["b"], 1e-4).sin().sum((1, 2)),
                      [("w", (4,)), ("b", (4,))], (B, 4, 5)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("way", WAYS, ids=["materialize", "auto"])
@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "batch"])
@pytest.mark.parametrize("diagonal", [False, True], ids=["full", "diag"])
def test_norm_matches_oracle(check, name, way, batch_dim, diagonal):
    torch.manual_seed(0)
    f, shapes, x_shape = CASES[name]
    check(f, (_params(*shapes), torch.randn(*x_shape, dtype=torch.float64)), force=way,
          batch_dim=batch_dim, diagonal=diagonal)


def test_norm_parameters_are_structured_not_fallback(ways):
    f, shapes, x_shape = CASES["layer_norm"]
    x = torch.randn(*x_shape, dtype=torch.float64)
    assert ways(f, (_params(*shapes), x), batch_dim=0) == ["materialize"] * 2


def test_rules_decline_mismatched_parameters():
    x = torch.randn(2, 3, 6)
    assert LayerNormRule().match(F.layer_norm, (x, (6,), torch.randn(5)), {}) is None
    assert LayerNormRule().match(F.layer_norm, (x, (6,)), {}) is None  # nothing to tap
    assert GroupNormRule().match(F.group_norm, (x, 3, torch.randn(2)), {}) is None
