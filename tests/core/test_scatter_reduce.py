"""NOTE [scatter_reduce's ties with the excluded self]: torch's backward, torchgram's rewrite.

The first test checks torch 2.13's behaviour (it fails once torch fixes it); the others check
every backend against the same reduction written without ``scatter_reduce`` (the dense
oracle runs torch's backward, which halves the gradient at those ties), and eager graphs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

import torchgram as tg
from reference import dense_gramian
from torchgram._core.scatter_reduce import ScatterReduceWithoutSelf

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning")

DTYPE = torch.float64
BACKENDS = ["auto", "jacobian", "ntvp", "graph", "structured"]
INDEX = torch.tensor([0, 1, 1, 2])  # node 3 receives nothing and keeps its value


def test_torch_still_halves_the_gradient_at_a_tie_with_the_excluded_self() -> None:
    src = torch.tensor([0.0, 1.0], dtype=DTYPE, requires_grad=True)
    out = torch.zeros(2, dtype=DTYPE).scatter_reduce(0, torch.tensor([0, 1]), src, "amax",
                                                     include_self=False)
    (grad,) = torch.autograd.grad(out[0], src)
    assert grad[0] == 0.5, "torch fixed scatter_reduce's backward"


def _aggregated(p: Tensor, x: Tensor, reduce: str) -> Tensor:
    """Max (min) of messages ``p * x`` into a zeros buffer, one graph per sample."""
    messages = p * x  # [B, 4]; p[0] = 0: node 0's message is exactly 0, the buffer's value
    buffer = torch.zeros(x.shape[0], 4, dtype=x.dtype)
    return buffer.scatter_reduce(1, INDEX.expand_as(messages), messages, reduce,
                                 include_self=False)


def _written_out(p: Tensor, x: Tensor, reduce: str) -> Tensor:
    messages = p * x
    pick = torch.maximum if reduce == "amax" else torch.minimum
    return torch.stack([messages[:, 0], pick(messages[:, 1], messages[:, 2]), messages[:, 3],
                        torch.zeros_like(messages[:, 0])], dim=1)


def _inputs() -> tuple[Tensor, Tensor]:
    p = torch.tensor([0.0, 1.0, -2.0, 0.5], dtype=DTYPE)
    x = torch.linspace(0.5, 2.0, 12, dtype=DTYPE).reshape(3, 4)
    return p, x


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "per-sample"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduce", ["amax", "amin"])
def test_every_backend_differentiates_the_tie_rightly(reduce: str, backend: str,
                                                      batch_dim: int | None) -> None:
    p, x = _inputs()
    expected = dense_gramian(lambda p, x: _written_out(p, x, reduce), (p, x)).gramian
    gramian = tg.gramian(lambda p, x: _aggregated(p, x, reduce), backend=backend,
                         batch_dim=batch_dim)
    assert_close(gramian(p, x).reshape(12, 12), expected, rtol=1e-12, atol=1e-12)


def test_the_rewrite_keeps_values() -> None:
    base = torch.tensor([5.0, float("nan"), -1.0, 2.0], dtype=DTYPE)
    src = torch.tensor([1.0, 3.0, float("inf"), 0.0], dtype=DTYPE)
    for reduce in ("amax", "amin"):
        expected = base.scatter_reduce(0, INDEX, src, reduce, include_self=False)
        with ScatterReduceWithoutSelf():
            got = base.scatter_reduce(0, INDEX, src, reduce, include_self=False)
        assert_close(got, expected, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("recorded", [False, True], ids=["walk", "record"])
def test_eager_graphs_refuse_a_tie_and_take_the_rest(recorded: bool) -> None:
    p, x = _inputs()
    p.requires_grad_()
    with tg.autograd.record() if recorded else contextlib.nullcontext():
        tied = _aggregated(p, x, "amax")
    with pytest.raises(ValueError, match=r"torchgram.autograd.gramian: .*scatter_reduce"):
        tg.autograd.gramian(tied, [p], retain_graph=True)
    q = torch.tensor([0.25, 1.0, -2.0, 0.5], dtype=DTYPE, requires_grad=True)  # no tie
    with tg.autograd.record() if recorded else contextlib.nullcontext():
        untied = _aggregated(q, x, "amax")
    expected = dense_gramian(lambda p, x: _written_out(p, x, "amax"), (q.detach(), x))
    assert_close(tg.autograd.gramian(untied, [q]).reshape(12, 12), expected.gramian)
