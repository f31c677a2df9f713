"""Imperative API: Gramians of an autograd graph that already exists (``backend="graph"``).

Example:
    >>> import torch, torchgram as tg
    >>> w = torch.randn(3, requires_grad=True)
    >>> losses = (torch.randn(4, 3) @ w).sin()
    >>> tg.autograd.gramian(losses, w).shape
    torch.Size([4, 4])
"""

from torchgram._api.autograd import gramian as gramian
from torchgram._api.autograd_explain import EagerExplanation as EagerExplanation
from torchgram._api.autograd_explain import InputReport as InputReport
from torchgram._api.autograd_explain import explain as explain
from torchgram._api.weighted_backward import BackwardInfo as BackwardInfo
from torchgram._api.weighted_backward import backward as backward
from torchgram._core.scratch import release_scratch as release_scratch
from torchgram.backends.eager.record import Recording as Recording
from torchgram.backends.eager.record import record as record

__all__ = ["BackwardInfo", "EagerExplanation", "InputReport", "Recording", "backward",
           "explain", "gramian", "record", "release_scratch"]
