"""Attributes ``f`` rebinds on the modules it reaches, put back after each evaluation.

NOTE [attributes f rebinds]
A module's ``forward`` may keep Python state by rebinding its attributes: an exponential
moving average of a scale (``self.scale = 0.9 * self.scale + 0.1 * y.abs().mean()``), a
step counter (``self.step += 1``), a registered buffer replaced by a new tensor (``self.ema =
...``), a cache built on the first call (``self.mask = torch.tril(...)``), the last
activation kept for inspection (``self.last = y``). torchgram evaluates ``f`` several times
per call (the probe, the batched pass, the per-sample check, the tiles of a kernel), so each
evaluation saw the state the one before it left: until session 62 every backend returned a
Gramian that matched no single call (an EMA-normalised linear layer: auto 1.6, structured
0.88, graph 0.45 off, relative), jacobian and ntvp failed torch's internal assert on the
transform's tensor the first evaluation left on the module, and the module kept that state,
moved two to four times by one call.

So the call takes, before its first evaluation, the entries of the ``__dict__`` and of the
buffers of every module its walk reaches (NOTE [tensors hooks set]: ``f``'s closure, bound
instance, defaults, globals and arguments, bounded), and before each evaluation and at its
end rebinds what was rebound since, deletes what was added and restores what was deleted.
Every evaluation then starts from the state of the call's start, so the Gramian is that of one
plain call from there, and the call leaves the modules as it found them, as it leaves the
running statistics
(NOTE [frozen running statistics]): a state that a plain call would have advanced is not
advanced by torchgram's calls (a training loop whose only forward is ``tg.aggregated_grad``
runs a plain forward to advance it). Only rebinding is seen: a tensor changed in place is the
write guards' business (NOTE [captured writes]), an object that is not a module (a dict in a
closure, a ``nonlocal`` counter) is not looked at, and neither are modules beyond the walk's
bounds. Not after each evaluation: a backward hook reads what the forward kept on its module
(``module.saved = input`` in a forward hook, as opacus does) when torchgram differentiates the
evaluation, after it (a first version put back there: the hook's raw ``AttributeError``).

The entries are compared by identity, so an evaluation that rebinds nothing costs one pass
over each module's entries. ``_flat_weights`` and ``_flat_weight_refs`` (the list
``nn.RNNBase`` derives from its parameters whenever one is set, as ``functional_call`` does
twice an evaluation, and the weak references by which its forward sees that they changed) are
left as the evaluation leaves them, together: they describe the parameters the module has,
which are not put back here. (A first version left the list and put back the references:
torch then no longer saw the parameters as changed, and the module's next plain forward ran
with the call's tensors, its parameters getting no gradient: a review's find.)
Taking and putting back hold :data:`~torchgram._core.threads.MODULE_LOCK`, as the swaps of
``tg.functionalize``'s ``fn`` do (NOTE [threads]): a call never takes another thread's swapped
buffers for the module's own.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

from torch import nn

from torchgram._core.threads import MODULE_LOCK

_DERIVED = frozenset({"_flat_weights", "_flat_weight_refs"})
"""Entries torch derives from others (left as they are: module docstring)."""

_ABSENT = object()


class ModuleAttributes:
    """The entries of the modules ``f`` reaches, as a call found them (NOTE [attributes f rebinds]).

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> attributes = ModuleAttributes.capture([layer])
        >>> layer.last = layer(torch.ones(1, 2))
        >>> attributes.put_back()
        >>> hasattr(layer, "last")
        False
    """

    def __init__(self, modules: tuple[nn.Module, ...],
                 kept: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
        self.modules = modules
        self._kept = kept

    @classmethod
    def capture(cls, modules: Iterable[nn.Module]) -> ModuleAttributes:
        """The entries of ``modules``' attributes and buffers now."""
        modules = tuple(modules)
        with MODULE_LOCK:
            return cls(modules, [(entries, dict(entries)) for module in modules
                                 for entries in _entries(module)])

    def put_back(self) -> None:
        """Make every module's entries those the call found."""
        with MODULE_LOCK:
            for entries, before in self._kept:
                if entries.keys() == before.keys() and all(
                        map(operator.is_, entries.values(), before.values())):
                    continue  # nothing rebound (almost every module, almost every time)
                for name in [name for name in entries if name not in before]:
                    if name not in _DERIVED:
                        del entries[name]
                for name, value in before.items():
                    if name not in _DERIVED and entries.get(name, _ABSENT) is not value:
                        entries[name] = value


def _entries(module: nn.Module) -> list[dict[str, Any]]:
    """The dictionaries of ``module``'s attributes and of its buffers (plain ``dict`` only).

    A scripted module's buffers are a wrapper of its C++ object's: not taken.
    """
    attributes = vars(module)
    buffers = attributes.get("_buffers")
    return [attributes, buffers] if type(buffers) is dict else [attributes]
