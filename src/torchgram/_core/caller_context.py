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
The same holds for a ``TorchFunctionMode`` the caller entered around the call (a mode that
rewrites what an op returns: fake quantisation, a scale). The structured backend's tapping
mode was pushed on top of it, so it tapped ``F.linear``'s output *after* the caller's mode
had rewritten it (``2 · linear(x, W)``) while its factors were those of ``linear(x, W)``:
G 0.75 off on ``structured``, ``auto`` and the kernels (session 59's hunt); and such a mode
saw torchgram's own contractions. The call now lifts the caller's modes off the stack
(:func:`outside_caller_context`) and pushes them back around each evaluation of ``f``, on
top of torchgram's own modes (:func:`caller_context`): they see what ``f`` calls, as in a
plain call, and nothing else. ``torch.device(...)`` contexts alone (``DeviceContext``, which
only says where factories allocate) stay where they are. ``tg.autograd.record()`` entered
inside such a mode (0.75 off the same way) puts its recording mode beneath the caller's
(:func:`beneath_caller_modes`), so that they see the block's calls first, as they would
without it.
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
    stack = torch.overrides._get_current_function_mode_stack()
    if all(isinstance(mode, DeviceContext) for mode in stack):
        return ()
    return tuple(stack)


@contextlib.contextmanager
def outside_caller_context() -> Iterator[None]:
    """The body without the caller's autocast and function modes.

    :func:`caller_context` puts them back (NOTE [autocast], NOTE [the caller's function
    modes]).
    """
    modes = caller_function_modes()
    token = _CALLER_MODES.set(modes)
    for _ in modes:
        torch.overrides._pop_mode()
    try:
        with outside_autocast():
            yield
    finally:
        for mode in modes:
            torch.overrides._push_mode(mode)
        _CALLER_MODES.reset(token)


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
    for _ in modes:
        torch.overrides._pop_mode()
    try:
        with mode:
            for caller_mode in modes:
                torch.overrides._push_mode(caller_mode)
            try:
                yield
            finally:
                for _ in modes:
                    torch.overrides._pop_mode()
    finally:
        for caller_mode in modes:
            torch.overrides._push_mode(caller_mode)


@contextlib.contextmanager
def caller_context() -> Iterator[None]:
    """The caller's autocast and function modes (the latter on top of the stack)."""
    modes = _CALLER_MODES.get()
    for mode in modes:
        torch.overrides._push_mode(mode)
    try:
        with caller_autocast():
            yield
    finally:
        for _ in modes:
            torch.overrides._pop_mode()


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
        with contextlib.ExitStack() as stack:
            for device, _, _ in state:
                stack.enter_context(torch.autocast(device, enabled=False))
            yield
    finally:
        _CALLER.reset(token)


@contextlib.contextmanager
def caller_autocast() -> Iterator[None]:
    """The autocast regions the public call was made in (none outside one)."""
    with contextlib.ExitStack() as stack:
        for device, dtype, cache in _CALLER.get():
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache))
        yield


def caller_autocast_state() -> AutocastState:
    """The autocast regions of the public call being made (``()`` outside one)."""
    return _CALLER.get()
