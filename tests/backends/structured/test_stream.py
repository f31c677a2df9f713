"""The streamed backward (NOTE [streamed taps]): same matrices, cotangents let go as they come."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchgram as tg
from helpers import flat_gramian, make_problem
from reference import dense_gramian
from torchgram.backends.structured import backend, run_structured, stream
from torchgram.backends.structured.contraction import Contraction
from zoo import NAMES, build

LOSSES = [name for name in NAMES if "losses" in build(name).tags
          and build(name).batch_dim is not None]


def _close(actual, expected):
    scale = expected.abs().max().clamp_min(1.0)
    torch.testing.assert_close(actual / scale, expected / scale, rtol=1e-10, atol=1e-10)


@pytest.fixture
def streamed(monkeypatch):
    """Counts the passes that streamed."""
    calls = []
    original = stream.streamed_backward

    def spy(forward, consume):
        calls.append(forward.kind)
        return original(forward, consume)

    monkeypatch.setattr(backend, "streamed_backward", spy)
    return calls


@pytest.mark.parametrize("way", ["ghost", "materialize", "sparse", None])
@pytest.mark.parametrize("name", LOSSES)
def test_streamed_pass_matches_oracle_on_zoo(name, way, streamed):
    """Per-sample losses stream (batched and vmap ways, tied uses, carriers) and stay exact."""
    case = build(name)
    expected = dense_gramian(case.f, case.args).gramian
    for diagonal in (False, True):
        problem = make_problem(case.f, case.args, batch_dim=case.batch_dim,
                               in_dims=case.in_dims, diagonal=diagonal)
        actual = flat_gramian(problem, run_structured(problem, force=way))
        _close(actual, expected.diagonal() if diagonal else expected)
    assert len(streamed) == 2


def _chain(depth: int, positions: int):
    layers = [nn.Linear(4, 4) for _ in range(depth)]
    fn, params = tg.functionalize(nn.Sequential(*layers).double())

    def losses(p, x):
        return fn(p, x).tanh().sum((1, 2))

    return losses, (params, torch.randn(3, positions, 4, dtype=torch.float64))


def test_cotangents_and_activations_go_as_soon_as_their_leaves_are_contracted(monkeypatch,
                                                                              streamed):
    """A chain of layers holds one tap's cotangent at a time, not all of them at the end."""
    f, args = _chain(depth=6, positions=5)
    live = []
    original = Contraction.add_tap

    def add_tap(self, tap, cot):
        original(self, tap, cot)
        live.append((sum(c is not None for c in self._stream_cots),
                     sum(a is not None for a in self._acts)))

    monkeypatch.setattr(Contraction, "add_tap", add_tap)
    problem = make_problem(f, args, batch_dim=0)
    _close(flat_gramian(problem, run_structured(problem, force="materialize")),
           dense_gramian(f, args).gramian)
    assert streamed and len(live) == 6
    assert max(cots for cots, _ in live) == 0  # each contracted and let go on arrival
    assert [acts for _, acts in live] == [5, 4, 3, 2, 1, 0]


def test_a_graph_through_the_callers_tensors_is_not_streamed(streamed):
    """A tapped layer whose input needs the caller's gradient only: the plain pass, exact."""
    scale = torch.randn(4, dtype=torch.float64, requires_grad=True)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    fn, params = tg.functionalize(model)

    def losses(p, x):
        return fn(p, x * scale).sum(-1)

    args = (params, torch.randn(5, 4, dtype=torch.float64))
    problem = make_problem(losses, args, batch_dim=0)
    actual = flat_gramian(problem, run_structured(problem))
    _close(actual, dense_gramian(losses, args).gramian)
    assert streamed == [] and scale.grad is None


def test_several_rows_per_sample_are_not_streamed(streamed):
    case = build("mlp_logits")
    problem = make_problem(case.f, case.args, batch_dim=case.batch_dim)
    _close(flat_gramian(problem, run_structured(problem)),
           dense_gramian(case.f, case.args).gramian)
    assert streamed == []


def test_kept_factors_and_differentiable_gramians_keep_the_plain_pass(streamed):
    """``Jᵀw`` from kept factors and a Gramian that carries the graph are not streamed."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1)).double()
    fn, params = tg.functionalize(model)
    x = torch.randn(5, 4, dtype=torch.float64)

    def losses(p, x):
        return fn(p, x).squeeze(-1)

    problem = make_problem(losses, (params, x), batch_dim=0, want_pullback=True)
    result = run_structured(problem)
    assert result.pullback is not None
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    gram = tg.gramian(losses, backend="structured", batch_dim=0)(leaves, x)
    assert gram.requires_grad
    _close(gram.detach(), dense_gramian(losses, (params, x)).gramian)
    assert streamed == []


def test_all_reach_follows_paths_to_the_inputs():
    a = torch.zeros(3, requires_grad=True)
    b = torch.zeros(3, requires_grad=True)
    theirs = torch.zeros(3, requires_grad=True)
    x = a * 2 + b
    y = theirs * 3
    z = (x * y).sum()
    end = [torch.autograd.graph.get_gradient_edge(t).node for t in (a, b)]
    assert stream._all_reach([x.grad_fn, z.grad_fn], end)
    assert not stream._all_reach([y.grad_fn], end)
    assert not stream._all_reach([x.grad_fn, y.grad_fn], end)
    assert stream._all_reach([], end)


def test_loss_with_unused_tapped_layer_streams_and_gives_zero_for_it(streamed):
    """A tapped output the rows never reach: its leaves get nothing."""
    w_used = torch.randn(3, 4, dtype=torch.float64)
    w_unused = torch.randn(2, 4, dtype=torch.float64)

    def losses(p, x):
        F.linear(x, p["unused"])
        return F.linear(x, p["used"]).tanh().sum(-1)

    args = ({"used": w_used, "unused": w_unused}, torch.randn(5, 4, dtype=torch.float64))
    problem = make_problem(losses, args, batch_dim=0, per_leaf=True)
    result = run_structured(problem)
    _close(flat_gramian(problem, result), dense_gramian(losses, args).gramian)
    assert streamed
