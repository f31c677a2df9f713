"""torchgram: Gramians ``J Jᵀ`` of PyTorch Jacobians, torch.func-style.

Example:
    >>> import torch, torchgram as tg
    >>> f = lambda w, x: torch.tanh(x @ w)
    >>> tg.gramian(f)(torch.randn(3, 2), torch.randn(4, 3)).shape
    torch.Size([4, 2, 4, 2])
"""

from torchgram import autograd as autograd
from torchgram._api import gramian as gramian
from torchgram._functionalize import functionalize as functionalize

__all__ = ["autograd", "functionalize", "gramian"]
__version__ = "0.1.0"
