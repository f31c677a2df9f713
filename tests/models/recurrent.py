"""Recurrent classifiers: ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` and unrolled cells, float64.

Each returns per-sample cross-entropy losses ``[B]`` of a linear head on the last hidden
state. ``B = 3`` sequences of ``T = 4`` steps of 4 features, 3 classes.

* ``lstm``: batch-first, output at the last step;
* ``gru-bidir``: sequence-first (``[T, B, F]``, so ``in_dims=(1, 0)``), bidirectional, final
  hidden states of both directions;
* ``rnn-2layer``: batch-first, 2 layers, ReLU;
* ``lstm-lengths``: right-padded sequences of different lengths, the output taken at each
  sample's last real step (lengths are an int64 input, split per sample);
* ``lstm-dropout``: 2 layers with inter-layer dropout, train mode (one random draw);
* ``lstmcell`` / ``grucell``: ``nn.LSTMCell`` / ``nn.GRUCell`` unrolled in Python.

* ``lstm-packed``: the same padded sequences through ``nn.utils.rnn.pack_padded_sequence``
  (lengths an int64 input, split per sample), head on the final hidden state. torch 2.13 runs
  the fused LSTM over a ``PackedSequence`` under no ``torch.func`` transform (``RuntimeError:
  Cannot access data pointer of Tensor that doesn't have storage``): ``jacobian``, ``ntvp``
  and the structured per-sample way decline, naming ``graph``; the oracle loops over rows
  (``jacrev(chunk_size=1)``), which does not vmap the backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.case import ModelCase, module_case

BATCH, STEPS, FEATURES, CLASSES = 3, 4, 4, 3


class LastStep(nn.Module):
    """``rnn`` over a ``[B, T, F]`` batch (or ``[T, B, F]``), head on the last output step."""

    def __init__(self, rnn: nn.RNNBase, hidden: int) -> None:
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(x)
        last = out[:, -1] if self.rnn.batch_first else out[-1]
        return self.head(last)


class FinalHidden(nn.Module):
    """Head on the final hidden state(s) ``h_n`` of the last layer (both directions)."""

    def __init__(self, rnn: nn.RNNBase, hidden: int) -> None:
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(hidden * (2 if rnn.bidirectional else 1), CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        _, h_n = self.rnn(x)
        if isinstance(h_n, tuple):  # LSTM: (h_n, c_n)
            h_n = h_n[0]
        directions = 2 if self.rnn.bidirectional else 1
        last_layer = h_n[-directions:]  # [directions, B, H]
        return self.head(last_layer.transpose(0, 1).flatten(1))


class AtLength(nn.Module):
    """LSTM over right-padded sequences; head on the output at each sample's last real step."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(FEATURES, 5, batch_first=True)
        self.head = nn.Linear(5, CLASSES)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        out, _ = self.rnn(x)  # [B, T, H]
        index = (lengths - 1).view(-1, 1, 1).expand(-1, 1, out.shape[-1])
        return self.head(out.gather(1, index).squeeze(1))


class Packed(AtLength):
    """The same LSTM over a ``PackedSequence`` of the padded sequences; head on ``h_n``."""

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                   enforce_sorted=False)
        _, (h_n, _) = self.rnn(packed)
        return self.head(h_n[-1])


class UnrolledCell(nn.Module):
    """An ``nn.LSTMCell`` or ``nn.GRUCell`` applied step by step (a Python loop)."""

    def __init__(self, cell: nn.LSTMCell | nn.GRUCell) -> None:
        super().__init__()
        self.cell = cell
        self.head = nn.Linear(cell.hidden_size, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        zeros = x.new_zeros(x.shape[0], self.cell.hidden_size)
        state: Tensor | tuple[Tensor, Tensor] = (
            (zeros, zeros) if isinstance(self.cell, nn.LSTMCell) else zeros)
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
        hidden = state[0] if isinstance(state, tuple) else state
        return self.head(hidden)


def cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-sample losses ``[B]``."""
    return F.cross_entropy(logits, labels, reduction="none")


def _case(name: str, model: nn.Module, *, seq_first: bool = False, **extra: Any) -> ModelCase:
    model.to(torch.float64)
    shape = (STEPS, BATCH, FEATURES) if seq_first else (BATCH, STEPS, FEATURES)
    x = torch.randn(shape, dtype=torch.float64)
    labels = torch.randint(0, CLASSES, (BATCH,))
    in_dims = (1, 0) if seq_first else 0
    return module_case(name, model, (x, labels), head=cross_entropy, in_dims=in_dims,
                       output_shape=(BATCH,), **extra)


def lstm() -> ModelCase:
    return _case("lstm", LastStep(nn.LSTM(FEATURES, 6, batch_first=True), 6),
                 note="nn.LSTM, batch_first, last output step")


def gru_bidir() -> ModelCase:
    return _case("gru-bidir", FinalHidden(nn.GRU(FEATURES, 5, bidirectional=True), 5),
                 seq_first=True, note="nn.GRU, [T, B, F] input (in_dims=(1, 0)), bidirectional")


def rnn_2layer() -> ModelCase:
    rnn = nn.RNN(FEATURES, 5, num_layers=2, nonlinearity="relu", batch_first=True)
    return _case("rnn-2layer", FinalHidden(rnn, 5), note="nn.RNN, 2 layers, ReLU, batch_first")


def lstm_lengths() -> ModelCase:
    model = AtLength().to(torch.float64)
    lengths = torch.tensor([2, STEPS, 3])
    x = torch.randn(BATCH, STEPS, FEATURES, dtype=torch.float64)
    for b, length in enumerate(lengths.tolist()):
        x[b, length:] = 0.0
    labels = torch.randint(0, CLASSES, (BATCH,))
    return module_case("lstm-lengths", model, (x, lengths, labels), model_inputs=2,
                       head=cross_entropy, output_shape=(BATCH,),
                       note="nn.LSTM on padded sequences, output gathered at each length")


def lstm_packed() -> ModelCase:
    model = Packed().to(torch.float64)
    lengths = torch.tensor([2, STEPS, 3])
    x = torch.randn(BATCH, STEPS, FEATURES, dtype=torch.float64)
    labels = torch.randint(0, CLASSES, (BATCH,))
    return module_case("lstm-packed", model, (x, lengths, labels), model_inputs=2,
                       head=cross_entropy, output_shape=(BATCH,),
                       note="nn.LSTM over pack_padded_sequence (no torch.func transform)")


def lstm_dropout() -> ModelCase:
    model = FinalHidden(nn.LSTM(FEATURES, 5, num_layers=2, dropout=0.3, batch_first=True), 5)
    model.train()
    return _case("lstm-dropout", model, seed=4321,
                 note="nn.LSTM, 2 layers, dropout 0.3 between layers, train mode")


def lstmcell() -> ModelCase:
    return _case("lstmcell", UnrolledCell(nn.LSTMCell(FEATURES, 6)), note="nn.LSTMCell unrolled")


def grucell() -> ModelCase:
    return _case("grucell", UnrolledCell(nn.GRUCell(FEATURES, 6)), note="nn.GRUCell unrolled")


BUILDERS: dict[str, Callable[[], ModelCase]] = {
    "lstm": lstm,
    "gru-bidir": gru_bidir,
    "rnn-2layer": rnn_2layer,
    "lstm-lengths": lstm_lengths,
    "lstm-packed": lstm_packed,
    "lstm-dropout": lstm_dropout,
    "lstmcell": lstmcell,
    "grucell": grucell,
}
