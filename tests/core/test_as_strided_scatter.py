"""NOTE [as_strided_scatter's backward]: torch's wrong backward, and torchgram's rewrite.

The first test checks torch 2.13's behaviour (it fails once torch fixes it, when the rewrite
may go); the others check every backend against the same function written without
``as_strided_scatter`` (the dense oracle runs torch's backward, which is the wrong one), and
the refusal on eager graphs.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

import torchgram as tg
from reference import dense_gramian
from torchgram._core.as_strided_scatter import AsStridedScatterRewritten

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning")

DTYPE = torch.float64
BACKENDS = ["auto", "jacobian", "ntvp", "graph", "structured"]
# (size, stride, storage_offset) of the view written over, in a [B, 2, 2] base
VIEWS = {"first-row": ((2,), (1,), 0), "second-column": ((2,), (2,), 1)}


def test_torch_still_gets_as_strided_scatter_s_backward_wrong() -> None:
    base = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=DTYPE, requires_grad=True)
    out = torch.as_strided_scatter(base, torch.zeros(2, dtype=DTYPE), (2,), (1,))
    (grad,) = torch.autograd.grad(out.sum(), base)
    assert torch.equal(grad, torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=DTYPE)), \
        "torch fixed as_strided_scatter's backward"


def _scattered(p: Tensor, x: Tensor, view: tuple[Any, ...]) -> Tensor:
    base = (p * x).reshape(-1, 2, 2)  # [B, 2, 2]
    src = 2 * p[:2] * x[:, :2]  # [B, 2]
    size, stride, offset = view
    return torch.stack([torch.as_strided_scatter(b, s, size, stride, offset)
                        for b, s in zip(base, src, strict=True)]).flatten(1)


def _written_out(p: Tensor, x: Tensor, view: tuple[Any, ...]) -> Tensor:
    """The same function with indexing: the truth."""
    base = (p * x).reshape(-1, 4)
    src = 2 * p[:2] * x[:, :2]
    size, stride, offset = view
    positions = [offset + i * stride[0] for i in range(size[0])]
    columns = [src[:, positions.index(j)] if j in positions else base[:, j] for j in range(4)]
    return torch.stack(columns, dim=1)


def _inputs() -> tuple[Tensor, Tensor]:
    p = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=DTYPE)
    x = torch.linspace(-1.0, 2.0, 12, dtype=DTYPE).reshape(3, 4)
    return p, x


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "per-sample"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("view", VIEWS.values(), ids=list(VIEWS))
def test_every_backend_differentiates_as_strided_scatter_rightly(
        view: tuple[Any, ...], backend: str, batch_dim: int | None) -> None:
    p, x = _inputs()
    expected = dense_gramian(lambda p, x: _written_out(p, x, view), (p, x)).gramian
    gramian = tg.gramian(lambda p, x: _scattered(p, x, view), backend=backend,
                         batch_dim=batch_dim)
    assert_close(gramian(p, x).reshape(12, 12), expected, rtol=1e-12, atol=1e-12)


def test_the_rewrite_keeps_values_and_takes_keywords() -> None:
    base = torch.tensor([[float("inf"), 2.0], [3.0, float("nan")]], dtype=DTYPE)
    src = torch.tensor([5.0, 6.0], dtype=DTYPE)
    for args, kwargs in [((base, src, (2,), (1,)), {}),
                         ((base,), {"src": src, "size": (2,), "stride": (2,),
                                    "storage_offset": 1})]:
        expected = torch.as_strided_scatter(*args, **kwargs)
        with AsStridedScatterRewritten():
            got = torch.as_strided_scatter(*args, **kwargs)
        assert_close(got, expected, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("recorded", [False, True], ids=["walk", "record"])
def test_eager_graphs_with_as_strided_scatter_are_refused(recorded: bool) -> None:
    p, x = _inputs()
    p.requires_grad_()
    with tg.autograd.record() if recorded else contextlib.nullcontext():
        losses = _scattered(p, x, VIEWS["first-row"])
    with pytest.raises(ValueError, match=r"torchgram.autograd.gramian: .*as_strided_scatter"):
        tg.autograd.gramian(losses, [p], retain_graph=True)
    with pytest.raises(ValueError, match=r"torchgram.autograd.backward: .*as_strided_scatter"):
        tg.autograd.backward(losses, [p], tg.weighting.mean)
    assert p.grad is None


def test_an_eager_scatter_into_a_constant_is_differentiated() -> None:
    # Only src needs a gradient: torch's backward for src is right, nothing is refused
    p, x = _inputs()
    p.requires_grad_()
    base = torch.zeros(3, 2, 2, dtype=DTYPE)
    losses = torch.stack([torch.as_strided_scatter(b, 2 * p[:2] * r[:2], (2,), (1,))
                          for b, r in zip(base, x, strict=True)]).flatten(1)
    expected = dense_gramian(lambda p, x: torch.cat(
        [2 * p[:2] * x[:, :2], torch.zeros(3, 2, dtype=DTYPE)], dim=1), (p.detach(), x))
    assert_close(tg.autograd.gramian(losses, [p]).reshape(12, 12), expected.gramian)
