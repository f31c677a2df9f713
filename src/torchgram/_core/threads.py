"""Process-wide state torchgram touches, and how concurrent calls stay correct.

# NOTE [threads]
Calls may run concurrently from several threads (a data-loading thread, a notebook with
background work, a serving process). Most of what a call uses is per thread or per call in
torch: grad mode, the ``TorchFunctionMode`` stack (the structured backend's taps), the
``torch.func`` transform stack (``vmap``, ``vjp``, ``jacrev``), autograd graphs, and every
problem, plan and result torchgram builds. What is shared by the whole process, and how:

* **forward-mode AD** (``ntvp``): torch's dual levels form one process-wide list and
  ``torch.func.jvp`` counts its nesting in a module global, so two threads in forward mode
  at once exit each other's levels (zero tangents -- a wrong Gramian -- or "Trying to
  access a forward AD level with an invalid index"). Every forward-mode pass of torchgram
  holds :data:`FORWARD_AD_LOCK`: concurrent ``ntvp`` calls are **serialised** in their
  forward-mode pushes (their vjps, Gram products and everything else run concurrently).
  Every call asks whether a level is open (its caller's: a call inside ``dual_level()``);
  a pass marks its thread as the levels' owner (:func:`forward_mode_pass`), and a level open
  while another thread's pass is marked is that pass's, not the caller's
  (``composition.forward_ad_level_open``). Read bare, another thread's ntvp level looked like the
  caller's (session 66: torch's raw error under ``vmap``); read waiting for
  :data:`FORWARD_AD_LOCK`, a call nested in ``f`` holding :data:`RNG_LOCK` deadlocked with
  another thread's ntvp pass; read trying that lock, any other thread's call holding it for
  an instant made a caller's own level look closed (dual tangents dropped: the second review).
  Forward-mode AD run by other code in another thread at the same time is not protected.
* **the attention kernel switches** (``torch.nn.attention.sdpa_kernel``): process-wide
  flags, saved and restored by each context; interleaved in two threads they end in the
  wrong state. :func:`math_attention` counts its users (:class:`CountedSwitch`): the first
  sets the math kernel, the last restores the flags as they were before the first (other
  threads' attention runs with the math kernel meanwhile: same values, possibly slower).
* **dynamo's stance** (``torch.compiler.set_stance``): torchgram's evaluations of ``f`` run
  ``torch.compile``'d code eagerly (NOTE [compiled code in f] in ``_torch_compat.py``), a
  process-wide stance shared the same way by :data:`compiled_code_eager` (other threads'
  compiled code runs eagerly meanwhile).
* **modules** (``torchgram.functionalize``): a call swaps the module's parameters and
  buffers for the call's tensors while it runs (NOTE [parameter slots]), so calls of one
  module from two threads would see each other's tensors and could leave the module
  holding a transform's tensors. Those calls hold :data:`MODULE_LOCK` (one for all
  modules, as modules nest): the **forward passes** of functionalized modules are
  **serialised**; their backward passes are not (the graph holds its own tensors). Do not
  call the module itself from another thread while a functionalized call of it runs (it
  holds the call's tensors then).
* **caches** (probes, traces: NOTE [call signatures]): :class:`~torchgram._core.signature.
  LruCache` is locked; a cached trace's plan cache is a dict whose single operations are
  atomic, and two threads planning the same trace at once build equal plans.
* **the one-time forward-mode set-up** (NOTE [first forward-AD call]) runs under
  :data:`FORWARD_AD_LOCK`, so the warning filter it sets is never interleaved.
* **random numbers** (NOTE [one draw]): the default generators are process-wide, and a
  call restores its starting state before each evaluation of ``f``: two calls doing so at
  once would give each other's evaluations other draws (a Gramian of no single function).
  An evaluation that may draw holds :data:`RNG_LOCK` from that restore to its end, so the
  **evaluations of functions that draw are serialised**; once a full evaluation has shown
  that ``f`` draws nothing, the call no longer touches the generators nor takes the lock
  (it does not rewind other threads' generators either). The host's global generators,
  Python's ``random`` and numpy's ``np.random``, are handled the same way (NOTE [host
  generators]). Other code drawing from these global generators in another thread meanwhile
  is not protected: its draws may move them during the call's first evaluation, so that an
  ``f`` that draws nothing is taken for one that does (jacobian and ntvp then decline), and
  the call's restores rewind them (session 60's review: a numpy thread repeated draws). Pass
  such code its own generator (``torch.Generator``, ``np.random.default_rng()``,
  ``random.Random()``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from torch.nn.attention import SDPBackend, sdpa_kernel

from torchgram._core import _torch_compat

FORWARD_AD_LOCK = threading.RLock()
"""Held by every forward-mode AD pass of torchgram (reentrant: nested calls are fine)."""

_LEVEL_LOCK = threading.Lock()
"""Guards :data:`_level_owner` and its reading with the level; never held while ``f`` runs."""
_level_owner: tuple[int, int] | None = None
"""The thread whose forward-mode pass may have a level open, and its nesting depth."""


@contextlib.contextmanager
def forward_mode_pass() -> Iterator[None]:
    """Around a forward-mode pass of torchgram (which opens the process-wide levels).

    Marks this thread as their owner, for :func:`level_of_another_thread` (NOTE [threads]):
    the mark is set before the pass opens a level and cleared after it closes the last.
    """
    global _level_owner
    me = threading.get_ident()
    with _LEVEL_LOCK:
        depth = _level_owner[1] if _level_owner is not None and _level_owner[0] == me else 0
        _level_owner = (me, depth + 1)
    try:
        yield
    finally:
        with _LEVEL_LOCK:
            _level_owner = (me, depth) if depth else None


def level_of_another_thread(read_level: Callable[[], bool]) -> tuple[bool, bool]:
    """Whether a forward-mode level is open, and whether another thread's pass may own it.

    ``read_level()`` and the owner are read together, so that no pass opens or closes a
    level in between.
    """
    with _LEVEL_LOCK:
        owner = _level_owner
        level_open = read_level()
    return level_open, owner is not None and owner[0] != threading.get_ident()

RNG_LOCK = threading.RLock()
"""Held from restoring a call's random state to the end of an evaluation that may draw."""

MODULE_LOCK = threading.RLock()
"""Held while a function made by ``torchgram.functionalize`` runs its module."""


class CountedSwitch:
    """A process-wide setting made by a context manager, shared by overlapping users.

    Safe from several threads at once (NOTE [threads]): the first user in enters the
    context ``make()`` returns, the last user out exits it, so the setting is restored as it
    was before the first, whatever the interleaving (two threads each saving and restoring a
    process-wide setting themselves end in the other's state).

    Example:
        >>> import contextlib
        >>> log = []
        >>> @contextlib.contextmanager
        ... def noisy():
        ...     log.append("on")
        ...     yield
        ...     log.append("off")
        >>> switch = CountedSwitch(noisy)
        >>> with switch(), switch():
        ...     pass
        >>> log
        ['on', 'off']
    """

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager[object]]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._users = 0
        self._context: contextlib.AbstractContextManager[object] | None = None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                entering = self._make()
                entering.__enter__()
                self._context = entering
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    leaving, self._context = self._context, None
                    assert leaving is not None
                    leaving.__exit__(None, None, None)


math_attention = CountedSwitch(lambda: sdpa_kernel(SDPBackend.MATH))
"""Run the body with only the math kernel of scaled dot-product attention enabled.

Process-wide flags, set by the first thread in and restored by the last thread out (NOTE
[threads]).

Example:
    >>> import torch
    >>> with math_attention():
    ...     torch.backends.cuda.flash_sdp_enabled()
    False
    >>> torch.backends.cuda.flash_sdp_enabled()
    True
"""

compiled_code_eager = CountedSwitch(_torch_compat.compiled_code_runs_eagerly)
"""Run ``torch.compile``'d code called in the body eagerly (NOTE [compiled code in f]).

Dynamo's stance is process-wide: set by the first thread in and restored by the last thread
out (NOTE [threads]); other threads' compiled code runs eagerly meanwhile (same values,
possibly slower).
"""
