"""The caller's function modes reach ``f``'s evaluations only; pure math runs without autocast.

# NOTE [the caller's function modes]
A ``TorchFunctionMode`` the caller entered around the call (a mode that rewrites what an
op returns: fake quantisation, a scale) sat *beneath* the structured backend's tapping mode,
which therefore tapped ``F.linear``'s output after the caller's mode had rewritten it
(``2 · linear(x, W)``) while its factors were those of ``linear(x, W)``: G 0.75 off on
``structured``, ``auto`` and the kernels, and under ``tg.autograd.record()`` entered inside
the mode; such a mode also rewrote torchgram's own contractions (a mode scaling matmul
outputs: 0.5 to 2.4 off on every backend; rounding them, fake quantisation: 7.7e-4; session
59's hunts and reviews). Every public entry point (``public_call``) now lifts the caller's
modes off the stack for the call (:func:`outside_caller_context`) and pushes them back on
top of torchgram's own around each evaluation of ``f`` (:func:`caller_context`, in
``problem.evaluate_f``): they see ``f``'s calls first, as in a plain call, and nothing of
torchgram's. ``record()`` puts its recording mode beneath them (:func:`beneath_caller_modes`).
A mode the body exits is not pushed back; one ``f`` leaves entered is dropped.
``torch.device(...)`` contexts alone (``DeviceContext``) stay where they are. torch's own
backward recomputes a non-reentrant ``torch.utils.checkpoint`` region without function
modes (a plain ``loss.backward()`` inside the mode differs from the forward's function); so
do torchgram's backward passes.

# NOTE [autocast]
A call made inside ``torch.autocast`` runs there, backward passes included: lifting autocast
for torchgram's work and re-entering it around ``f`` made the backward of an op saved under
autocast run outside it, which torch 2.13 refuses for ``scaled_dot_product_attention`` with
a float32 mask (HF Swin's relative position bias: "expected scalar type BFloat16 but found
Float" on every backend but graph; session 59's review). So ``G``'s products carry the
lower precision of the region, like ``f``'s own; the NTK predictions, which evaluate no
``f``, run with autocast off (``public_math``, :func:`without_autocast`; they were 0.2-1.2%
off in bfloat16), and so do the weightings (which compute in float64 anyway).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar, cast

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import DeviceContext

Fn = TypeVar("Fn", bound=Callable[..., Any])

_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla", "ipu")

_CALLER_MODES: ContextVar[list[TorchFunctionMode] | None] = ContextVar(
    "torchgram_caller_function_modes", default=None)
"""The function modes lifted by the public call being made (``None`` outside one). A list:
:func:`caller_context` drops those ``f`` exits, so that the call does not push them back."""


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
    """No function mode on the stack and none lifted by an outer call: nothing to do."""
    return not torch._C._len_torch_function_stack() and not _CALLER_MODES.get()


def _replace_mode_stack(modes: list[TorchFunctionMode]) -> None:
    """The function-mode stack made ``modes`` (bottom first)."""
    for _ in range(torch._C._len_torch_function_stack()):
        torch.overrides._pop_mode()
    for mode in modes:
        torch.overrides._push_mode(mode)


def _entries(stack: list[TorchFunctionMode], than: list[TorchFunctionMode]
             ) -> list[TorchFunctionMode]:
    """The modes of ``stack`` that are not in ``than`` (by identity), in order."""
    return [mode for mode in stack if not any(mode is other for other in than)]


@contextlib.contextmanager
def outside_caller_context() -> Iterator[None]:
    """The body without the caller's function modes (NOTE [the caller's function modes]).

    Example:
        >>> from torch.overrides import TorchFunctionMode
        >>> mode = TorchFunctionMode()
        >>> with mode, outside_caller_context():
        ...     inside = torch.overrides._get_current_function_mode_stack()
        ...     with caller_context():
        ...         around_f = torch.overrides._get_current_function_mode_stack()
        >>> inside, around_f == [mode]
        ([], True)
    """
    modes = list(caller_function_modes())
    token = _CALLER_MODES.set(modes)
    if modes:
        _replace_mode_stack([])
    try:
        yield
    finally:
        if modes:  # those f did not exit (the list), below what the body left entered
            now = torch.overrides._get_current_function_mode_stack()
            _replace_mode_stack(modes + _entries(now, modes))
        _CALLER_MODES.reset(token)


@contextlib.contextmanager
def caller_context() -> Iterator[None]:
    """The caller's function modes on top of torchgram's, around an evaluation of ``f``.

    The stack is put back as it was before afterwards: a mode ``f`` enters and leaves
    entered would otherwise sit above torchgram's own, whose exits would pop it instead of
    themselves and leave a tapping mode or a census on the caller's stack for good (session
    59's review).
    """
    modes = _CALLER_MODES.get()
    depth = torch._C._len_torch_function_stack()
    if not modes:
        try:
            yield
        finally:
            if torch._C._len_torch_function_stack() != depth:
                _drop_modes_above(depth)
        return
    before = torch.overrides._get_current_function_mode_stack()
    for mode in modes:
        torch.overrides._push_mode(mode)
    try:
        yield
    finally:
        now = torch.overrides._get_current_function_mode_stack()
        modes[:] = [mode for mode in modes if any(mode is entry for entry in now)]  # not exited
        _replace_mode_stack(before)


def _drop_modes_above(depth: int) -> None:
    """The modes above the first ``depth`` of the stack popped (those ``f`` left entered)."""
    while torch._C._len_torch_function_stack() > depth:
        torch.overrides._pop_mode()


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
    modes = list(caller_function_modes())
    with mode:
        if not modes:
            yield
            return
        stack = torch.overrides._get_current_function_mode_stack()
        _replace_mode_stack(_entries(stack, modes) + modes)
        try:
            yield
        finally:  # the order as it was, less what the body exited, plus what it left entered
            now = torch.overrides._get_current_function_mode_stack()
            kept = [entry for entry in stack if any(entry is other for other in now)]
            _replace_mode_stack(kept + _entries(now, stack))


def without_autocast(fn: Fn) -> Fn:
    """``fn`` with autocast off: for public functions that evaluate no ``f`` (NOTE [autocast]).

    Example:
        >>> @without_autocast
        ... def product(a, b):
        ...     return (a @ b).dtype
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     product(torch.ones(2, 2), torch.ones(2, 2))
        torch.float32
    """
    @functools.wraps(fn)
    def outside(*args: Any, **kwargs: Any) -> Any:
        if not torch._C._is_any_autocast_enabled():
            return fn(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for device in _DEVICE_TYPES:
                if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
                    stack.enter_context(torch.autocast(device, enabled=False))
            return fn(*args, **kwargs)

    return cast(Fn, outside)
