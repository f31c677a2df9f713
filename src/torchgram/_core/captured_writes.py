"""``f`` writing into tensors it did not make: refused before the write, in the probe.

NOTE [captured writes]
torchgram evaluates ``f`` several times per call (the probe, the passes, the per-sample
checks), so an ``f`` that writes into a tensor it captured or received -- a module buffer
updated in place by its forward when ``f`` is ``functional_call(model, p, (x,))`` (an EMA of
activations, a step counter other than batch norm's, a codebook), or its own input changed
in place -- changes the caller's tensor once per evaluation, and each evaluation computes
another function. Before session 40 ``structured`` and ``auto`` gave wrong matrices there
(0.17 and 0.47 off, relative, an EMA subtracted in the forward) and ``graph`` the right one,
all three leaving the caller's buffer updated several times (``jacobian`` and ``ntvp``
declined: torch refuses such writes under its transforms). The probe, ``f``'s first
evaluation for a call signature, runs under :class:`CapturedWrites`: a write (a method
ending in ``_``, ``copy_``, item assignment, an ``out=`` argument) into a tensor that no call
of this evaluation made -- nor a view of one -- raises :class:`CapturedWrite` before it
happens, which the API turns into a ``ValueError`` naming the fix (``tg.functionalize``,
whose calls work on copies of the module's buffers). The leaves' copies that the probe gives
``f`` count as its own (an embedding's ``max_norm`` renormalises its table in place: NOTE
[probing]); batch norm's running statistics never reach the mode (NOTE [frozen running
statistics] drops them first).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor
from torch.overrides import TorchFunctionMode

from torchgram._core.pytree import leaves_of

_NOT_WRITES = frozenset({"requires_grad_", "retain_grad", "share_memory_", "record_stream",
                         "register_hook", "pin_memory", "__torch_function__"})
"""Methods ending in ``_`` that change no entries (flags, hooks, placement)."""


class CapturedWrite(RuntimeError):
    """``f`` was about to write into a tensor it did not make (NOTE [captured writes])."""


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """The tensor ``func`` writes into, or ``None`` for a call that writes into none."""
    out = kwargs.get("out")
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    name = getattr(func, "__name__", "")
    if not args or not isinstance(args[0], Tensor) or name in _NOT_WRITES:
        return None
    if name == "__setitem__" or (name.endswith("_") and not name.startswith("__")):
        return args[0]
    return None


def _root(tensor: Tensor) -> Tensor:
    while tensor._base is not None:
        tensor = tensor._base
    return tensor


class CapturedWrites(TorchFunctionMode):
    """Raises :class:`CapturedWrite` before a write into a tensor no call here made.

    Args:
        own: Tensors given to ``f`` that count as its own (the probe's leaf copies).

    Example:
        >>> import torch
        >>> buffer = torch.zeros(3)
        >>> with CapturedWrites(()):
        ...     h = torch.ones(3) * 2
        ...     h.add_(1)  # made here: fine
        ...     buffer.add_(h)  # captured
        Traceback (most recent call last):
        ...
        torchgram._core.captured_writes.CapturedWrite: add_
    """

    def __init__(self, own: Iterable[Tensor]) -> None:
        super().__init__()
        self._own = list(own)  # alive while the mode lives: their ids stay theirs
        self._made: set[int] = {id(_root(tensor)) for tensor in self._own}

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        target = _written(func, args, kwargs)
        if target is not None and id(_root(target)) not in self._made:
            raise CapturedWrite(getattr(func, "__name__", "a write"))
        result = func(*args, **kwargs)
        # (ids of made tensors need no pins: a tensor that existed before the evaluation keeps
        # its id throughout, so a freed one's id can only go to another made here)
        for leaf in leaves_of(result):
            if isinstance(leaf, Tensor):
                self._made.add(id(_root(leaf)))
        return result

