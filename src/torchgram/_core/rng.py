"""Random-number state: evaluate ``f`` several times and see one draw.

# NOTE [one draw]
A backend may evaluate ``f`` more than once (a probe of its output, a trace, a forward per
leaf group, a last forward for ``aux``). With random ops (dropout in train mode) each
evaluation would draw anew, and the Gramian would mix several functions. So the call
captures the generators' state when it starts, every evaluation starts from that state,
and the call ends in the state that one plain call of ``f`` leaves behind: the Gramian is
that of the draw a single plain call with the current RNG state sees.

The default generators are captured (CPU, and each accelerator that holds an argument), and
so are the generators ``f`` draws from explicitly (NOTE [explicit generators]) and the
host's global ones (NOTE [host generators]).

# NOTE [host generators]
Python's ``random`` and numpy's global ``np.random`` are generators too: ``transformers``'
speech models draw their SpecAugment masks and layer drops from ``np.random`` in train mode
(Wav2Vec2, HuBERT, WavLM, Whisper...). Left out, each evaluation drew other masks and the
Gramian matched no single call of ``f`` (session 60's hunt: Wav2Vec2 0.19-0.31 off on auto,
structured and jacobian; an MLP with a numpy mask 0.4-0.8 off on every backend but graph). Their
states are captured, restored and compared with the default generators' (numpy's only once
numpy is imported: ``f`` can only draw from it then; torch imports it when it can). Reading
them costs ~25-30 µs (numpy's state is a copy of its 624-word key, Python's a tuple of 625
ints): two captures and two comparisons a call and a restore before the first evaluation,
~100-160 µs (+20% on a 0.8 ms call of a tiny MLP), and one restore before each later
evaluation when ``f`` draws. (Skipping the first restore broke the kernels: their second
input set's first evaluation started where the first set's left numpy: 0.76-1.0 off, the
review of session 60.)
Threads that draw from the host's global generators while a call runs are as exposed as
those drawing from torch's (NOTE [threads]).

# NOTE [generators f holds]
Generators of its own that ``f`` holds (``rng = np.random.default_rng(0)`` in a closure or a
global, a ``np.random.RandomState``, a ``random.Random``, a module's attribute) drew anew on
each evaluation: every backend but graph returned a Gramian that matched no single draw
(session 61: an MLP with a mask from ``default_rng``: 0.09-0.23 off on auto and structured with
``batch_dim``, 0.3-0.6 on jacobian and ntvp; session 60's review had found jacobian and ntvp).
The walk that looks for hooked modules (NOTE [tensors hooks set]: f's closure, bound instance,
defaults, the globals its code names, its arguments; bounded) collects them, and so do the
modules it finds: their attributes (containers and objects there) and forward hooks (within a
budget of their own), their classes' attributes and what their ``forward`` names, through the
helper functions it calls (torch's left out; the review of session 61 and the fuzzers' dropout
drawing from a generator of their module: 0.3-2.6 off before, with a generator in those places
or of a subclass of ``random.Random``); objects with ``__slots__`` are looked into. The call's
``Draw`` captures, restores and compares their states with the host's global generators': every
evaluation draws what a plain call would, the call ends where a plain call leaves them, and
``f`` counts as drawing (jacobian and ntvp decline, as for dropout). A generator beyond the
walk's bound (deep in a large container) is not seen; one that ``f`` reaches and another thread
draws from is as exposed as the global ones (NOTE [threads]).

# NOTE [explicit generators]
``f`` may draw from a ``torch.Generator`` of its own (``torch.bernoulli(p, generator=gen)``,
the generator captured or passed in). Each evaluation advanced it, so the Gramian mixed the
masks of several evaluations (0.76 to 3.4 off, relative, on every backend but the graph walk,
before session 57). Every evaluation of ``f`` runs under a write guard (``_WriteGuard`` in
``captured_writes.py``: the probe's, or the later evaluations' stale-write check), which hands
each generator a call is given (``generator=``) to the call's ``Draw`` before the call draws
from it: the first time, its state then is the call's start (no evaluation of the call drew
from it before, or it would have been handed over then). From there on it is handled like
the default generators: every evaluation starts from that state, the call ends where one
plain call leaves it, and ``f`` counts as drawing (the backends that run ``f`` under
``torch.func`` transforms decline, as for dropout). The default generators named explicitly
(``generator=torch.default_generator``) are left to ``RngState``, which restores them from
the call's start (adopting one at its first explicit use, after a dropout's draw, broke that:
1.02 off, a review's find). A cached probe changes nothing: the later evaluations' guard
hands over a generator first drawn from under it (an eval-mode call first) all the same.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


def _module(device: torch.device) -> Any:
    """The ``torch.<device type>`` module whose ``get_rng_state(index)`` exists, if any."""
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "get_rng_state"):
        return None
    initialized = getattr(module, "is_initialized", None)
    if callable(initialized) and not initialized():
        return None
    return module


@dataclass(frozen=True)
class HostRngState:
    """The state of Python's ``random`` and numpy's global ``np.random`` (NOTE [host generators]).

    Example:
        >>> import random
        >>> state = HostRngState.capture()
        >>> a = random.random()
        >>> state.restore()
        >>> random.random() == a
        True
    """

    python: Any
    numpy: dict[str, Any] | None
    owned: tuple[tuple[Any, Any], ...] = ()
    """The generators ``f`` holds, each with its state (NOTE [generators f holds])."""

    @classmethod
    def capture(cls, owned: tuple[Any, ...] = ()) -> HostRngState:
        """The current state (numpy's: ``None`` while numpy is not imported), and ``owned``'s."""
        numpy = sys.modules.get("numpy")
        return cls(random.getstate(),
                   None if numpy is None else numpy.random.get_state(legacy=False),
                   tuple((generator, _state_of(generator)) for generator in owned))

    @property
    def generators(self) -> tuple[Any, ...]:
        """The generators ``f`` holds whose states this holds."""
        return tuple(generator for generator, _ in self.owned)

    def restore(self) -> None:
        """Put the generators back in this state."""
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)
        for generator, state in self.owned:
            _set_state(generator, state)

    def same_as(self, other: HostRngState) -> bool:
        """Whether no random number was drawn between ``self`` and ``other``."""
        return self.python == other.python and _same_numpy_state(
            self.numpy, other.numpy) and len(self.owned) == len(other.owned) and all(
            a is b and _same_numpy_state(x, y)
            for (a, x), (b, y) in zip(self.owned, other.owned, strict=True))


_GENERATOR_CLASSES: dict[type, bool] = {}
"""Whether each class met is a generator's: asked for every attribute of every module a call
reaches, so one dict lookup a value."""


_KNOWN_CLASSES = 4096


def generator_class(kind: type) -> bool:
    """Whether instances of ``kind`` are host generators ``f`` may hold (NOTE [generators f holds]).

    A numpy ``Generator``, ``RandomState`` or bit generator, or a ``random.Random`` (or a
    subclass; not ``random.SystemRandom``, which has no state to restore). Python's and
    numpy's global instances (:func:`global_generators`) are captured apart.

    Example:
        >>> generator_class(random.Random), generator_class(random.SystemRandom)
        (True, False)
    """
    try:
        known = _GENERATOR_CLASSES.get(kind)
    except TypeError:  # a class whose metaclass defines __eq__ without __hash__
        return False
    if known is not None:
        return known
    numpy = sys.modules.get("numpy")
    bases: tuple[type, ...] = (random.Random,) if numpy is None else (
        random.Random, numpy.random.Generator, numpy.random.RandomState,
        numpy.random.BitGenerator)
    found = issubclass(kind, bases) and not issubclass(kind, random.SystemRandom)
    if len(_GENERATOR_CLASSES) >= _KNOWN_CLASSES:  # made on the fly (fx, type()): bounded
        _GENERATOR_CLASSES.clear()
    _GENERATOR_CLASSES[kind] = found  # (a numpy class exists only once numpy is imported)
    return found


def global_generators() -> tuple[Any, ...]:
    """Python's global generator, and numpy's once numpy is imported."""
    python = random.random.__self__  # type: ignore[attr-defined]
    numpy = sys.modules.get("numpy")
    return (python,) if numpy is None else (python, numpy.random.random.__self__)


def _state_of(generator: Any) -> Any:
    """The state of a generator of a :func:`generator_class`."""
    if isinstance(generator, random.Random):
        return generator.getstate()
    if hasattr(generator, "bit_generator"):  # a numpy Generator
        return generator.bit_generator.state
    if hasattr(generator, "get_state"):  # a RandomState (its cached Gaussian included)
        return generator.get_state(legacy=False)
    return generator.state  # a bit generator


def _set_state(generator: Any, state: Any) -> None:
    """Put a generator of a :func:`generator_class` back in ``state``."""
    if isinstance(generator, random.Random):
        generator.setstate(state)
    elif hasattr(generator, "bit_generator"):
        generator.bit_generator.state = state
    elif hasattr(generator, "set_state"):
        generator.set_state(state)
    else:
        generator.state = state


def _same_numpy_state(a: Any, b: Any) -> bool:
    """Whether two states of numpy's global generator, or two of their values, are the same.

    A state is a dict holding the key's array, or ``None`` where numpy is not imported.
    """
    if a is None or b is None:
        return a is b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_numpy_state(a[key], b[key]) for key in a)
    if hasattr(a, "shape") or hasattr(b, "shape"):  # numpy arrays (the generator's key)
        return bool(getattr(a, "shape", None) == getattr(b, "shape", None) and (a == b).all())
    return bool(a == b)


@dataclass(frozen=True)
class RngState:
    """The state of the default generators: CPU, those of ``devices``, and the host's.

    Example:
        >>> state = RngState.capture([])
        >>> a = torch.rand(2)
        >>> state.restore()
        >>> torch.equal(torch.rand(2), a)
        True
    """

    cpu: Tensor
    accelerators: tuple[tuple[torch.device, Tensor], ...]
    host: HostRngState | None = None

    @classmethod
    def capture(cls, devices: Iterable[torch.device], *, host: bool = True,
                owned: tuple[Any, ...] = ()) -> RngState:
        """The current state.

        ``devices``: the accelerators whose generators matter; ``host``: Python's and numpy's
        global generators too (NOTE [host generators]), and the generators ``owned`` that ``f``
        holds (NOTE [generators f holds]).
        """
        states = []
        for device in dict.fromkeys(devices):
            module = _module(device)
            if module is not None:
                index = device.index if device.index is not None else module.current_device()
                states.append((torch.device(device.type, index), module.get_rng_state(index)))
        return cls(torch.get_rng_state(), tuple(states),
                   HostRngState.capture(owned) if host else None)

    def again(self) -> RngState:
        """The state now, of the generators this one holds."""
        return RngState.capture((device for device, _ in self.accelerators),
                                host=self.host is not None,
                                owned=() if self.host is None else self.host.generators)

    def restore(self) -> None:
        """Put the generators back in this state."""
        torch.set_rng_state(self.cpu)
        for device, state in self.accelerators:
            module = _module(device)
            if module is not None:
                module.set_rng_state(state, device.index)
        if self.host is not None:
            self.host.restore()

    def same_as(self, other: RngState) -> bool:
        """Whether no random number was drawn between ``self`` and ``other``."""
        return torch.equal(self.cpu, other.cpu) and len(self.accelerators) == len(
            other.accelerators) and all(
            a[0] == b[0] and torch.equal(a[1], b[1])
            for a, b in zip(self.accelerators, other.accelerators, strict=True)) and (
            self.host is None or other.host is None or self.host.same_as(other.host))
