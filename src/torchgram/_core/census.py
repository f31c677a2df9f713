"""Which calls ``f`` makes that change how it may be differentiated, seen while it runs.

A ``TorchFunctionMode`` sees every torch function call ``f`` makes. :class:`OpCensus`
records two kinds (it runs during one evaluation that happens anyway: the probe, or the
evaluation of the whole batch that per-sample ways check against):

* calls that make samples interact (NOTE [per-sample]): batch-norm with batch statistics,
  an embedding with ``scale_grad_by_freq``;
* calls whose backward torch's ``vmap`` computes wrongly (``_torch_compat``'s list): every
  backend then computes the rows' vjps one at a time where it would have vmapped them.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from torchgram._core import _torch_compat

_BATCH_NORM = inspect.signature(F.batch_norm)
_EMBEDDING = inspect.signature(F.embedding)


def coupling_op(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why a torch function call makes samples interact, or ``None``.

    Example:
        >>> import torch
        >>> x = torch.randn(4, 3)
        >>> coupling_op(F.batch_norm, (x, None, None), {"training": True})
        'batch_norm in training mode (statistics of the whole batch)'
        >>> coupling_op(F.batch_norm, (x, torch.zeros(3), torch.ones(3)), {}) is None
        True
    """
    try:
        if func is F.batch_norm:
            bound = _BATCH_NORM.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            if a["training"] or a["running_mean"] is None or a["running_var"] is None:
                return "batch_norm in training mode (statistics of the whole batch)"
        if func is F.embedding:
            bound = _EMBEDDING.bind(*args, **kwargs)
            bound.apply_defaults()
            if bound.arguments["scale_grad_by_freq"]:
                return ("embedding(scale_grad_by_freq=True) (gradients divided by token counts "
                        "over the whole batch)")
    except TypeError:  # a call we cannot read: not one of these
        return None
    return None


class OpCensus(TorchFunctionMode):
    """Records, while ``f`` runs, the calls that matter to how it may be differentiated.

    Attributes:
        coupling: Calls that make samples interact (:func:`coupling_op`).
        unbatched: Calls whose backward ``vmap`` gets wrong (``_torch_compat``): the rows'
            vjps then run one at a time.
    """

    def __init__(self) -> None:
        super().__init__()
        self.coupling: list[str] = []
        self.unbatched: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        why = coupling_op(func, args, kwargs)
        if why is not None and why not in self.coupling:
            self.coupling.append(why)
        name = _torch_compat.wrong_batched_backward(func)
        if name is not None and name not in self.unbatched:
            self.unbatched.append(name)
        return func(*args, **kwargs)
