"""Embedding conventions (padding_idx, scale_grad_by_freq, max_norm) on every backend.

NOTE [embedding conventions]: every backend must agree with ``torch.func.jacrev`` (reverse
mode's conventions), with batch structure or without, and a lookup with ``max_norm`` (which
renormalises rows in place) must leave the user's table unchanged.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import torchgram as tg
from reference import dense_gramian

DOUBLE = torch.float64
BACKENDS = ["jacobian", "ntvp", "graph", "structured", "auto"]
OPTIONS = {
    "padding_idx": dict(padding_idx=2),
    "scale_grad_by_freq": dict(scale_grad_by_freq=True),
    "max_norm": dict(max_norm=1.0),
    "all": dict(padding_idx=2, scale_grad_by_freq=True, max_norm=1.5),
}


def _tied_lm(options: dict) -> tuple:
    """A tied table: looked up with the options, and used as the output head."""
    torch.manual_seed(0)
    table = torch.randn(7, 3, dtype=DOUBLE) * 2

    def f(p: dict[str, Tensor], index: Tensor) -> Tensor:
        hidden = torch.tanh(F.embedding(index, p["table"], **options) * p["scale"])
        return torch.log_softmax(hidden @ p["table"].T, -1)[..., 0].sum(-1)

    params = {"table": table, "scale": torch.rand(3, dtype=DOUBLE) + 0.5}
    index = torch.tensor([[2, 1, 1, 4], [3, 2, 2, 6], [1, 5, 5, 5]])
    return f, params, index


@pytest.mark.parametrize("per_leaf", [False, True], ids=["summed", "per_leaf"])
@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "batch0"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_every_backend_agrees_with_jacrev(name: str, backend: str, batch_dim: int | None,
                                          per_leaf: bool) -> None:
    """``per_leaf`` with ``max_norm`` on ntvp: one jvp per leaf had the other leaves
    captured, and the renormalisation wrote into one (torch's raw RuntimeError, session 26):
    where ``f`` writes into its leaves, every jvp takes them all as inputs."""
    f, params, index = _tied_lm(OPTIONS[name])
    snapshot = {k: v.clone() for k, v in params.items()}
    dense = dense_gramian(f, ({k: v.clone() for k, v in params.items()}, index))
    G = tg.gramian(f, backend=backend, batch_dim=batch_dim, per_leaf=per_leaf)(params, index)
    pairs = zip([G[k] for k in sorted(G)], dense.blocks, strict=True) if per_leaf \
        else [(G, dense.gramian)]
    for actual, expected in pairs:
        scale = dense.gramian.abs().max()
        torch.testing.assert_close(actual / scale, expected / scale, rtol=1e-10, atol=1e-10)
    for key, value in params.items():  # max_norm renormalised copies, not the user's table
        assert torch.equal(value, snapshot[key])
