"""``torchgram.distributed`` called inside ``torch.inference_mode()`` (NOTE [inference mode]).

One process, a world of one (gloo): before session 40 the data-parallel Gramian came back
zero there, without a word, after a first call outside the mode.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own spelling
from torch import nn

import torchgram as tg
from helpers import world_of_one  # noqa: F401 -- a fixture
from reference import dense_gramian
from torchgram._core.signature import clear_caches


@pytest.mark.usefixtures("world_of_one")
def test_gramian_and_step_inside_inference_mode() -> None:
    clear_caches()
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    fn, params = tg.functionalize(module)
    x = torch.randn(5, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (5,))

    def f(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fn(p, x), y, reduction="none")

    wanted = dense_gramian(f, (params, x, y)).shaped()
    gramian = tg.distributed.gramian(f, batch_dim=0)
    step = tg.distributed.aggregated_grad(f, tg.weighting.upgrad, batch_dim=0)
    gramian(params, x, y)  # a cached probe first: the case that came back zero
    with torch.inference_mode():
        G = gramian(params, x, y)
        update, info = step(params, x, y)
    torch.testing.assert_close(G, wanted, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(info.gramian, wanted, rtol=1e-10, atol=1e-12)
    weights = tg.weighting.upgrad(wanted)
    expected = torch.func.vjp(lambda p: f(p, x, y), params)[1](weights)[0]
    for name, value in expected.items():
        torch.testing.assert_close(update[name], value, rtol=1e-10, atol=1e-12)


@pytest.mark.usefixtures("world_of_one")
def test_eager_gramian_and_backward_inside_inference_mode() -> None:
    """``torchgram.distributed.autograd`` on outputs recorded outside the mode."""
    clear_caches()
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    inputs = list(module.parameters())
    wanted = tg.autograd.gramian(F.cross_entropy(module(x), y, reduction="none"), inputs,
                                 batch_dim=0)
    rows = F.cross_entropy(module(x), y, reduction="none")
    with torch.inference_mode():
        G = tg.distributed.autograd.gramian(rows, inputs)
    torch.testing.assert_close(G, wanted, rtol=1e-10, atol=1e-12)
    expected = torch.autograd.grad(F.cross_entropy(module(x), y, reduction="none"), inputs,
                                   tg.weighting.upgrad(wanted))
    rows = F.cross_entropy(module(x), y, reduction="none")
    with torch.inference_mode():
        tg.distributed.autograd.backward(rows, inputs, tg.weighting.upgrad)
    for param, grad in zip(inputs, expected, strict=True):
        assert param.grad is not None
        torch.testing.assert_close(param.grad, grad, rtol=1e-10, atol=1e-12)
