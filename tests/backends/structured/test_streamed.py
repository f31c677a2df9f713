"""The streamed Gram of one materialized use (NOTE [streamed Gram]) against the oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import flat_gramian, make_problem
from reference import dense_gramian
from torchgram.backends.structured import run_structured, streamed
from torchgram.backends.structured.streamed import Workspace, streamed_gram


@pytest.mark.parametrize("budget", [1, 7, 10**6], ids=["one-row", "uneven", "whole"])
@pytest.mark.parametrize("diagonal", [False, True])
def test_streamed_gram_is_the_gram_of_the_products(monkeypatch, budget, diagonal):
    monkeypatch.setattr(streamed, "STREAM_ELEMENTS", budget * 4 * 6)  # rows i per slice
    torch.manual_seed(0)
    left = torch.randn(4, 5, 3, dtype=torch.float64)
    right = torch.randn(4, 3, 6, dtype=torch.float64)
    jac = torch.bmm(left, right).reshape(4, -1)
    expected = (jac * jac).sum(-1).reshape(1, 4) if diagonal else (jac @ jac.T).reshape(1, 4, 1, 4)
    workspace = Workspace()
    for _ in range(2):  # the second time into the buffer left by the first
        torch.testing.assert_close(streamed_gram(left, right, diagonal, workspace), expected,
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("diagonal", [False, True])
def test_streamed_gram_of_no_rows_is_zero(diagonal):
    gram = streamed_gram(torch.randn(3, 0, 2), torch.randn(3, 2, 4), diagonal, Workspace())
    assert gram.shape == ((1, 3) if diagonal else (1, 3, 1, 3)) and not gram.any()


def test_streamed_gram_is_differentiable(monkeypatch):
    monkeypatch.setattr(streamed, "STREAM_ELEMENTS", 2 * 4 * 6)
    torch.manual_seed(0)
    left = torch.randn(4, 5, 3, dtype=torch.float64, requires_grad=True)
    right = torch.randn(4, 3, 6, dtype=torch.float64, requires_grad=True)

    def direct(a, b):
        jac = torch.bmm(a, b).reshape(4, -1)
        return jac @ jac.T

    weights = torch.randn(4, 4, dtype=torch.float64)
    got = torch.autograd.grad((streamed_gram(left, right, False, Workspace()).reshape(4, 4)
                               * weights).sum(), (left, right))
    want = torch.autograd.grad((direct(left, right) * weights).sum(), (left, right))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def _conv_linear(p, x):
    h = F.conv2d(x, p["conv"], stride=2, padding=1).tanh()  # T = 9 positions
    h = F.linear(h.flatten(2).transpose(1, 2), p["lin"]).tanh()  # T = 9 positions again
    return h.sum((1, 2))


@pytest.mark.parametrize("diagonal", [False, True])
@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch", "dense"])
def test_materialized_leaves_streamed_in_slices_match_oracle(monkeypatch, diagonal, batch_dim):
    """Two leaves of other sizes through one workspace, several slices each."""
    monkeypatch.setattr(streamed, "STREAM_ELEMENTS", 50)
    torch.manual_seed(0)
    params = {"conv": torch.randn(4, 2, 3, 3, dtype=torch.float64),
              "lin": torch.randn(3, 4, dtype=torch.float64)}
    x = torch.randn(3, 2, 5, 5, dtype=torch.float64)
    expected = dense_gramian(_conv_linear, (params, x)).gramian
    if diagonal:
        expected = expected.diagonal()
    problem = make_problem(_conv_linear, (params, x), batch_dim=batch_dim, diagonal=diagonal)
    actual = flat_gramian(problem, run_structured(problem, force="materialize"))
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)
