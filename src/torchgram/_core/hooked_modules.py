"""Attributes that modules' forward hooks set during a call, put back after it.

# NOTE [tensors hooks set]
A forward (pre-)hook may keep a tensor of the call on its module: ``torch.nn.utils.prune``,
the hook-based ``nn.utils.weight_norm`` and ``spectral_norm`` set ``module.weight``, computed
from the call's parameters, before each forward. After a Gramian, such a module held a tensor
of torchgram's transforms (a vmap BatchedTensor: "tensor may have escaped" on its next use,
the next pruning round, ``deepcopy`` and ``torch.save`` failing), computed from the call's
parameters (session 57 for ``tg.functionalize``'s ``fn``; session 60's hunt for an ``f``
written with ``torch.func.functional_call``, whose modules ``fn`` does not own). So the
attributes of the modules with forward hooks that ``f`` reaches (its closure, bound instance,
defaults, the globals its code names, its arguments: :func:`~torchgram._core.captured_writes.
reach`, bounded: modules beyond its first 512 objects are not searched) and
that hold tensors (or lists, tuples or dicts of them) are put back as they were
after each call, so that the module is as the caller left it (a plain forward of it sets them
afresh). So a hook that keeps statistics by rebinding an attribute (an observer's running
maximum) is not advanced by torchgram's calls, whose evaluations are not the plain call's:
a training loop whose only forward is ``tg.aggregated_grad`` runs a plain forward to update
it. Attributes a module's ``forward`` itself sets (no hook), or a hook sets on another module
or object, are not put back (session 60's review: they may hold a transform's tensor).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, cast

from torch import Tensor, nn

from torchgram._core.captured_writes import reach

Fn = TypeVar("Fn", bound=Callable[..., Any])

_BUDGET = 512
"""Objects other than tensors the walk for modules visits at most, nearest first."""
_WIDTH = 1024
"""Containers larger than this are data, not modules (a list of 70 pruned layers is searched:
a limit of 64 missed it, session 60's review; an ``nn.ModuleList`` is a module)."""


def hooked_attributes(f: Any, args: Any) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The attributes of the modules with forward hooks ``f`` reaches, and copies of them.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> _ = layer.register_forward_pre_hook(lambda module, inputs: None)
        >>> [copy is not attributes for attributes, copy in hooked_attributes(layer, ())]
        [True]
    """
    modules: dict[int, nn.Module] = {}

    def add(module: nn.Module) -> None:
        for sub in module.modules():
            modules.setdefault(id(sub), sub)

    # Modules sit near f (a closure cell, a global, self): a bounded walk, which a closure
    # over a dataset of records does not make slow (the full walk: 18 ms a call for 4000
    # records, session 60's review).
    reach(f, args, lambda tensor: None, add, budget=_BUDGET, width=_WIDTH)
    return [(module.__dict__, dict(module.__dict__)) for module in modules.values()
            if module._forward_pre_hooks or module._forward_hooks]


@contextlib.contextmanager
def hooked_attributes_put_back(f: Any, args: Any, kwargs: Mapping[str, Any]) -> Iterator[None]:
    """Around a call: what forward hooks set on the modules ``f`` reaches is put back after it.

    NOTE [tensors hooks set].
    """
    hooked = hooked_attributes(f, (args, dict(kwargs)))
    try:
        yield
    finally:
        for attributes, before in hooked:
            put_back_tensors(attributes, before)


def puts_back_hooked_attributes(f: Any) -> Callable[[Fn], Fn]:
    """Decorate a call of ``f``'s arguments with :func:`hooked_attributes_put_back`.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> _ = layer.register_forward_hook(lambda m, args, out: setattr(m, "last", out))
        >>> @puts_back_hooked_attributes(layer)
        ... def call(x):
        ...     return layer(x)
        >>> _ = call(torch.ones(1, 2))
        >>> hasattr(layer, "last")
        False
    """
    def decorate(call: Fn) -> Fn:
        @functools.wraps(call)
        def around(*args: Any, **kwargs: Any) -> Any:
            with hooked_attributes_put_back(f, args, kwargs):
                return call(*args, **kwargs)

        return cast(Fn, around)

    return decorate


def put_back_tensors(attributes: dict[str, Any], before: dict[str, Any]) -> None:
    """Undo the changes of ``attributes``' entries holding tensors since ``before`` (a copy).

    An entry holds tensors when it is one or a list, tuple or dict with one among its values
    (``module.stats = {"out": out}`` in a hook, a review's find).

    Example:
        >>> import torch
        >>> attributes = {"weight": torch.zeros(1), "name": "a"}
        >>> before = dict(attributes)
        >>> attributes.update(weight=torch.ones(1), extra=[torch.ones(1)], name="b")
        >>> put_back_tensors(attributes, before)
        >>> sorted(attributes), attributes["weight"], attributes["name"]
        (['name', 'weight'], tensor([0.]), 'b')
    """
    for name, value in list(attributes.items()):
        old = before.get(name, _ABSENT)
        if value is not old and (_holds_tensors(value) or _holds_tensors(old)):
            if old is _ABSENT:
                del attributes[name]
            else:
                attributes[name] = old


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, Tensor):
        return True
    items = value.values() if isinstance(value, dict) else value
    return isinstance(value, list | tuple | dict) and any(isinstance(item, Tensor)
                                                          for item in items)


_ABSENT = object()
