"""Scratch memory for a call's large CPU temporaries, kept between calls of a thread.

# NOTE [scratch memory]
On CPU, torch allocates with the C library's ``malloc``, which hands large freed blocks back
to the system (``munmap``, or trimming the top of the heap once it holds more than twice the
largest block freed so far). A call that forms large temporaries and frees them at its end
(the per-sample Jacobians of materialized layers, kept for ``Jᵀw`` in a step) then starts
the next call on fresh pages: each first touch is a page fault that the kernel serves by
zeroing 4 KiB. On the transformer of ``benchmarks/eager.py`` (T = 64, B = 32) a recorded
step touched 7 000-14 000 fresh pages in most calls (28-55 MiB), and took 120-160 ms
against 90-100 ms in the calls that touched none (a plain backward: 70 ms): which calls
fault depends on the state of the heap, so it also made the ratios to a backward jump from
run to run. A plain backward frees nothing that large and faults no page.

So the calls of ``torchgram.autograd`` and ``tg.aggregated_grad`` (whose steps keep such
Jacobians; ``tg.aggregated_grad`` on that transformer: 7 000-9 700 fresh pages a call, 148 ms,
then none, 95 ms) run in a :func:`scratch_scope`: the temporaries that
cannot escape the call are cut, one after another, from one buffer per thread that outlives
the call (one that is dropped at once, a Jacobian whose Gram is taken and that is not kept,
is given back: the next one takes its place). At the end of a scope the buffer grows to the
most the call held at once (while the buffers of all threads together stay within
:data:`SCRATCH_LIMIT_BYTES`, 256 MiB; what does not fit is allocated as before), so from
the second call on nothing is allocated. It is held until the thread ends or ``tg.autograd.
release_scratch()``; only CPU tensors use it (CUDA has torch's caching allocator).

A scope that starts while the thread's buffer is lent out (a weighting that calls torchgram
from inside ``tg.autograd.backward``) gets no buffer: its temporaries are allocated as
before, and nothing of the outer call is overwritten. Loans are views of the buffer: they
must not outlive their scope (nothing returned to the user is one).
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

SCRATCH_LIMIT_BYTES = 256 * 2**20
"""The most that the buffers of all threads together keep between calls (NOTE [scratch
memory]): a thread's buffer grows only while the sum stays within it."""
_ALIGN = 64
_KEPT: dict[int, int] = {}  # id of each Scratch with a buffer: its bytes
_KEPT_LOCK = threading.Lock()


def _forget(key: int) -> None:
    with _KEPT_LOCK:
        _KEPT.pop(key, None)


def kept_bytes() -> int:
    """The bytes the scratch buffers of all threads hold now.

    Example:
        >>> kept_bytes() >= 0
        True
    """
    with _KEPT_LOCK:
        return sum(_KEPT.values())


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class Scratch:
    """One thread's buffer, lent out piece by piece during a scope.

    Example:
        >>> cpu = torch.device("cpu")
        >>> scratch = Scratch()
        >>> first = scratch.take((2, 3), torch.float32, cpu)  # no buffer yet: allocated
        >>> second = scratch.take((4,), torch.float64, cpu)
        >>> scratch.end()  # the buffer grows to what the scope asked for (two aligned loans)
        >>> a = scratch.take((2, 3), torch.float32, cpu)
        >>> b = scratch.take((4,), torch.float64, cpu)  # after a, 64-byte aligned
        >>> a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        True
        >>> b.data_ptr() - a.data_ptr()
        64
    """

    def __init__(self) -> None:
        self._buffer: Tensor | None = None
        self._used = 0  # bytes lent in this scope (aligned)
        self._asked = 0  # bytes this scope's live requests take, lent or not (aligned)
        self._peak = 0  # the most that were live at once
        self._latest: tuple[int, int] | None = None  # the latest loan: where, how many bytes
        self.busy = False
        weakref.finalize(self, _forget, id(self))  # a thread's Scratch goes with the thread

    def take(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """An uninitialised contiguous tensor, valid until the scope ends (or it is given back)."""
        if device.type != "cpu":
            return torch.empty(tuple(shape), dtype=dtype, device=device)
        nbytes = math.prod(shape) * dtype.itemsize
        self._asked += _aligned(nbytes)
        self._peak = max(self._peak, self._asked)
        buffer, start = self._buffer, self._used
        if buffer is None or start + nbytes > buffer.numel():
            loan = torch.empty(tuple(shape), dtype=dtype, device=device)
        else:
            self._used = start + _aligned(nbytes)
            loan = buffer[start:start + nbytes].view(dtype).view(*shape)
        self._latest = (loan.data_ptr(), nbytes)
        return loan

    def give_back(self, loan: Tensor) -> None:
        """End ``loan`` early if it is the scope's latest :meth:`take` (else do nothing).

        Its place then serves the next loan: ``loan`` must not be used afterwards.
        """
        if self._latest is None or self._latest != (loan.data_ptr(), loan.numel()
                                                     * loan.element_size()):
            return
        nbytes = _aligned(self._latest[1])
        self._latest = None
        self._asked -= nbytes
        buffer = self._buffer
        if buffer is not None and loan.untyped_storage().data_ptr() == \
                buffer.untyped_storage().data_ptr():
            self._used -= nbytes

    def end(self) -> None:
        """End the scope: every loan is over; grow the buffer to what the scope held at most.

        Only while the buffers of all threads stay within :data:`SCRATCH_LIMIT_BYTES`.
        """
        peak, self._used, self._asked, self._peak = self._peak, 0, 0, 0
        self._latest = None
        held = 0 if self._buffer is None else self._buffer.numel()
        if peak <= held:
            return
        with _KEPT_LOCK:
            others = sum(_KEPT.values()) - _KEPT.get(id(self), 0)
            if others + peak > SCRATCH_LIMIT_BYTES:
                return
            _KEPT[id(self)] = peak
        self._buffer = None  # the old buffer goes before the new one is made
        self._buffer = torch.empty(peak, dtype=torch.uint8)

    def release(self) -> None:
        """Give the buffer back (the next scope allocates its temporaries afresh)."""
        self._buffer = None
        _forget(id(self))


_LOCAL = threading.local()


def _scratch() -> Scratch:
    scratch = getattr(_LOCAL, "scratch", None)
    if scratch is None:
        scratch = _LOCAL.scratch = Scratch()
    return scratch


@contextlib.contextmanager
def scratch_scope() -> Iterator[Scratch | None]:
    """The thread's :class:`Scratch` for the block, or ``None`` if it is lent out already."""
    scratch = _scratch()
    if scratch.busy:  # a call inside a call: its temporaries are its own
        outer, _LOCAL.current = current_scratch(), None
        try:
            yield None
        finally:
            _LOCAL.current = outer
        return
    scratch.busy = True
    _LOCAL.current = scratch
    try:
        yield scratch
    finally:
        _LOCAL.current = None
        scratch.busy = False
        scratch.end()


def current_scratch() -> Scratch | None:
    """The scratch of the scope the thread is in (``None`` outside one, or in a nested one)."""
    current: Scratch | None = getattr(_LOCAL, "current", None)
    return current


def scratch_for(*operands: Tensor) -> Scratch | None:
    """The current scratch, if a product of ``operands`` may be written into it with ``out=``.

    Not for operands that autograd or a ``torch.func`` transform tracks (``out=`` products
    are not differentiable, nor batched), tensor subclasses, nor operands of several dtypes.
    """
    scratch = current_scratch()
    if scratch is None:
        return None
    dtype = operands[0].dtype
    for operand in operands:
        if operand.requires_grad or operand.dtype != dtype \
                or type(operand) not in (Tensor, torch.nn.Parameter) \
                or torch._C._functorch.is_functorch_wrapped_tensor(operand):
            return None
    return scratch


def scratch_bmm(left: Tensor, right: Tensor) -> Tensor:
    """``torch.bmm(left, right)``, written into the current scratch where it may be.

    A temporary of the call only (NOTE [scratch memory]): :func:`give_back` it once used,
    unless it is kept for later in the call.

    Example:
        >>> left, right = torch.ones(2, 3, 4), torch.ones(2, 4, 5)
        >>> with scratch_scope():
        ...     product = scratch_bmm(left, right)
        ...     total = product.sum().item()
        ...     give_back(product)
        >>> total
        120.0
    """
    scratch = scratch_for(left, right)
    if scratch is None:
        return torch.bmm(left, right)
    return torch.bmm(left, right, out=scratch.take(
        (left.shape[0], left.shape[1], right.shape[2]), left.dtype, left.device))


def give_back(loan: Tensor) -> None:
    """End ``loan`` early if it is the current scratch's latest (else do nothing)."""
    scratch = current_scratch()
    if scratch is not None:
        scratch.give_back(loan)


def release_scratch() -> None:
    """Free the calling thread's scratch buffer (NOTE [scratch memory]).

    Calls on CPU (``tg.autograd``, ``tg.gramian``, ``tg.aggregated_grad``) keep one buffer
    per thread for their large temporaries (at most 256 MiB for all threads together), so
    that the next call does not start on fresh pages. This frees the calling thread's; its
    next call allocates afresh. It changes no result.

    Example:
        >>> import torchgram as tg
        >>> tg.autograd.release_scratch()
    """
    _scratch().release()
