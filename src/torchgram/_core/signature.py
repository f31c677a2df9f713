"""What a call's plan depends on, as a hashable key, and a small thread-safe LRU cache.

# NOTE [call signatures]
Probing ``f`` (its output structure) and tracing it (the structured backend's record of
which ops use which parameter) cost a forward pass each. Both depend only on the function
and on the *structure* of its arguments, so they are cached under a key made of:

* the function, known by its code object and the identities of its bound instance and of
  its closure's contents (never a reference to them: a key keeps nothing alive). An
  object that takes a weak reference (a function, a module, a tensor) is named by a serial
  number given to it for its lifetime (NOTE [identities]), so a function over such objects
  never takes the entries of one that died; ints, strings, tuples, lists and dicts are named
  by their id, which Python reuses;
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

import functools
import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Generic, TypeVar

import optree
from torch import Tensor

Value = TypeVar("Value")


# NOTE [identities]
# A key names the objects f is made of (its closure's contents, its bound instance) without
# holding them. Their ids alone were not enough: Python gives a new object the id of one that
# died, so in a sweep over models -- `for config in configs: model = build(config); fn, params
# = tg.functionalize(model); tg.gramian(lambda p, x: loss(fn(p, x)), ...)` -- each iteration's
# lambda had the last one's key whenever the new `fn` took the dead one's id, and its call ran
# under the dead function's probe: a model whose embedding renormalises its rows in place
# (max_norm) after one that does not had its table changed by every call, and a module writing
# into its own buffer ran where a fresh probe refuses it (session 49; the key was the same in
# 20 of 20 iterations). An object that takes a weak reference now gets a serial number the
# first time a key names it, kept until it dies and never given again. Immutable values that
# take none are named by their value: numbers, strings and bytes by type and value, tuples
# by their items' identities (a sweep's ``lambda p, x, dims=(0, i): ...``
# made a fresh tuple default per iteration, which took a dead one's id: ``tg.explain``
# reported another function's leaves in 2 of 20 iterations, session 66's review; fixed in
# session 67). The rest (lists, dicts, other objects without weak references) are named by
# their id: mutable, their value is no key.

_serials = itertools.count(1)
_SERIALS: dict[int, tuple[weakref.ref[Any], int]] = {}
_SERIALS_LOCK = threading.RLock()  # a collection inside may run a callback that takes it


def identity(obj: Any) -> Hashable:
    """``obj``'s identity in a key (NOTE [identities]): a serial number for its lifetime.

    Immutable values that take no weak reference are named by their value (numbers,
    strings, tuples of them), the other such objects (lists, dicts) by ``("id", id(obj))``.

    Example:
        >>> class Model:
        ...     pass
        >>> model = Model()
        >>> identity(model) == identity(model) != identity(Model())
        True
        >>> identity(3)
        ('value', <class 'int'>, 3)
        >>> identity((1, "a")) == identity((1, "a")) != identity((1.0, "a"))
        True
        >>> identity([3])
        ('id', ...)
    """
    return _identity(obj, _VALUE_DEPTH)


_VALUE_DEPTH = 4
"""How deep :func:`identity` names nested tuples by their items (deeper: by id)."""
_VALUES = (bool, int, str, bytes, type(None), type(Ellipsis))
_FLOATS = (float, complex)  # by repr: -0.0 is not 0.0, and NaN is itself


def _identity(obj: Any, depth: int) -> Hashable:
    kind = type(obj)  # exact types: a subclass may hold more than its value
    if kind in _VALUES:
        return ("value", kind, obj)
    if kind in _FLOATS:
        return ("value", kind, repr(obj))
    if kind is tuple and depth > 0 and len(obj) <= 64:
        return ("tuple", *(_identity(item, depth - 1) for item in obj))
    key = id(obj)
    with _SERIALS_LOCK:
        known = _SERIALS.get(key)
        if known is not None and known[0]() is obj:
            return known[1]
        try:
            ref = weakref.ref(obj, functools.partial(_forget_serial, key))
        except TypeError:  # lists, dicts, deeper tuples, objects without weak references
            return ("id", key)
        serial = next(_serials)
        _SERIALS[key] = (ref, serial)
        return serial


def _forget_serial(key: int, ref: weakref.ref[Any]) -> None:
    """Weak-reference callback: ``ref``'s object died; free its id's entry (if still its)."""
    if _SERIALS_LOCK is None:  # the interpreter is shutting down: this module's globals are gone
        return
    with _SERIALS_LOCK:
        known = _SERIALS.get(key)
        if known is not None and known[0] is ref:
            del _SERIALS[key]


def function_identity(f: Callable[..., Any]) -> tuple[Any, ...] | None:
    """``f``'s code object, the identities of its bound instance, closure's contents, defaults.

    Identities as :func:`identity` gives them (NOTE [identities]). The defaults count: the
    lambdas of ``[lambda p, x, g=g: g(p, x).sum(-1) for g in layers]`` share their code and
    differ only there (``tg.explain`` reported the first one's leaves for the others; a
    helper's hunt, session 66). ``None`` when ``f`` has no code object to key on (e.g. a
    builtin): such calls are not cached.

    Example:
        >>> function_identity(lambda x: x)[1:]
        (0, (), ())
        >>> make = [lambda x, k=k: x * k for k in (object(), object())]
        >>> function_identity(make[0]) != function_identity(make[1])
        True
        >>> function_identity(abs) is None
        True
    """
    code = getattr(f, "__code__", None)
    if code is not None:
        return code, 0, _closure_identities(f), _default_identities(f)
    func = getattr(f, "__func__", None)
    if func is not None and getattr(func, "__code__", None) is not None:
        return (func.__code__, identity(getattr(f, "__self__", None)), _closure_identities(func),
                _default_identities(func))
    method = type(f).__call__ if callable(f) else None  # a callable object
    call = getattr(method, "__code__", None)
    return None if call is None else (call, identity(f), ())


def _closure_identities(func: Any) -> tuple[Any, ...]:
    identities: list[Any] = []
    for cell in getattr(func, "__closure__", None) or ():
        try:
            identities.append(identity(cell.cell_contents))
        except ValueError:  # an empty cell
            identities.append(0)
    return tuple(identities)


def _default_identities(func: Any) -> tuple[Any, ...]:
    positional = tuple(identity(value) for value in getattr(func, "__defaults__", None) or ())
    keywords = getattr(func, "__kwdefaults__", None) or {}
    return positional + tuple(sorted((name, identity(value)) for name, value in keywords.items()))


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
    start of a fresh process (tests that compare predictions with runs use it: a key may hold
    ids, which Python reuses once their objects are collected (NOTE [identities]), so a later
    function can hit an earlier one's entry and be re-planned only when it runs).
    """
    for cache in list(_CACHES):
        cache.clear()
