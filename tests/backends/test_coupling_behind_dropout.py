"""Samples that interact where a random draw hides it from the checks of ``batch_dim``.

``f`` centers a layer over the batch (``h - h.mean(0)``) and ends in a dropout that, for
the draw of the call, zeroes the outputs of the first and the last sample. Their rows are
then zero functions: a check that weighs only their rows (the structured backend's
derivative check, the eager probes, before session 23) sees no interaction, while the
other samples' rows reach every sample through the mean; the per-sample factors then miss
the cross terms (``G`` 0.36 off, relative; 957 times off on a Gramian hunt case). The checks
now also weigh the even- and the odd-numbered samples together.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own spelling
from torch import Tensor

import torchgram as tg
from reference import dense_gramian

B = 4
KEEP_MIDDLE = [0.0, 2.0, 2.0, 0.0]
"""The dropout mask (scaled) the seed below draws: the first and the last sample dropped."""


def _seed() -> int:
    """The first seed whose dropout mask over ``B`` values is :data:`KEEP_MIDDLE`."""
    for seed in range(1000):
        torch.manual_seed(seed)
        if F.dropout(torch.ones(B, dtype=torch.float64), 0.5).tolist() == KEEP_MIDDLE:
            return seed
    raise AssertionError("no seed draws the mask")


def _problem() -> tuple[dict[str, Tensor], Tensor]:
    generator = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(2, 1, dtype=torch.float64, generator=generator),
              "b": torch.randn(2, dtype=torch.float64, generator=generator)}
    return params, torch.randn(B, 1, dtype=torch.float64, generator=generator)


def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
    h = F.linear(x, p["w"], p["b"])
    h = h - h.mean(0, keepdim=True)  # every sample's row depends on every sample
    return F.dropout((h @ p["w"]).squeeze(-1), 0.5, training=True)


@pytest.mark.parametrize("backend", ["structured", "auto", "graph"])
def test_functional_backends(backend: str) -> None:
    params, x = _problem()
    seed = _seed()
    torch.manual_seed(seed)
    expected = dense_gramian(f, (params, x)).gramian
    assert expected[1:3].abs().sum() > 0 and expected[0].abs().sum() == 0  # the draw as meant
    torch.manual_seed(seed)
    G = tg.gramian(f, backend=backend, batch_dim=0)(params, x)
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("recorded", [True, False], ids=["record", "walk"])
def test_eager_gramian(recorded: bool) -> None:
    params, x = _problem()
    seed = _seed()
    torch.manual_seed(seed)
    expected = dense_gramian(f, (params, x)).gramian
    leaves = {name: value.clone().requires_grad_() for name, value in params.items()}
    torch.manual_seed(seed)
    if recorded:
        with tg.autograd.record():
            losses = f(leaves, x)
    else:
        losses = f(leaves, x)
    G = tg.autograd.gramian(losses, [leaves["b"], leaves["w"]], batch_dim=0)  # oracle order
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)
