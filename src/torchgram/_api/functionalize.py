"""``torchgram.functionalize``: an ``nn.Module`` as a pure function of its parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from torchgram._core.threads import MODULE_LOCK

_API = "torchgram.functionalize"


def functionalize(module: nn.Module) -> tuple[Callable[..., Any], dict[str, Tensor]]:
    """Split a module into a pure function and its trainable parameters.

    Args:
        module: Any ``nn.Module``.

    Returns:
        ``(fn, params)``. ``params`` maps each trainable parameter's name (as in
        ``module.named_parameters()``; a parameter tied under several names appears once)
        to a **detached** tensor sharing storage with the module's parameter.
        ``fn(params, *args, **kwargs)`` runs ``module(*args, **kwargs)`` through
        ``torch.func.functional_call`` with the given tensors in place of those parameters;
        frozen parameters (``requires_grad=False``) and buffers are the module's current
        ones. ``fn`` is pure: buffers the forward updates in place (e.g. BatchNorm running
        statistics) are updated on copies, so the module is never changed by a call. A
        subset of ``params`` may be passed; missing names use the module's own tensors.
        ``fn`` may be called from several threads: while it runs, the module's attributes
        are the call's tensors, so calls of functionalized modules run their forward
        passes one at a time (NOTE [threads]); do not use the module itself from another
        thread meanwhile.

    Raises:
        TypeError: If ``module`` is not an ``nn.Module`` (at build time) or ``params`` is not
            a mapping (at call time).
        KeyError: If ``params`` names a parameter the module does not have.

    Example:
        >>> import torch, torchgram as tg
        >>> model = torch.nn.Linear(3, 2)
        >>> fn, params = tg.functionalize(model)
        >>> sorted(params)
        ['bias', 'weight']
        >>> x = torch.randn(4, 3)
        >>> torch.allclose(fn(params, x), model(x))
        True
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"{_API}: expected an nn.Module, but got {type(module).__name__}. "
                        "For a plain function, pass it to tg.gramian directly.")
    params = {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}
    known = {name for name, _ in module.named_parameters(remove_duplicate=False)}

    def fn(params: dict[str, Tensor], /, *args: Any, **kwargs: Any) -> Any:
        if not hasattr(params, "keys"):
            raise TypeError(f"{_API}: fn expected a dict of parameters as its first argument, "
                            f"but got {type(params).__name__}. Call fn(params, *inputs).")
        unknown = sorted(set(params) - known)
        if unknown:
            raise KeyError(f"{_API}: fn got parameter name(s) {unknown} that "
                           f"{type(module).__name__} does not have. Valid names: "
                           f"{sorted(known)}.")
        with MODULE_LOCK:  # functional_call swaps the module's attributes: NOTE [threads]
            buffers = {name: b.clone() for name, b in module.named_buffers()}
            return torch.func.functional_call(module, {**buffers, **params}, args, kwargs,
                                              tie_weights=True, strict=False)

    fn.__doc__ = f"Pure function of {type(module).__name__}: fn(params, *args, **kwargs)."
    fn.__name__ = f"functional_{type(module).__name__}"
    return fn, params
