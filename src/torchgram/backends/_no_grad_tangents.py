"""Forward mode that stops at ``f``'s ``no_grad`` regions, as the backward does, for ntvp.

# NOTE [no_grad in forward mode]
# ``torch.no_grad()`` (and ``set_grad_enabled(False)``, ``inference_mode``) stops reverse-mode
# recording only: forward-mode AD, ``torch.func.jvp`` included, still pushes tangents through
# the ops run inside it (torch 2.13: the jvp of ``x * no_grad(3 x)`` is ``12`` at ``x = 2``,
# its gradient ``6``). ntvp computes column i of G as ``J (Jᵀ e_i)``: the backward's Jacobian,
# to which such a region contributes nothing, pushed forward by forward mode's, to which it
# does. An ``f`` with a stop-gradient written as a ``no_grad`` block (a target computed from
# the same network, an EMA buffer updated in the forward, a codebook update) gave a G that
# is neither the oracle's nor any Gramian (session 40: 1.7e-2 off, relative, with an EMA of
# the batch's activations subtracted in the forward). So ntvp's forward-mode pass runs under
# :class:`NoGradStopsTangents`, which detaches every tensor argument of a call made with grad
# mode off inside a pass entered with it on (``_push_forward`` enters it on): such a call's
# results carry no tangent, as they carry no gradient in the backward. Values are unchanged;
# an in-place call writes into the same memory through the detached alias. Under an
# enclosing forward-mode transform (the caller's ``jvp`` / ``jacfwd`` through ``G``) a detach
# would also stop the caller's tangents, which torch's convention sends through the region,
# and nothing stops ntvp's own alone: there a call with grad mode off raises
# :class:`GradOffInForwardMode`, and ntvp declines naming the backends that can (``auto``
# runs ``jacobian`` there first).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from torchgram._core.pytree import leaves_of, tree_map_tensors


class GradOffInForwardMode(RuntimeError):
    """A call with grad mode off in a forward-mode pass that cannot stop its tangents."""


class NoGradStopsTangents(TorchFunctionMode):
    """Calls made with grad mode off get their tensor arguments detached (NOTE above).

    Only when the mode was entered with grad mode on (else nothing tells ``f``'s regions
    apart from the caller's). ``refuse``: raise :class:`GradOffInForwardMode` instead.

    Example:
        >>> from torchgram.backends.ntvp import _prepare_forward_ad
        >>> _prepare_forward_ad()  # torch's first forward-mode product warns
        >>> def f(x):
        ...     with torch.no_grad():
        ...         y = x * 3
        ...     return y * x
        >>> x, t = torch.tensor([2.0]), torch.tensor([1.0])
        >>> with NoGradStopsTangents():
        ...     tangent = torch.func.jvp(f, (x,), (t,))[1]
        >>> tangent, torch.func.grad(lambda x: f(x).sum())(x)  # as the gradient
        (tensor([6.]), tensor([6.]))
    """

    def __init__(self, *, refuse: bool = False) -> None:
        super().__init__()
        self._grad_at_entry = True
        self._refuse = refuse

    def __enter__(self) -> NoGradStopsTangents:
        self._grad_at_entry = torch.is_grad_enabled()
        return super().__enter__()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if self._grad_at_entry and not torch.is_grad_enabled() \
                and any(isinstance(leaf, Tensor) for leaf in leaves_of((args, kwargs))):
            # (calls without tensors carry no tangent: the grad-mode switches themselves,
            # no_grad's exit restoring the mode, come through here too)
            if self._refuse:
                raise GradOffInForwardMode(getattr(func, "__name__", "a call"))
            args, kwargs = tree_map_tensors(Tensor.detach, (args, kwargs))
        return func(*args, **kwargs)
