"""NOTE [prelu as where]: torch's prelu bugs it works around, and the decomposition itself.

The first two tests check torch 2.13's behaviour (they fail once torch fixes it, when the
decomposition may go); the others check that the decomposition keeps prelu's values, dtype
and backward derivatives, with derivatives of every order consistent with its backward.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own spelling
from torch import Tensor
from torch.func import jacfwd, jacrev, vjp, vmap

from torchgram._core.prelu import PreluAsWhere

# torch's first forward-mode derivative in a process loads decompositions that warn
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning")

DTYPE = torch.float64
POINTS = torch.tensor([-3.0, -1.0, 0.0, 0.5, 1.0, float("nan")], dtype=DTYPE)
SLOPE = torch.tensor([0.25], dtype=DTYPE)


def _evaluation(decomposed: bool) -> contextlib.AbstractContextManager[Any]:
    return PreluAsWhere() if decomposed else contextlib.nullcontext()


def _rows(weight: Tensor, sample: Tensor, mixing: Tensor, decomposed: bool) -> Tensor:
    with _evaluation(decomposed):
        return F.prelu(sample[None] @ weight.T, SLOPE)[0] @ mixing.T


def test_prelu_backward_under_nested_vmap_is_still_wrong() -> None:
    """Two samples of two rows each: wrong values, no error (other sizes raise)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 3, dtype=DTYPE, generator=generator)
    mixing = torch.randn(2, 6, dtype=DTYPE, generator=generator)
    x = torch.randn(2, 3, dtype=DTYPE, generator=generator)

    def per_sample_vjps(decomposed: bool) -> Tensor:  # vmap over samples around rows
        def one_sample(sample: Tensor) -> Tensor:
            _, pull = vjp(lambda w: _rows(w, sample, mixing, decomposed), weight)
            return vmap(pull)(torch.eye(2, dtype=DTYPE))[0]

        return vmap(one_sample)(x)

    looped = torch.stack([torch.stack([
        vjp(lambda w, sample=sample: _rows(w, sample, mixing, False), weight)[1](
            torch.eye(2, dtype=DTYPE)[row])[0] for row in range(2)]) for sample in x])
    try:
        assert not torch.allclose(per_sample_vjps(False), looped), \
            "torch fixed prelu's batched backward"
    except RuntimeError:  # the other way torch 2.13 fails there
        pass
    torch.testing.assert_close(per_sample_vjps(True), looped)


def test_prelu_double_backward_at_zero_is_still_inconsistent() -> None:
    """The backward scales the cotangent by w at x = 0; its double backward says 1."""
    for decomposed, expected in ((False, 1.0), (True, 0.25)):
        x = torch.zeros(1, dtype=DTYPE, requires_grad=True)
        cotangent = torch.ones(1, dtype=DTYPE, requires_grad=True)
        with _evaluation(decomposed):
            y = F.prelu(x, SLOPE)
        grad_x, = torch.autograd.grad(y, x, cotangent, create_graph=True)
        assert grad_x.item() == 0.25
        assert torch.autograd.grad(grad_x, cotangent)[0].item() == expected


def test_prelu_under_autocast_keeps_its_dtype() -> None:
    x, w = torch.randn(4, 3, 5), torch.rand(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.prelu(x, w)
        with PreluAsWhere():
            got = F.prelu(x, w)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=0, atol=0)




@pytest.mark.parametrize(("shape", "slopes"), [((6,), 1), ((3, 2), 1), ((3, 2), 2),
                                              ((1, 2, 3), 1), ((1, 2, 3), 2)],
                         ids=["1d", "2d", "2d-per-channel", "3d", "3d-per-channel"])
def test_prelu_as_where_keeps_values_and_takes_the_backwards_derivative(
        shape: tuple[int, ...], slopes: int) -> None:
    weight = torch.tensor([0.25, 0.5][:slopes], dtype=DTYPE)

    def op(x: Tensor) -> Tensor:
        return F.prelu(x.reshape(shape), weight)

    with PreluAsWhere():
        value, forward = op(POINTS), jacfwd(op)(POINTS)
        backward = jacrev(op)(POINTS)
    torch.testing.assert_close(value, op(POINTS), equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(forward, jacrev(op)(POINTS), equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(backward, jacrev(op)(POINTS), equal_nan=True, rtol=0, atol=0)
