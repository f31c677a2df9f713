"""PReLU as ``torch.where`` in torchgram's evaluations of an ``f`` that calls it.

# NOTE [prelu as where]
torch 2.13's batching rule for the backward of ``prelu`` (``PreluKernelBackward0``) is
wrong under nested ``vmap``: per-sample vjps of several rows each (a ``vmap`` over the
samples around a ``vmap`` over the rows, as the jacobian and ntvp backends' per-sample ways
and the kernels' make them) raise "The size of tensor a (3) must match the size of tensor
b (2)" or, where the two batch sizes are equal, return wrong values without a word: a
PReLU network's per-sample Gramian with two samples of two outputs was 0.27 off (relative)
on jacobian and auto, 0.25 on ntvp (session 39, trying activations at their kinks by hand).
Its forward-mode derivative at ``x = 0`` is also not its backward's (slope 1 against the
negative slope ``w``: NOTE [kinks in forward mode]), nor is its double backward the
derivative of its backward there (the backward scales the cotangent by ``w``, the double
backward differentiates it as if by 1: ``G``'s gradient through a prelu at 0 was wrong, in
torch's own ``jacrev`` too), and the structured backend had no rule for its weight (the
whole model then ran one sample at a time).

So when the probe sees ``f`` call ``prelu`` (``Probe.decomposed``), every later evaluation
of ``f`` runs under :class:`PreluAsWhere`: ``torch.where(x > 0, x, w * x)`` with ``w``
shaped to broadcast along the channel dim (dim 1; a single slope for every entry), the
same values and, in every mode, the backward's derivatives (the branch ``where`` takes:
``w`` at ``x = 0``). Its ops have correct batching rules, and ``w * x`` is an elementwise
parameter use the structured backend's rules cover. Under ``torch.autocast`` the operands
are cast as autocast casts prelu's (to the autocast dtype). Two calls run as they are: one
torch refuses (slopes that match no channel dim, operands of different dtypes outside
autocast), so that torch says why, and one inside a non-reentrant ``torch.utils.checkpoint``
region, whose backward recomputes the region without the mode (torch refuses a
recomputation that saves other tensors: ``CheckpointError``). Evaluations under a cached
probe that did not see ``prelu`` and then meet it start over (NOTE [stale probes]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from torchgram._core import _torch_compat

PRELU = "torch.prelu"
"""The name under which probes record that ``f`` calls ``prelu``."""

_PRELU_CALLS = frozenset({torch.prelu, Tensor.prelu})


def calls_prelu(func: Any) -> bool:
    """Whether ``func`` is ``prelu`` (``F.prelu`` is ``torch.prelu``).

    Example:
        >>> calls_prelu(torch.nn.functional.prelu), calls_prelu(torch.relu)
        (True, False)
    """
    try:
        return func in _PRELU_CALLS
    except TypeError:  # unhashable callables
        return False


def prelu_as_where(x: Any, weight: Any) -> Tensor | None:
    """``prelu(x, weight)`` as ``torch.where`` (NOTE [prelu as where]), or ``None``.

    ``None`` for a call torch refuses, which then runs as it is.

    Example:
        >>> x, w = torch.randn(2, 3, 4), torch.rand(3)
        >>> torch.equal(prelu_as_where(x, w), torch.prelu(x, w))
        True
    """
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor) \
            or not x.is_floating_point() or not weight.is_floating_point():
        return None
    device = x.device.type
    if torch.is_autocast_enabled(device):  # prelu is on autocast's lower-precision list,
        dtype = torch.get_autocast_dtype(device)  # which casts every floating operand but
        x, weight = (t if t.dtype == torch.float64 else t.to(dtype) for t in (x, weight))
    if x.dtype != weight.dtype:  # float64 ones
        return None
    if weight.numel() == 1:
        slope = weight.reshape(())
    elif x.dim() >= 2 and x.shape[1] == weight.numel() and weight.dim() == 1:
        slope = weight.reshape(1, -1, *([1] * (x.dim() - 2)))
    else:
        return None
    return torch.where(x > 0, x, slope * x)


class PreluAsWhere(TorchFunctionMode):
    """Runs ``prelu`` as ``torch.where`` (NOTE [prelu as where]); other calls unchanged.

    Not under saved-tensor hooks that were not in force when it was made: a non-reentrant
    ``torch.utils.checkpoint`` region's backward recomputes the region without this mode,
    and torch refuses a recomputation that saves other tensors than the forward did
    (``CheckpointError``); there prelu runs as it is.

    Example:
        >>> x = torch.tensor([[-1.0, 0.0, 2.0]], requires_grad=True)
        >>> with PreluAsWhere():
        ...     y = torch.nn.functional.prelu(x, torch.tensor([0.25]))
        >>> y.detach(), y.grad_fn.name()  # not PreluKernelBackward0
        (tensor([[-0.2500,  0.0000,  2.0000]]), 'WhereBackward0')
    """

    def __init__(self) -> None:
        super().__init__()
        self._hooks_at_entry = _torch_compat.saved_tensor_hooks()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if calls_prelu(func) and _torch_compat.saved_tensor_hooks() == self._hooks_at_entry:
            x = args[0] if args else kwargs.get("input")
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            result = prelu_as_where(x, weight)
            if result is not None:
                return result
        return func(*args, **kwargs)
