"""torchgram: Gramians ``J Jᵀ`` of PyTorch Jacobians, torch.func-style.

Example:
    >>> import torch, torchgram as tg
    >>> f = lambda w, x: torch.tanh(x @ w)
    >>> tg.gramian(f)(torch.randn(3, 2), torch.randn(4, 3)).shape
    torch.Size([4, 2, 4, 2])
"""

from torchgram import autograd as autograd
from torchgram import ntk as ntk
from torchgram import weighting as weighting
from torchgram._api.aggregate import Aggregation as Aggregation
from torchgram._api.aggregate import aggregated_grad as aggregated_grad
from torchgram._api.explain import Explanation as Explanation
from torchgram._api.explain import explain as explain
from torchgram._api.functionalize import functionalize as functionalize
from torchgram._api.gramian import gramian as gramian
from torchgram._api.independence import Independence as Independence
from torchgram._api.independence import check_independence as check_independence
from torchgram._api.step_times import StepTimes as StepTimes
from torchgram._core.errors import BackendCannotRun as BackendCannotRun

__all__ = [
    "Aggregation",
    "BackendCannotRun",
    "Explanation",
    "Independence",
    "StepTimes",
    "aggregated_grad",
    "autograd",
    "check_independence",
    "explain",
    "functionalize",
    "gramian",
    "ntk",
    "weighting",
]
__version__ = "0.1.0"
