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
among the call's arguments -- a pytree leaf, or a value of a mapping leaf such as a model
output -- is refused before any work. A ``StaticCache`` too: filled beforehand, its fixed
tensors are written in place, where the write guards see each write (the hunt found it right on
``auto``, ``structured`` and ``graph``), but an empty one makes its tensors at its first
update, for the batch of the evaluation that comes first -- the probe's single sample -- and
the next evaluation met torch's raw ``index_copy_`` error. The classes are recognised by name
(a class named ``...Cache`` defined in a ``transformers`` module, anywhere in the object's
class hierarchy), without importing ``transformers``. A cache ``f`` copies for itself
(``copy.deepcopy(cache)`` inside ``f``) is each evaluation's own, and a cache ``f`` captures is
not looked for: such an ``f`` is the caller's choice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchgram._core.checks import fail
from torchgram._core.pytree import leaves_of


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
            inner = list(leaf.values()) if isinstance(leaf, Mapping) else []
            cache = next((item for item in (leaf, *inner) if _is_cache(item)), None)
            if cache is not None:
                fail(api, "arguments that f's evaluations leave as they found them",
                     f"a transformers {type(cache).__name__} in {where}, which the model's "
                     f"forward updates (it appends each call's keys and values): torchgram "
                     f"evaluates f several times per call, each evaluation would see the "
                     f"entries of the one before, and the cache would keep them all",
                     "Copy it inside f (past_key_values=copy.deepcopy(cache), the cache "
                     "captured), or pass its tensors and build the cache inside f.",
                     ValueError)


def _is_cache(obj: Any) -> bool:
    """Whether ``obj`` is a ``transformers`` cache."""
    return any(klass.__module__.startswith("transformers.") and klass.__name__.endswith("Cache")
               for klass in type(obj).__mro__)
