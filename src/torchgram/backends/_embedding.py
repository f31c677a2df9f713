"""Embedding lookups whose derivatives agree in every mode: NOTE [embedding conventions].

# NOTE [embedding conventions]
``F.embedding``'s reverse-mode derivative follows two conventions that are not derivatives
of the lookup: no gradient reaches the ``padding_idx`` row from the positions that hold it,
and with ``scale_grad_by_freq`` the gradient of row ``v`` is divided by the number of
times ``v`` appears in the call's index tensor. Its forward-mode derivative (``ntvp``'s jvp)
follows neither, and torch's batching rule for a per-sample weight (``vmap``) zeroes the
padding row of the first sample only. So wherever torchgram differentiates a lookup in
those modes, the call is rewritten into a plain lookup whose conventions are written out:

    out = embedding(index, W)                                   (same values)
    out = where(index == padding_idx, out.detach(), out)         (no derivative there)
    out = out.detach() + (out - out.detach()) / count[index]     (1/count derivative)

which has the same value and, in every mode, the derivative reverse mode defines (the one
``torch.func.jacrev`` and the oracle use). With ``max_norm`` the rows are first
renormalised in place, as ``F.embedding`` does (on copies of the user's table: NOTE
[probing]).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

_SIGNATURE = inspect.signature(F.embedding)


def embedding_with_conventions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``F.embedding(*args, **kwargs)`` written out (NOTE above), or ``NotImplemented``.

    Example:
        >>> W = torch.randn(5, 2, requires_grad=True)
        >>> index = torch.tensor([0, 3, 3])
        >>> out = embedding_with_conventions((index, W), {"padding_idx": 0})
        >>> torch.equal(out, F.embedding(index, W, padding_idx=0))
        True
        >>> out.sum().backward(); W.grad[0]
        tensor([0., 0.])
    """
    try:
        bound = _SIGNATURE.bind(*args, **kwargs)
    except TypeError:
        return NotImplemented
    a = bound.arguments
    padding_idx = a.get("padding_idx")
    by_freq = a.get("scale_grad_by_freq", False)
    index, weight = a["input"], a["weight"]
    if (padding_idx is None and not by_freq) or a.get("sparse", False) \
            or not isinstance(weight, Tensor):
        return NotImplemented
    max_norm = a.get("max_norm")
    if max_norm is not None:  # what F.embedding does first: rows renormalised in place
        with torch.no_grad():
            torch.embedding_renorm_(weight.detach(), index.contiguous(), max_norm,
                                    a.get("norm_type", 2.0))
    out = F.embedding(index, weight)
    if padding_idx is not None:
        padding = (index == padding_idx % weight.shape[0]).unsqueeze(-1)
        out = torch.where(padding, out.detach(), out)
    if by_freq:
        counts = torch.bincount(index.reshape(-1), minlength=weight.shape[0])[index]
        scale = (1.0 / counts.to(out.dtype)).unsqueeze(-1)
        out = out.detach() + (out - out.detach()) * scale
    return out


class EmbeddingConventions(TorchFunctionMode):
    """Runs every ``F.embedding`` call as :func:`embedding_with_conventions`."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.embedding:
            result = embedding_with_conventions(args, kwargs)
            if result is not NotImplemented:
                return result
        return func(*args, **kwargs)
