"""Recurrent cells (``nn.LSTMCell`` / ``nn.GRUCell`` / ``nn.RNNCell``): rewritten into their
projections (NOTE [cell rewrite]), on the batched pass, against the oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchgram as tg
from helpers import assert_batched_on_every_draw
from torchgram.backends.structured.rules.cells import (
    rewrite_gru_cell,
    rewrite_lstm_cell,
    rewrite_rnn_relu_cell,
    rewrite_rnn_tanh_cell,
)

B, T, D, H = 3, 4, 5, 6

CELLS = {
    "lstm": (lambda bias: nn.LSTMCell(D, H, bias=bias), rewrite_lstm_cell),
    "gru": (lambda bias: nn.GRUCell(D, H, bias=bias), rewrite_gru_cell),
    "rnn_tanh": (lambda bias: nn.RNNCell(D, H, bias=bias), rewrite_rnn_tanh_cell),
    "rnn_relu": (lambda bias: nn.RNNCell(D, H, bias=bias, nonlinearity="relu"),
                 rewrite_rnn_relu_cell),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("kind", list(CELLS))
def test_rewrite_gives_the_kernels_values_and_layout(kind, bias, dtype):
    torch.manual_seed(0)
    make, rewrite = CELLS[kind]
    cell = make(bias).to(dtype)
    x, h, c = (torch.randn(B, n, dtype=dtype) for n in (D, H, H))
    state = (h, c) if kind == "lstm" else h
    expected = cell(x, state)
    args = (x, state, cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
    out = rewrite(args, {})
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12,
                                                                             "atol": 1e-14}
    for actual, want in zip(*((out, expected) if kind == "lstm" else ((out,), (expected,))),
                            strict=True):
        torch.testing.assert_close(actual, want, **tolerance)
        assert actual.stride() == want.stride()


def test_rewrite_declines_what_it_does_not_cover():
    cell = nn.GRUCell(D, H)
    weights = (cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
    x, h = torch.randn(B, D), torch.randn(B, H)
    assert rewrite_gru_cell((x, h, *weights), {}) is not NotImplemented
    assert rewrite_gru_cell((x[0], h[0], *weights), {}) is NotImplemented  # unbatched
    assert rewrite_gru_cell((x.double(), h.double(), *weights), {}) is NotImplemented  # dtypes
    assert rewrite_gru_cell((x, h), {}) is NotImplemented  # not a cell call
    assert rewrite_gru_cell((x, h, *weights), {"other": 1}) is NotImplemented
    assert rewrite_lstm_cell((x, h, *weights), {}) is NotImplemented  # LSTM takes (h, c)


class CellLoop(nn.Module):
    """A decoder-style loop: one cell over the steps, dropout on its inputs, a head."""

    def __init__(self, kind: str, dropout: float) -> None:
        super().__init__()
        self.cell = CELLS[kind][0](True)
        self.kind, self.dropout = kind, dropout
        self.head = nn.Linear(H, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = x.new_zeros(x.shape[0], H)
        for t in range(x.shape[1]):
            step = F.dropout(x[:, t], self.dropout, self.training)
            if self.kind == "lstm":
                h, c = self.cell(step, (h, c))
            else:
                h = self.cell(step, h)
        return self.head(h).pow(2).sum(-1)


@pytest.mark.parametrize("backend", ["structured", "auto"])
@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["plain", "dropout"])
@pytest.mark.parametrize("kind", list(CELLS))
def test_cell_loops_are_batched_and_match_oracle(kind, dropout, backend):
    """Before session 47 the cells' weights took the fallback: the samples ran in a loop
    (``vmap`` has no batching rule for the cells), or with dropout the rows of the whole
    batch."""
    torch.manual_seed(0)
    fn, params = tg.functionalize(CellLoop(kind, dropout).double().train())
    x = torch.randn(B, T, D, dtype=torch.float64)
    assert_batched_on_every_draw(fn, params, [torch.randn_like(x), x], backend=backend)
    if backend == "auto":  # vmap would loop over the samples: auto says structured
        assert tg.explain(fn, batch_dim=0)(params, x).backend == "structured"
