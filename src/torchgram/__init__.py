"""torchgram: Gramians ``J Jᵀ`` of PyTorch Jacobians, torch.func-style.

Example:
    >>> import torch, torchgram as tg
    >>> f = lambda w, x: torch.tanh(x @ w)
    >>> tg.gramian(f)(torch.randn(3, 2), torch.randn(4, 3)).shape
    torch.Size([4, 2, 4, 2])
"""

from torchgram import autograd as autograd
from torchgram import weighting as weighting
from torchgram._aggregate import Aggregation as Aggregation
from torchgram._aggregate import aggregated_grad as aggregated_grad
from torchgram._api import gramian as gramian
from torchgram._explain import explain as explain
from torchgram._functionalize import functionalize as functionalize

__all__ = [
    "Aggregation",
    "aggregated_grad",
    "autograd",
    "explain",
    "functionalize",
    "gramian",
    "weighting",
]
__version__ = "0.1.0"
