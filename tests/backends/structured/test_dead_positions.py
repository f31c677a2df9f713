"""Positions the rows never reach (NOTE [dead positions]): found by the trace, dropped exactly.

A classifier that reads the first position of its last layer (BERT, ViT) leaves every other
position of that layer's cotangents zero. The trace marks those uses (``UseRecord.live``),
the cost model counts their live positions only, and the contraction drops a position only
where the run's cotangent is zero for every row and sample: every block stays the oracle's,
also when the traced sample reaches fewer positions than the others.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchgram as tg
from helpers import flat_gramian, make_problem
from reference import dense_cross_kernel, dense_gramian, dense_gramian_fn
from torchgram.backends.structured import contraction, plan_problem, run_structured
from torchgram.backends.structured.contraction import Factor, UseFactors, drop_dead_positions

B, T, D, H, K = 5, 6, 4, 7, 3


def _params(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"w1": torch.randn(H, D, dtype=dtype), "b1": torch.randn(H, dtype=dtype),
            "w2": torch.randn(H, H, dtype=dtype), "b2": torch.randn(H, dtype=dtype),
            "head": torch.randn(K, H, dtype=dtype)}


def _first_position(p: dict[str, torch.Tensor], x: torch.Tensor, gate: torch.Tensor
                    ) -> torch.Tensor:
    """``[B, K]`` logits of the first position after a layer that mixes the positions.

    ``gate [B, T]`` adds the other positions of the last layer, sample by sample: where it is
    zero for the first sample (the one traced), the trace sees one live position there.
    """
    h = torch.tanh(F.linear(x, p["w1"], p["b1"]))  # every position live (mixed below)
    h = h + h.mean(1, keepdim=True)
    z = torch.tanh(F.linear(h, p["w2"], p["b2"]))  # live: position 0 (and the gated ones)
    read = z[:, 0] + (gate[:, :, None] * z).sum(1)
    return F.linear(read, p["head"])


def _args(dtype: torch.dtype, gated: bool) -> tuple:
    torch.manual_seed(1)
    x = torch.randn(B, T, D, dtype=dtype)
    gate = torch.zeros(B, T, dtype=dtype)
    if gated:  # samples 1.. read positions 2 and 4 too; sample 0 (the trace's) does not
        gate[1:, 2] = torch.randn(B - 1, dtype=dtype)
        gate[2:, 4] = 1.0
    return _params(dtype), x, gate


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    scale = expected.abs().max().clamp_min(1.0)
    torch.testing.assert_close(actual / scale, expected / scale, rtol=tol, atol=tol)


def _live(f, args) -> dict[str, int | None]:
    """Each leaf's ``live`` positions as the trace recorded them (weights of products)."""
    plan = plan_problem(make_problem(f, args, batch_dim=0))
    names = sorted(args[0])
    return {names[p.leaf]: use.live for p in plan.leaves for use in p.uses
            if use.role == "weight"}


def test_the_trace_finds_the_positions_the_rows_reach():
    args = _args(torch.float64, gated=False)
    assert _live(_first_position, args) == {"w1": None, "w2": 1, "head": None}
    plan = plan_problem(make_problem(_first_position, args, batch_dim=0))
    w2 = plan.leaves[sorted(args[0]).index("w2")]
    assert w2.way == "ghost" and "1 of 6 positions reach the rows" in w2.reason


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("gated", [False, True], ids=["cls", "traced-sample-reaches-fewer"])
@pytest.mark.parametrize("way", [None, "ghost", "materialize"])
@pytest.mark.parametrize("diagonal", [False, True], ids=["full", "diagonal"])
def test_blocks_match_the_oracle(dtype, gated, way, diagonal, monkeypatch):
    """Per-sample rows ``K = 3`` (several backwards' rows) and per-sample losses (one
    streamed backward), every way; ``gated``: the run reaches positions the trace did not."""
    args = _args(dtype, gated)
    assert _live(_first_position, args)["w2"] == 1  # the traced sample reaches one
    kept: list[int] = []

    def spy(factors: UseFactors) -> UseFactors:
        out = drop_dead_positions(factors)
        cot = out.first if out.first.kind == "cot" else out.second
        kept.append(cot.tensor.shape[2])
        return out

    monkeypatch.setattr(contraction, "drop_dead_positions", spy)

    def losses(p, x, gate):
        return _first_position(p, x, gate).logsumexp(-1)

    for f in (_first_position, losses):
        kept.clear()
        expected = dense_gramian(f, args).gramian.to(torch.float64)
        problem = make_problem(f, args, batch_dim=0, diagonal=diagonal)
        got = flat_gramian(problem, run_structured(problem, force=way)).to(torch.float64)
        _close(got, expected.diagonal() if diagonal else expected, dtype)
        assert kept and set(kept) == {3 if gated else 1}  # positions 0 (2, 4) of w2's use


def test_per_leaf_blocks_and_explain_run_match_the_oracle():
    args = _args(torch.float64, gated=True)
    expected = dense_gramian(_first_position, args)
    blocks = tg.gramian(_first_position, batch_dim=0, per_leaf=True)(*args)
    for name, block in zip(sorted(args[0]), expected.blocks, strict=True):
        _close(blocks[name].reshape(B * K, B * K), block, torch.float64)
    report = tg.explain(_first_position, batch_dim=0, run=True)(*args)
    assert report.ran is not None
    assert tuple(leaf.way for leaf in report.leaves) == report.ran.leaf_ways
    assert report.by_name("w2").way == "ghost"
    _close(report.gramian.reshape(B * K, B * K), expected.gramian, torch.float64)


def test_aggregated_grad_with_dead_positions():
    args = _args(torch.float64, gated=False)

    def losses(p, x, gate):
        return _first_position(p, x, gate).logsumexp(-1)

    expected = dense_gramian(losses, args)
    weights = torch.linspace(0.5, 1.5, B, dtype=torch.float64)
    update, _ = tg.aggregated_grad(losses, lambda G: weights, backend="structured",
                                   batch_dim=0)(*args)
    flat = torch.cat([update[name].reshape(-1) for name in sorted(args[0])])
    torch.testing.assert_close(flat, weights @ expected.jacobian, rtol=1e-10, atol=1e-10)


def test_a_differentiable_gramian_keeps_every_position():
    """A zero cotangent can have a non-zero derivative: the contraction drops no position of
    a cotangent that requires grad, and ``G`` and its gradient are the oracle's."""
    params, x, gate = _args(torch.float64, gated=False)
    params = {name: value.requires_grad_() for name, value in params.items()}

    def losses(p, x, gate):
        return _first_position(p, x, gate).logsumexp(-1)

    gram = tg.gramian(losses, batch_dim=0)(params, x, gate)
    expected = dense_gramian_fn(losses)(params, x, gate)
    torch.testing.assert_close(gram, expected, rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(gram.square().sum(), list(params.values()))
    expected_grads = torch.autograd.grad(expected.square().sum(), list(params.values()))
    for grad, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, want, rtol=1e-8, atol=1e-10)


def test_drop_dead_positions_keeps_non_zero_nan_and_inf_positions():
    cot = torch.zeros(2, 3, 5, 1, 4)
    cot[1, 2, 1, 0, 3] = -1e-30  # tiny, one row, one sample: live
    cot[0, 0, 3, 0, 0] = float("nan")
    cot[0, 1, 4, 0, 2] = float("inf")
    act = torch.randn(3, 5, 1, 6)
    out = drop_dead_positions(UseFactors(Factor(cot, "cot"), Factor(act, "act")))
    assert torch.equal(out.second.tensor, act[:, [1, 3, 4]])
    assert torch.equal(out.first.tensor.nan_to_num(), cot[:, :, [1, 3, 4]].nan_to_num())
    zero = drop_dead_positions(UseFactors(Factor(torch.zeros(1, 3, 5, 1, 4), "cot"),
                                          Factor(act, "act")))
    assert zero.first.tensor.shape[2] == zero.second.tensor.shape[1] == 1  # one zero position
    ones = Factor(torch.ones(3, 1, 1, 4), "act")  # broadcast along the positions: kept
    assert drop_dead_positions(UseFactors(ones, Factor(cot, "cot"))).first is ones


def test_a_few_dead_positions_are_not_worth_a_hint():
    """One dead position of six (a causal LM's last one): no hint, no check, nothing dropped."""
    def all_but_last(p, x, gate):
        h = torch.tanh(F.linear(x, p["w1"], p["b1"]))
        z = torch.tanh(F.linear(h, p["w2"], p["b2"]))
        return F.linear(z[:, :-1].sum(1), p["head"])

    args = _args(torch.float64, gated=False)
    assert _live(all_but_last, args) == {"w1": None, "head": None, "w2": None}
    _close(tg.gramian(all_but_last, batch_dim=0)(*args).reshape(B * K, B * K),
           dense_gramian(all_but_last, args).gramian, torch.float64)


def test_cross_kernels_cost_every_position_and_match_the_oracle():
    """The cross kernels' sides keep every position: their plan counts them all."""
    params, x, gate = _args(torch.float64, gated=True)

    def f(p, xs):
        return _first_position(p, *xs)

    x1, x2 = (x[:2], gate[:2]), (x[2:], gate[2:])
    kernel = tg.ntk.empirical_ntk_fn(f, trace_axes=(), backend="structured")(x1, x2, params)
    expected = dense_cross_kernel(f, params, x1, x2)
    torch.testing.assert_close(kernel, expected, rtol=1e-10, atol=1e-10)
    problem = make_problem(f, (params, x2), batch_dim=0)
    cross = plan_problem(problem, dead_positions=False)
    assert all(use.live is None for p in cross.leaves for use in p.uses)
    assert plan_problem(problem).leaves[sorted(params).index("w2")].uses[0].live == 3  # 0, 2, 4


def test_a_draw_that_reaches_no_position_gives_no_hint():
    """NOTE [hints from one draw]: a ``Dropout2d`` over the 3 channels of a convolution drops
    all of them in the traced sample's draw (the zoo's ``WithDropout``, seed 12), and the hint
    said the rows reach none of the weight's 9 positions: the cost model took ghost at one
    position's cost (4.6e4 multiply-adds), about 2e6 in the run, where materializing costs
    5.4e5 (the structured pass 2.3 times slower). Such a use gets no hint; the answer is the
    oracle's either way."""
    from models import torchjd_ports
    from models.case import build, oracle

    case = build(torchjd_ports.BUILDERS, "WithDropout")
    options = {"batch_dim": 0, "in_dims": case.in_dims}
    plan = plan_problem(make_problem(case.f, case.args, **options))
    assert all(use.live is None for use in plan.recording.uses), plan.recording.uses
    assert [leaf.way for leaf in plan.leaves] == ["materialize", "materialize"], plan.leaves
    torch.manual_seed(case.seed)
    G = tg.gramian(case.f, backend="structured", **options)(*case.args)
    expected = oracle(torchjd_ports.BUILDERS, "WithDropout")[0].gramian
    torch.testing.assert_close(G.reshape(expected.shape), expected, rtol=1e-10, atol=1e-12)
