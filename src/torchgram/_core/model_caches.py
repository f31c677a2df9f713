"""``transformers``' key-value caches among ``f``'s arguments: refused.

NOTE [model caches]
A decoder given ``past_key_values`` (a ``transformers`` ``DynamicCache`` from an earlier
call, an ``EncoderDecoderCache``, Mamba's states) updates that object in every forward: it
rebinds each layer's keys and values to longer tensors, or overwrites its states in place.
torchgram evaluates ``f`` several times per call (the probe, the passes, the checks), so each
evaluation saw the entries the previous ones had appended: a Gramian of no single call (LLaMA
0.02-0.05 off, GPT-2 up to 0.46, BART 0.37, ``aggregated_grad``'s update 0.42; Mamba 0.11),
and the caller's cache was left with several calls' entries and tensors carrying torchgram's
graphs (session 63's hunt). Rebinding an attribute is no write the write guards (NOTE
[captured writes]) can see, and the in-place states sat deeper than their walk. So a cache
among the call's arguments -- a pytree leaf, or held by one (a model output, a dataclass, a
namespace; three levels down) -- is refused before any work. A ``StaticCache`` too: filled
beforehand, its fixed tensors are written in place, where the write guards see each write (the
hunt found it right on ``auto``, ``structured`` and ``graph``), but an empty one makes its
tensors at its first update, for the batch of the evaluation that comes first -- the probe's
single sample -- and the next evaluation met torch's raw ``index_copy_`` error. The classes are
recognised by name (a class named ``...Cache`` defined in a ``transformers`` module, anywhere
in the object's class hierarchy), without importing ``transformers``. A cache ``f`` copies for
itself (``copy.deepcopy(cache)`` inside ``f``) is each evaluation's own. A cache ``f`` captures
(a closure, a global) cannot be refused beforehand -- ``f`` may copy it, as above -- so the
walk that finds the modules ``f`` reaches (NOTE [tensors hooks set]) notes the caches it meets,
and the call is refused after its work where one of them changed (:func:`cache_state`: its
tensors rebound or written, its counters moved), the Gramian of several caches dropped.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from torch import Tensor

from torchgram._core.checks import fail
from torchgram._core.pytree import PLAIN_VALUES, leaves_of


def refuse_updated_caches(api: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Refuse a ``transformers`` cache, which ``f``'s forwards would update (NOTE [model caches]).

    Example:
        >>> DynamicCache = type("DynamicCache", (), {"__module__": "transformers.cache_utils"})
        >>> refuse_updated_caches("api", (), {"past_key_values": DynamicCache()})
        Traceback (most recent call last):
        ...
        ValueError: api: expected arguments that f's evaluations leave as they found them, ...
    """
    named = [(f"argument {index}", arg) for index, arg in enumerate(args)]
    named += [(f"keyword {name!r}", value) for name, value in kwargs.items()]
    for where, value in named:
        for leaf in leaves_of(value):
            cache = None if isinstance(leaf, (Tensor, *PLAIN_VALUES)) else _cache_within(leaf)
            if cache is not None:
                fail(api, "arguments that f's evaluations leave as they found them",
                     f"a transformers {type(cache).__name__} in {where}, which the model's "
                     f"forward updates (it appends each call's keys and values): torchgram "
                     f"evaluates f several times per call, each evaluation would see the "
                     f"entries of the one before, and the cache would keep them all",
                     "Copy it inside f (past_key_values=copy.deepcopy(cache), the cache "
                     "captured), or pass its tensors and build the cache inside f.",
                     ValueError)


def _cache_within(obj: Any, depth: int = 3, width: int = 64, budget: int = 256) -> Any:
    """A cache that ``obj`` is or holds (a model output, a dataclass, a namespace), or ``None``.

    Read through ``__dict__``, lists, tuples and dicts (mappings' values), ``depth`` levels
    down; a container of more than ``width`` items is not looked into, and at most ``budget``
    objects are (an argument holding a dataset of records: 5 s a call unbounded, the review).
    """
    level, seen = [obj], set()
    for _ in range(depth + 1):
        following: list[Any] = []
        for item in level:
            if id(item) in seen or isinstance(item, (Tensor, *PLAIN_VALUES)):
                continue
            seen.add(id(item))
            if is_cache(item):
                return item
            if len(seen) >= budget:
                return None
            held = _held(item)
            if len(held) <= width:  # (measured before anything is copied)
                following.extend(held)
        level = following
    return None


def cache_state(cache: Any, depth: int = 5) -> list[Any]:
    """What a change of ``cache`` changes: its tensors (identity, version) and plain values.

    Read through ``__dict__``, lists, tuples and mappings, ``depth`` levels down, in a fixed
    order.

    Example:
        >>> import torch
        >>> class Layer:
        ...     def __init__(self):
        ...         self.keys = torch.zeros(1, 2)
        >>> layer = Layer()
        >>> before = cache_state(layer)
        >>> layer.keys = torch.cat([layer.keys, layer.keys])
        >>> cache_state(layer) == before
        False
    """
    state: list[Any] = []
    level: list[Any] = [cache]
    seen: set[int] = set()
    for _ in range(depth + 1):
        following: list[Any] = []
        for obj in level:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, Tensor):  # (an inference tensor has no version counter)
                state.append((id(obj), None if obj.is_inference() else obj._version))
            elif isinstance(obj, PLAIN_VALUES):
                state.append(obj)
            else:
                held = _held(obj)
                state.append((id(obj), len(held)))
                following.extend(held)
        level = following
    return state


def _held(obj: Any) -> Collection[Any]:
    """What the walks read in ``obj``, as a view (nothing is copied).

    A mapping's values, a list's or tuple's items, else the values of its ``__dict__``.
    """
    held = obj if isinstance(obj, Mapping | list | tuple) else getattr(obj, "__dict__", {})
    return held.values() if isinstance(held, Mapping) else held


def refuse_changed_caches(api: str, caches: tuple[Any, ...], before: list[list[Any]]) -> None:
    """After a call: refuse it where a cache ``f`` captured changed (NOTE [model caches])."""
    for cache, state in zip(caches, before, strict=True):
        if cache_state(cache) != state:
            fail(api, "f that leaves the caches it holds as they are",
                 f"a transformers {type(cache).__name__} that f captured and whose forward "
                 f"updated it: torchgram evaluates f several times per call, the evaluations "
                 f"saw different caches (the Gramian of no single call, dropped), and the "
                 f"cache now holds their entries", "Copy it inside f "
                 "(past_key_values=copy.deepcopy(cache)), or pass its tensors and build the "
                 "cache inside f.", ValueError)


def is_cache(obj: Any) -> bool:
    """Whether ``obj`` is a ``transformers`` cache."""
    return any(klass.__module__.startswith("transformers.") and klass.__name__.endswith("Cache")
               for klass in type(obj).__mro__)
