"""The caller's ``torch.autocast`` and function modes reach ``f``'s evaluations only.

NOTE [autocast], NOTE [the caller's function modes].

# NOTE [autocast]
A call made inside ``torch.autocast`` ran all of torchgram's own work there too: the Gram
contractions (``J Jᵀ``, the ghost and materialized blocks, the kernels' products) are
matmuls, which autocast casts to its lower precision, so a float32 ``G`` carried bfloat16
round-off that ``f`` never had: 2.8e-3 relative on every backend but ntvp, on
``tg.autograd.gramian`` and the kernels, for an ``f`` whose Jacobian is exact (session 59's
hunt); ``empirical_ntk_fn(backend="structured", vmap_axes=None)`` met torch's raw "Expected
out tensor to have dtype float" from a ``bmm(out=)``. Every public entry point now runs its
call with autocast off (:func:`outside_caller_context`, applied by ``public_call``), and
each evaluation of ``f`` runs under the caller's autocast again (:func:`caller_context`, in
``problem.evaluate_f``), so ``f`` computes what it computes in the caller's region -- its
output's dtype included, which stays ``G``'s -- and the rest runs in the dtypes of ``f``'s
tensors. Backward nodes do not depend on autocast (their saved tensors carry the dtypes).

# NOTE [the caller's function modes]
A ``TorchFunctionMode`` the caller entered around the call (a mode that rewrites what an
op returns: fake quantisation, a scale) sat *beneath* the structured backend's tapping mode,
which therefore tapped ``F.linear``'s output after the caller's mode had rewritten it
(``2 · linear(x, W)``) while its factors were those of ``linear(x, W)``: G 0.75 off on
``structured``, ``auto`` and the kernels, and under ``tg.autograd.record()`` entered inside
the mode (session 59's hunt). Around each evaluation of ``f`` the caller's modes are now
moved above torchgram's own (:func:`caller_context`; ``record()`` puts its mode beneath
them, :func:`beneath_caller_modes`), so they see ``f``'s calls first, as in a plain call,
and torchgram's modes see what they return; the stack is put back as it was afterwards.
The modes stay active for the rest of the call, as they would for a plain backward: a
non-reentrant ``torch.utils.checkpoint`` region in ``f`` recomputes its forward during
torchgram's backward passes, which must see them too (lifting them for the call made that
recomputation differ from the forward: 0.13 off on every backend that ran; the review of
session 59). ``torch.device(...)`` contexts alone (``DeviceContext``) need no reordering.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import DeviceContext

_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla", "ipu")

AutocastState = tuple[tuple[str, torch.dtype, bool], ...]
"""Each enabled autocast: ``(device type, dtype, cache enabled)``."""

_CALLER: ContextVar[AutocastState] = ContextVar("torchgram_caller_autocast", default=())
_CALLER_MODES: ContextVar[tuple[TorchFunctionMode, ...]] = ContextVar(
    "torchgram_caller_function_modes", default=())


def enabled_autocasts() -> AutocastState:
    """The autocast regions enabled in this thread, one per device type.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     enabled_autocasts()
        (('cpu', torch.bfloat16, True),)
        >>> enabled_autocasts()
        ()
    """
    if not torch._C._is_any_autocast_enabled():  # the common case, ~0.1 µs
        return ()
    cache = torch.is_autocast_cache_enabled()
    return tuple((device, torch.get_autocast_dtype(device), cache) for device in _DEVICE_TYPES
                 if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device))


def caller_function_modes() -> tuple[TorchFunctionMode, ...]:
    """The function modes active here, bottom first, if any is more than a device context.

    Example:
        >>> caller_function_modes()
        ()
        >>> with torch.device("cpu"):
        ...     caller_function_modes()
        ()
    """
    if not torch._C._len_torch_function_stack():
        return ()
    stack = torch.overrides._get_current_function_mode_stack()
    if all(isinstance(mode, DeviceContext) for mode in stack):
        return ()
    return tuple(stack)


def plain_caller_context() -> bool:
    """No autocast, no function mode, and no public call's context to hide: nothing to do."""
    return (not torch._C._is_any_autocast_enabled() and not torch._C._len_torch_function_stack()
            and not _CALLER.get() and not _CALLER_MODES.get())


@contextlib.contextmanager
def outside_caller_context() -> Iterator[None]:
    """The body without the caller's autocast; its function modes noted for ``f``.

    :func:`caller_context` puts the autocast back and moves the modes on top around each
    evaluation of ``f`` (NOTE [autocast], NOTE [the caller's function modes]).
    """
    token = _CALLER_MODES.set(caller_function_modes())
    try:
        with outside_autocast():
            yield
    finally:
        _CALLER_MODES.reset(token)


def _replace_mode_stack(modes: list[TorchFunctionMode]) -> None:
    """The function-mode stack made ``modes`` (bottom first)."""
    for _ in range(torch._C._len_torch_function_stack()):
        torch.overrides._pop_mode()
    for mode in modes:
        torch.overrides._push_mode(mode)


@contextlib.contextmanager
def _on_top(modes: tuple[TorchFunctionMode, ...]) -> Iterator[None]:
    """The caller's ``modes`` moved above every other mode; the stack as it was after."""
    if not modes:
        yield
        return
    stack = torch.overrides._get_current_function_mode_stack()
    present = [mode for mode in modes if any(mode is entry for entry in stack)]
    others = [entry for entry in stack if not any(entry is mode for mode in present)]
    _replace_mode_stack(others + present)
    try:
        yield
    finally:  # the order as it was, less what the body exited, plus what it left entered
        now = torch.overrides._get_current_function_mode_stack()
        kept = [entry for entry in stack if any(entry is mode for mode in now)]
        left = [mode for mode in now if not any(mode is entry for entry in stack)]
        _replace_mode_stack(kept + left)


@contextlib.contextmanager
def beneath_caller_modes(mode: TorchFunctionMode) -> Iterator[None]:
    """``mode`` entered beneath the caller's function modes, which keep the first look.

    Example:
        >>> from torch.overrides import TorchFunctionMode
        >>> outer, inner = TorchFunctionMode(), TorchFunctionMode()
        >>> with outer, beneath_caller_modes(inner):
        ...     stack = torch.overrides._get_current_function_mode_stack()
        >>> stack[0] is inner and stack[1] is outer
        True
    """
    modes = caller_function_modes()
    with mode, _on_top(modes):
        yield


@contextlib.contextmanager
def caller_context() -> Iterator[None]:
    """The caller's autocast, and its function modes on top of torchgram's (around ``f``)."""
    modes = _CALLER_MODES.get()
    if not modes and not _CALLER.get():
        yield
        return
    with _on_top(modes), caller_autocast():
        yield


@contextlib.contextmanager
def outside_autocast() -> Iterator[None]:
    """The body with autocast off; :func:`caller_autocast` then restores the caller's.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), outside_autocast():
        ...     off = (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        ...     with caller_autocast():
        ...         on = (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        >>> off, on
        (torch.float32, torch.bfloat16)
    """
    state = enabled_autocasts()
    token = _CALLER.set(state)
    try:
        if not state:
            yield
            return
        with contextlib.ExitStack() as stack:
            for device, _, _ in state:
                stack.enter_context(torch.autocast(device, enabled=False))
            yield
    finally:
        _CALLER.reset(token)


@contextlib.contextmanager
def caller_autocast() -> Iterator[None]:
    """The autocast regions the public call was made in (none outside one)."""
    state = _CALLER.get()
    if not state:
        yield
        return
    with contextlib.ExitStack() as stack:
        for device, dtype, cache in state:
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache))
        yield


def caller_autocast_state() -> AutocastState:
    """The autocast regions of the public call being made (``()`` outside one)."""
    return _CALLER.get()
