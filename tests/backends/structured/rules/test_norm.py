"""Layer norm and group norm affine parameters, alone and in a model, against the oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchgram as tg
from helpers import flat_gramian, make_problem
from reference import dense_gramian
from torchgram.backends.structured import run_structured
from torchgram.backends.structured.rules.norm import BatchNormRule, GroupNormRule, LayerNormRule

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
    "rms_norm": (lambda p, x: F.rms_norm(x, (6,), p["w"], 1e-5).tanh().sum((1, 2)),
                 [("w", (6,))], (B, 3, 6)),
    "rms_norm_2d_shape": (lambda p, x: F.rms_norm(x, (3, 6), p["w"]).sin().sum((1, 2)),
                          [("w", (3, 6))], (B, 3, 6)),
    "batch_norm_eval_2d": (lambda p, x: F.batch_norm(x, _MEAN4, _VAR4, p["w"], p["b"], False,
                                                     0.1, 1e-3).tanh().sum((1, 2, 3)),
                           [("w", (4,)), ("b", (4,))], (B, 4, 3, 2)),
    "batch_norm_eval_1d_flat": (lambda p, x: F.batch_norm(x, _MEAN4, _VAR4, p["w"], None)
                                .sin().sum(1), [("w", (4,))], (B, 4)),
    "batch_norm_eval_1d_seq": (lambda p, x: F.batch_norm(x, _MEAN4, _VAR4, None, p["b"])
                               .pow(2).sum((1, 2)), [("b", (4,))], (B, 4, 5)),
    # batch statistics couple the samples: with batch_dim the backend gives the coupled Gramian
    "batch_norm_train": (lambda p, x: F.batch_norm(x, None, None, p["w"], p["b"], True)
                         .tanh().sum((1, 2, 3)), [("w", (4,)), ("b", (4,))], (B, 4, 3, 2)),
}
_MEAN4 = torch.tensor([0.1, -0.2, 0.3, 0.0], dtype=torch.float64)
_VAR4 = torch.tensor([1.5, 0.5, 2.0, 1.0], dtype=torch.float64)


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


@pytest.mark.parametrize("name", ["rms_norm", "batch_norm_eval_2d", "batch_norm_eval_1d_flat"])
def test_new_norms_are_structured(ways, name):
    f, shapes, x_shape = CASES[name]
    x = torch.randn(*x_shape, dtype=torch.float64)
    assert set(ways(f, (_params(*shapes), x), batch_dim=0)) == {"materialize"}


@pytest.mark.parametrize("module", ["bn2d", "rmsnorm"])
def test_norm_modules_in_eval_mode_run_batched(check, module):
    torch.manual_seed(0)
    layer = (torch.nn.BatchNorm2d(4) if module == "bn2d" else torch.nn.RMSNorm(6)).double()
    if module == "bn2d":
        layer.running_mean.normal_()
        layer.running_var.uniform_(0.5, 2.0)
        layer.weight.data.normal_()
    layer.eval()
    fn, params = tg.functionalize(layer)
    x = torch.randn(B, 4, 3, 2, dtype=torch.float64) if module == "bn2d" else \
        torch.randn(B, 3, 6, dtype=torch.float64)

    def f(p, x):
        return torch.tanh(fn(p, x)).flatten(1).sum(1)

    check(f, (params, x), force=None, batch_dim=0)
    ran = tg.explain(f, backend="structured", batch_dim=0, run=True)(params, x).ran
    assert ran is not None and ran.way == "batched" and "fallback" not in ran.leaf_ways
    before = (layer.running_mean.clone(), layer.running_var.clone()) if module == "bn2d" else ()
    tg.gramian(f, backend="structured", batch_dim=0)(params, x)
    if module == "bn2d":
        assert torch.equal(layer.running_mean, before[0]) and torch.equal(layer.running_var,
                                                                           before[1])


def test_batch_norm_in_training_mode_gives_the_coupled_gramian():
    f, shapes, x_shape = CASES["batch_norm_train"]
    x = torch.randn(*x_shape, dtype=torch.float64)
    report = tg.explain(f, backend="structured", batch_dim=0, run=True)(_params(*shapes), x)
    assert report.ran is not None and report.ran.way == "dense"
    assert "fallback" not in report.ran.leaf_ways
    assert BatchNormRule().match(F.batch_norm, (x, None, None, torch.randn(3)), {}) is None


@pytest.mark.parametrize("way", ["materialize", None])
@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch", "dense"])
def test_batch_norm_in_eval_mode_with_mixed_dtype_leaves(way, batch_dim):
    """float32 statistics and affine leaves, a float64 leaf after: contracted in float64."""
    torch.manual_seed(0)
    mean, var = torch.randn(3), torch.rand(3) + 0.5

    def f(p, x):
        y = F.batch_norm(x, mean, var, p["g"], p["b"], False, 0.1, 1e-5)
        return (torch.tanh(y).double() * p["s"]).sum(-1)

    params = {"g": torch.randn(3), "b": torch.randn(3),
              "s": torch.randn(3, dtype=torch.float64)}
    args = (params, torch.randn(5, 3))
    problem = make_problem(f, args, batch_dim=batch_dim)
    actual = flat_gramian(problem, run_structured(problem, force=way))
    expected = dense_gramian(f, args).gramian
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=1e-5,
                               atol=1e-5 * expected.abs().max().item())
