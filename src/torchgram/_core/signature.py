"""What a call's plan depends on, as a hashable key, and a small thread-safe LRU cache.

# NOTE [call signatures]
Probing ``f`` (its output structure) and tracing it (the structured backend's record of
which ops use which parameter) cost a forward pass each. Both depend only on the function
and on the *structure* of its arguments, so they are cached under a key made of:

* the function, known by its code object and the identities of its bound instance and of
  its closure's contents (never a reference to them: a key keeps nothing alive);
* every argument's pytree structure (a dict's keys) and leaves: tensors by shape, dtype,
  device and ``requires_grad``, other leaves by type;
* the differentiated positions, ``has_aux`` and the batch structure.

A cached entry may still be stale (``f`` branches on data, or on a module's ``training``
flag, which the key cannot see): every use of one is checked against the run it describes
(NOTE [declared inability] for the output, NOTE [stale probes] for the calls a probe found,
``TraceMismatch`` for traces), and a stale entry is dropped and recomputed, so a cache hit
can cost time but never correctness.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Generic, TypeVar

import optree
from torch import Tensor

Value = TypeVar("Value")


def function_identity(f: Callable[..., Any]) -> tuple[Any, ...] | None:
    """``f``'s code object, the id of its bound instance and of its closure's contents.

    ``None`` when ``f`` has no code object to key on (e.g. a builtin): such calls are not
    cached.

    Example:
        >>> function_identity(lambda x: x)[1:]
        (0, ())
        >>> function_identity(abs) is None
        True
    """
    code = getattr(f, "__code__", None)
    if code is not None:
        return code, 0, _closure_ids(f)
    func = getattr(f, "__func__", None)
    if func is not None and getattr(func, "__code__", None) is not None:
        return func.__code__, id(getattr(f, "__self__", None)), _closure_ids(func)
    method = type(f).__call__ if callable(f) else None  # a callable object
    call = getattr(method, "__code__", None)
    return None if call is None else (call, id(f), ())


def _closure_ids(func: Any) -> tuple[int, ...]:
    ids = []
    for cell in getattr(func, "__closure__", None) or ():
        try:
            ids.append(id(cell.cell_contents))
        except ValueError:  # an empty cell
            ids.append(0)
    return tuple(ids)


def _describe(leaf: Any) -> Hashable:
    if isinstance(leaf, Tensor):
        return ("T", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.layout, leaf.requires_grad)
    return type(leaf).__name__


def call_signature(f: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any],
                   *extra: Hashable) -> Hashable | None:
    """The key of NOTE [call signatures], or ``None`` when ``f`` cannot be keyed.

    ``extra`` adds what else the cached value depends on (differentiated positions, batch
    structure, ``has_aux``...).
    """
    identity = function_identity(f)
    if identity is None:
        return None
    described_args = tuple(_describe_tree(arg) for arg in args)
    described_kwargs = tuple(sorted((name, _describe_tree(value))
                                    for name, value in kwargs.items()))
    return identity, described_args, described_kwargs, extra


def _describe_tree(tree: Any) -> Hashable:
    """A pytree argument's structure (its keys: parameter names) and its leaves' descriptions.

    The structure counts since ``f`` is known by identities the garbage collector reuses:
    two test cases' ``lambda p, x: f(p, x).sum(1)`` around ``{"adapter": [0, 3], "w": [5, 3]}``
    and ``{"extra": [0, 3], "w": [5, 3]}`` had one key when the second closure took the first's
    id, and the second call ran the first's trace (one that used ``w`` in ``torch.cat``, a
    fallback leaf: right, but one sample at a time; session 40).
    """
    leaves, structure = optree.tree_flatten(tree)
    return structure, tuple(_describe(leaf) for leaf in leaves)


class LruCache(Generic[Value]):
    """A bounded least-recently-used cache, safe to use from several threads.

    Example:
        >>> cache = LruCache[int](maxsize=2)
        >>> cache.put("a", 1); cache.put("b", 2); cache.put("c", 3)
        >>> cache.get("a") is None, cache.get("c")
        (True, 3)
    """

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._entries: OrderedDict[Hashable, Value] = OrderedDict()
        self._lock = threading.Lock()
        _CACHES.add(self)

    def get(self, key: Hashable | None) -> Value | None:
        """The value under ``key`` (marked as recently used), or ``None``."""
        if key is None:
            return None
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: Hashable | None, value: Value) -> None:
        """Store ``value`` under ``key`` (nothing for a ``None`` key), evicting the oldest."""
        if key is None:
            return
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)

    def pop(self, key: Hashable | None) -> None:
        """Forget ``key`` (a stale entry)."""
        if key is None:
            return
        with self._lock:
            self._entries.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        """Forget every entry."""
        with self._lock:
            self._entries.clear()


_CACHES: weakref.WeakSet[LruCache[Any]] = weakref.WeakSet()


def clear_caches() -> None:
    """Forget every cached probe, trace and decision (NOTE [call signatures]).

    Entries are checked on use, so this changes no result; it gives the next calls the cold
    start of a fresh process (tests that compare predictions with runs use it: a key holds
    ids, which Python reuses once their objects are collected, so a later function can hit an
    earlier one's entry and be re-planned only when it runs).
    """
    for cache in list(_CACHES):
        cache.clear()
