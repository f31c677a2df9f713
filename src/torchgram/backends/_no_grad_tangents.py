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

# NOTE [no_grad inside torch's own functions]
# The mode sees the calls ``f`` makes, not those made inside a torch function written in
# Python that it handles (a mode is off while it handles a call). torch 2.13's
# ``F.gaussian_nll_loss`` clamps its variance in place under ``no_grad``: a straight-through
# clamp, whose backward passes the gradient of every entry, clamped or not. Forward mode took
# clamp's derivative there, 0 for every variance below ``eps``, and ntvp's G was 0.99 off
# (relative; session 53's hunt of ``nn`` modules, a heteroscedastic regression head). The mode
# now calls it with a variance whose entries in ``[0, eps)`` are ``eps`` exactly and carry
# ``var``'s tangent (``var - var.detach() + eps``): the inner clamp changes no value and passes
# every tangent, as the backward does; a negative entry is left for torch to refuse. Under the
# caller's forward mode it raises :class:`GradOffInForwardMode`, as for any ``no_grad`` region.
# ``torch/nn/functional.py`` holds no other ``no_grad`` region in torch 2.13 but the embedding
# renorm of ``max_norm``, which NOTE [embedding conventions] handles.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from torchgram._core.census import _argument
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
        if func is F.gaussian_nll_loss and self._grad_at_entry and torch.is_grad_enabled():
            # NOTE [no_grad inside torch's own functions]
            if self._refuse:
                raise GradOffInForwardMode("gaussian_nll_loss (its clamp of var)")
            args, kwargs = _straight_through_variance(args, kwargs)
        if self._grad_at_entry and not torch.is_grad_enabled() \
                and any(isinstance(leaf, Tensor) for leaf in leaves_of((args, kwargs))):
            # (calls without tensors carry no tangent: the grad-mode switches themselves,
            # no_grad's exit restoring the mode, come through here too)
            if self._refuse:
                raise GradOffInForwardMode(getattr(func, "__name__", "a call"))
            args, kwargs = tree_map_tensors(Tensor.detach, (args, kwargs))
        return func(*args, **kwargs)


def _straight_through_variance(args: tuple[Any, ...], kwargs: dict[str, Any]
                               ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``gaussian_nll_loss``'s arguments with ``var`` clamped to ``eps`` straight through.

    NOTE [no_grad inside torch's own functions]: entries in ``[0, eps)`` become ``eps``
    exactly, with the tangent of ``var``; the others, NaN and negative ones included, stay.

    Example:
        >>> var = torch.tensor([1e-9, 0.5, -1.0])
        >>> _, kw = _straight_through_variance((), {"var": var, "eps": 1e-6})
        >>> kw["var"]
        tensor([ 1.0000e-06,  5.0000e-01, -1.0000e+00])
    """
    var = _argument(args, kwargs, 2, "var", None)
    if not isinstance(var, Tensor) or not var.is_floating_point():
        return args, kwargs  # a number: no tangent
    eps = _argument(args, kwargs, 4, "eps", 1e-6)
    clamped = torch.where((var < eps) & (var >= 0), var - var.detach() + eps, var)
    if len(args) > 2:
        return (*args[:2], clamped, *args[3:]), kwargs
    return args, {**kwargs, "var": clamped}
