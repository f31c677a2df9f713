"""``f`` writing into tensors it did not make: refused before the write, in the probe.

NOTE [captured writes]
torchgram evaluates ``f`` several times per call (the probe, the passes, the per-sample
checks), so an ``f`` that writes into a tensor it captured or received -- a module buffer
updated in place by its forward when ``f`` is ``functional_call(model, p, (x,))`` (an EMA of
activations, a step counter other than batch norm's, a codebook), or its own input changed
in place -- changes the caller's tensor once per evaluation, and each evaluation computes
another function. Before session 40 ``structured`` and ``auto`` gave wrong matrices there
(0.17 and 0.47 off, relative, an EMA subtracted in the forward) and ``graph`` the right one,
all three leaving the caller's buffer updated several times (``jacobian`` and ``ntvp``
declined: torch refuses such writes under its transforms). The probe, ``f``'s first
evaluation for a call signature, runs under :class:`CapturedWrites`: a write (a method
ending in ``_``, ``copy_``, item assignment, an ``out=`` argument) into a tensor ``f``
captured or received -- or into its memory through any alias: a view, ``.detach()``,
``.data`` (by storage since session 49; a ``.detach()`` alias, which has no base, used to get
through) -- raises :class:`CapturedWrite` before it happens, which the API turns into a
``ValueError`` naming the fix (``tg.functionalize``, whose calls work on copies of the
module's buffers; for an embedding's ``max_norm`` on a table that is not differentiated, the
table among the parameters, or renormalised once beforehand; for a tensor among ``f``'s
arguments -- Whisper's SpecAugment writes ``input_features[mask] = 0`` in training mode --
the argument by name, and a clone inside ``f``, since ``tg.functionalize`` copies buffers
only: :func:`argument_memory`). An ``F.embedding`` or
``F.embedding_bag`` with ``max_norm`` counts as a write into its table (the renormalisation
runs inside it, where no torch-function mode sees it). What ``f`` captured is found before
the evaluation (:func:`captured_memory`): the tensors of its arguments, and those its closure, bound
instance, defaults and the globals its code names hold, through containers, partials,
nested functions and modules (their parameters and buffers). A first version refused writes
into every tensor no call of the evaluation made, and so a fresh ``torch.FloatTensor(4)
.fill_(0.5)`` (legacy constructors make tensors without a torch call). The leaves' copies
that the probe gives ``f`` are its own (an embedding's ``max_norm`` renormalises its table in
place: NOTE [probing]); batch norm's running statistics never reach the mode (NOTE [frozen
running statistics] drops them first).

NOTE [writes into the parameters]
The probe evaluates ``f`` on copies of the differentiated parameters, and where ``f`` wrote
into them every evaluation of the call works on one set of copies (``Probe.mutates_leaves``),
so that the caller's tensors stay as they are. That is right for the one write it was made
for, an embedding's ``max_norm``, which renormalises rows only where they need it (NOTE
[renormalised once]): every evaluation sees the same values. Any other write made each
evaluation see other values (``with torch.no_grad(): p["v"].add_(1.0)`` in ``f``: every
evaluation after the first added one more) and ``auto``, ``structured``, ``jacobian`` and
``ntvp`` gave matrices 0.05 to 8 off, relative, without a word (a helper's hunt, session
66; a module's forward doing ``self.weight.mul_(1.1)`` through ``tg.functionalize`` alike).
Such an ``f`` changes what it differentiates with every call: the probe now refuses a write
into the differentiated parameters other than an embedding's renormalisation, with the
``ValueError`` of the captured writes, naming the parameter's shape and the fixes (the
update outside ``f``, or its value computed out of place inside ``f``). The later
evaluations' guards refuse such a write into their parameters too (an ``UnseenWrite``: the
call probes the whole batch afresh, which refuses it): a probe of one sample that saw only
an embedding's renormalisation, and an ``f`` writing only on the batch, had the copies
written on every evaluation (20-30 off; the review).

NOTE [writes under a cached probe]
Later calls of a call signature reuse its probe (NOTE [call signatures]), and a probe may be
another f's: a module-level function reads the model from a global that now names another
model; a sweep rebuilds the model per configuration. Such a call ran without the probe's
checks of writes: an embedding with ``max_norm`` after a model without one renormalised the
caller's table in place on every call, and a module updating its own buffer in its forward
changed it, where a fresh probe works on copies or refuses (session 49). Evaluations under a
cached probe (since, after a fresh one too: NOTE [writes its probe did not see]) therefore
run under :class:`StaleWrites`: before a write into the memory of a tensor that ``f``
captured or received (the parameters included, through any alias such as
``weight.detach()``), it raises ``OutputChanged``, and the call probes afresh and starts
over. What ``f`` captured is found once per call: before its first evaluation where the
probe saw ``f`` write into any tensor (``Probe.writes``), since during one
``torch.func.functional_call`` may hold the call's own copies in the module (found then, they
made every write the probe allowed look stale, and every call probe again); at the first
write otherwise, which costs nothing to the many functions that never write (the walk is
26 us a call for the benchmark MLP, 1% of it). There the module holds no copies (a probe that
saw no write saw no ``max_norm``: the leaves are the caller's), and should the lookup still
take a copy for the caller's, the call probes afresh, sees the write, and later calls look
first.

NOTE [writes its probe did not see]
A fresh probe is no surer than a cached one. With ``batch_dim`` it evaluates one sample, and
an ``f`` that writes only on larger batches (an EMA of the batch's mean, skipped for a
single sample) or only for some samples' values (a counter of out-of-range inputs, where
sample 0 is in range) wrote into the caller's buffer on every backend, and ``structured``
and ``auto`` gave a matrix of several functions (0.044 off, relative), where the same call
without ``batch_dim`` refused (a hunt after session 50). So every evaluation after a probe,
fresh or cached, runs under :class:`StaleWrites`, which raises
:class:`~torchgram._core.errors.UnseenWrite` (an ``OutputChanged``) before such a write; the
problem notes it, and ``forget_probe`` has the signature's next probe evaluate the whole
batch, where it sees the write: it then refuses as it would without ``batch_dim`` (or works
on copies of leaves ``f`` renormalises). Where an evaluation after that probe writes again
(``f`` wrote only on its later calls), the call raises that same ``ValueError``
(``errors.output_changed_refusal``). A per-sample way that meets the refusal falls back to
the whole batch's rows (it catches ``OutputChanged``), which is then refused in turn or,
where the whole batch does not write, right. An ``f`` that never writes pays one mode on the
evaluations of a call that probes; the calls of a cached probe already ran under it. On the
benchmark MLP (``batch_dim=0``, one thread) no change was measurable: a first call 29.0 ms
before, 29.2 after; a cached one 7.5 and 7.1 (medians of 20 calls, alternating).
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import functools
import inspect
import itertools
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.overrides import TorchFunctionMode

from torchgram._core._torch_compat import innermost
from torchgram._core.errors import CapturedWrite, UnseenWrite
from torchgram._core.pytree import leaves_of

_NOT_WRITES = frozenset({"requires_grad_", "share_memory_"})
"""Methods ending in ``_`` that change no entries (a flag, the memory's placement)."""


_RENORMING = {F.embedding: 3, F.embedding_bag: 3}
"""Calls that renormalise rows of their weight (``args[1]``) in place given ``max_norm``
(its position): the write happens inside them, where no torch-function mode sees it."""


def _max_norm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``max_norm`` a call of :data:`_RENORMING` was given (``None``: none)."""
    position = _RENORMING[func]
    return args[position] if len(args) > position else kwargs.get("max_norm")


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """The tensor ``func`` writes into, or ``None`` for a call that writes into none."""
    if func in _RENORMING:
        max_norm = _max_norm(func, args, kwargs)
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        if isinstance(weight, Tensor) and not weight.is_floating_point() and args \
                and isinstance(args[0], Tensor) and args[0].is_floating_point():
            weight = args[0]  # embedding_bag's deprecated (weight, input) order, which it swaps
        return weight if max_norm is not None and isinstance(weight, Tensor) else None
    out = kwargs.get("out")
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    name = getattr(func, "__name__", "")
    first = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
    if not isinstance(first, Tensor) or name in _NOT_WRITES:  # torch.nn.init's functions pass
        return None  # their tensor by keyword (``tensor=``): a write missed before session 66
    if name == "__setitem__" or (name.endswith("_") and not name.startswith("__")):
        return first
    return None


def _root(tensor: Tensor) -> Tensor:
    while tensor._base is not None:
        tensor = tensor._base
    return tensor


_DEPTH = 6
"""How deep :func:`captured_roots` follows containers, functions and objects."""
_WIDTH = 4096
"""Containers larger than this are not looked into (a global dataset: the probe stays cheap)."""


def captured_memory(f: Any, args: Any, own: Iterable[Tensor] = ()) -> frozenset[int]:
    """Where the memory of the tensors ``f`` captured or received in ``args`` starts.

    One address per storage (:func:`memory_of`), so that a write through any alias of such a
    tensor is seen: a view, ``.detach()``, ``.data``. ``own``'s memory is excluded (the
    probe's copies of the parameters), and so are tensors without memory.

    Example:
        >>> import torch
        >>> state, x = torch.zeros(3), torch.ones(3)
        >>> found = captured_memory(lambda x: x + state, (x,))
        >>> memory_of(state.detach()) in found, memory_of(x[1:]) in found
        (True, True)
        >>> memory_of(torch.zeros(1)) in found
        False
    """
    excluded = {memory_of(tensor) for tensor in own} | {0}
    return frozenset(memory_of(root) for root in captured_roots(f, args).values()) - excluded


def captured_roots(f: Any, args: Any) -> dict[int, Tensor]:
    """The tensors (roots, by id) ``f`` captured or received: see :func:`captured_memory`."""
    found: dict[int, Tensor] = {}

    def add(tensor: Tensor) -> None:
        root = _root(tensor)
        found[id(root)] = root

    def add_module(module: nn.Module) -> None:
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            add(tensor)

    reach(f, args, add, add_module)
    return found


def reach(f: Any, args: Any, on_tensor: Callable[[Tensor], None],
          on_module: Callable[[nn.Module], None], *, budget: int | None = None,
          width: int = _WIDTH, tensor_containers: bool = True,
          on_object: Callable[[Any], None] | None = None, by_class: bool = False) -> None:
    """Call ``on_tensor`` / ``on_module`` on what ``f`` captured or received.

    ``on_object``, when given, is called on every other object visited. ``by_class``: read
    objects by their class and the built-in types' own methods, running none of their code
    (NOTE [walks that run no user code]); else as ``isinstance``, ``vars`` and a container's
    ``values()`` see them (a proxy as its referent, a mapping subclass by its own view).

    Its arguments ``args``, and what its closure, bound instance, defaults and the globals its
    code names hold, through containers (of at most ``width`` items), partials, nested
    functions and modules, up to ``_DEPTH`` levels (NOTE [captured writes]), nearest first;
    at most ``budget`` objects when given. Without ``tensor_containers``, a container of
    tensors only (a parameter dict, a dataset's list) is not looked into, and ``args`` is a
    sequence of the call's arguments, each a root.
    """
    # the objects themselves, not their ids: the walk makes temporaries (a bound method's
    # (self, func)), whose ids a later temporary reuses once they are freed -- a set of ids
    # skipped it as seen (a write into the second object's buffer missed: 3.5e-2 off, and
    # 7.6e-2 once the walk went breadth-first; session 60's review)
    seen: dict[int, Any] = {}
    level: list[Any] = [f, args] if tensor_containers else [f, *args]  # each argument a root
    visited = 0
    for _ in range(_DEPTH + 1):
        following: list[Any] = []
        for obj in level:
            try:
                if id(obj) in seen:
                    continue
                kind = _kind(obj, by_class)
                if kind is None:
                    continue
            except Exception:  # noqa: BLE001 -- a dead proxy, a __class__ that raises
                continue
            seen[id(obj)] = obj
            visited += 1
            if budget is not None and visited > budget:
                return
            if kind is Tensor:
                on_tensor(obj)
                continue
            if kind is nn.Module:
                on_module(obj)
            elif on_object is not None:
                on_object(obj)
            if budget is None or len(following) < budget:  # else it would not be visited
                with contextlib.suppress(Exception):  # what cannot be read is not followed
                    _queue_held(obj, kind, following, width, tensor_containers, by_class)
        level = following


_NOT_FOLLOWED = (str, bytes, int, float, bool, types.ModuleType, type)
_PROXIES = (weakref.ProxyType, weakref.CallableProxyType)


def _kind(obj: Any, by_class: bool) -> type | None:
    """``Tensor``, ``nn.Module``, ``object``, or ``None`` for what the walk does not follow.

    A weak proxy is taken for its referent either way (the caller's model held through one).
    """
    if by_class and type(obj) not in _PROXIES:
        klass = type(obj)
        if issubclass(klass, _NOT_FOLLOWED):
            return None
        return Tensor if issubclass(klass, Tensor) else nn.Module \
            if issubclass(klass, nn.Module) else object
    if isinstance(obj, _NOT_FOLLOWED):
        return None
    return Tensor if isinstance(obj, Tensor) else nn.Module \
        if isinstance(obj, nn.Module) else object


# NOTE [walks that run no user code]
# The module walk (NOTE [tensors hooks set], NOTE [generators f holds]) visits what modules
# hold, which a user's code never hands to torchgram: reading it must not run that code. Session
# 61's review found it importing ~1,190 modules through `transformers`' lazy mappings (their
# `values()`), raising through a lazy proxy's `__class__` and calling properties and
# `__getattr__`. It reads objects by their class (`by_class=True`): a dict or a list through
# the built-in types' methods (and a subclass's own attributes), an object through the
# `__dict__` its class lays out (`threading.local` and weak proxies through `vars`, which
# their types answer in C), and slots through their descriptors. The write guards' walk keeps
# reading as before (`isinstance`, `vars`, a mapping subclass's own `values()`): it must find
# every tensor `f` can write into, whatever holds it (the review after: a thread-local
# running mean, a model behind a `weakref.proxy` and a dict subclass keeping its values
# elsewhere were missed, 0.07-0.86 off, when it read by class).


def _queue_held(obj: Any, seen_as: type, following: list[Any], width: int,
                tensor_containers: bool, by_class: bool) -> None:
    """Queue in ``following`` what ``obj`` (not a tensor) holds.

    ``seen_as``: :func:`_kind`'s answer for it (``nn.Module`` or ``object``); ``by_class``:
    as for :func:`reach`.
    """
    kind = type(obj)
    if seen_as is nn.Module:
        following.append(vars(obj).get("forward"))
    elif issubclass(kind, CONTAINERS):
        if len(obj) <= width and (tensor_containers or not _tensors_only(obj)):
            following.extend(contents(obj) if by_class
                             else obj.values() if isinstance(obj, dict | types.MappingProxyType)
                             else obj)
        if kind not in CONTAINERS:  # a subclass keeping its values elsewhere
            following.extend(_attributes(obj, by_class))
    elif issubclass(kind, weakref.ref):  # a weak reference (alive: its object)
        following.append(obj())
    elif issubclass(kind, functools.partial):
        following.append((obj.func, obj.args, obj.keywords))
    elif issubclass(kind, types.MethodType):
        following.append((obj.__self__, obj.__func__))
    elif issubclass(kind, types.FunctionType):
        following.extend(_held_by_function(obj))
    else:  # a callable object, or one holding state (a helper of f keeping buffers in a
        following.extend(_attributes(obj, by_class))  # list, a dataclass of settings)
        following.extend(slot_values(obj))


CONTAINERS = (dict, list, tuple, set, frozenset, collections.deque, types.MappingProxyType)
"""The containers both walks look into (their items, by :func:`contents` where read by class)."""


def _attributes(obj: Any, by_class: bool) -> list[Any]:
    """``obj``'s attribute dict, as one item to walk (none where it has none)."""
    try:
        if not by_class or issubclass(type(obj), (*_PROXIES, threading.local)):
            attributes = vars(obj)  # (those two types answer it in C)
        elif type(obj).__dictoffset__ != 0:
            attributes = object.__getattribute__(obj, "__dict__")  # no __getattribute__ of its
        else:  # own
            return []
    except TypeError:  # no __dict__
        return []
    return [attributes] if isinstance(attributes, dict) else []


def contents(container: Any) -> list[Any]:
    """The values of a dict or the items of a list, tuple or set, by the built-in types' methods.

    A subclass's ``values()`` or ``__iter__`` is user code (``transformers``' lazy mappings
    import every model's module there; the review of session 61).
    """
    if isinstance(container, dict):
        return list(dict.values(container))
    if isinstance(container, types.MappingProxyType):
        return list(container.values())
    if isinstance(container, collections.deque):
        return list(collections.deque.__iter__(container))
    if isinstance(container, tuple):
        return list(tuple.__iter__(container))
    if isinstance(container, list):
        return list(list.__iter__(container))
    return list(set.__iter__(container) if isinstance(container, set)
                else frozenset.__iter__(container))


_HIDDEN_DEPTH = 4
"""How deep :func:`hidden_tensor` looks into an opaque leaf."""
_HIDDEN_BUDGET = 256
"""How many objects :func:`hidden_tensor` visits at most per leaf."""
_NOT_HOLDERS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device,
                type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
                types.MethodType, functools.partial, torch.Generator)
"""What :func:`hidden_tensor` does not look into (values, classes, code: a function's globals
are not what the leaf holds)."""


def hidden_tensor(leaf: Any) -> Tensor | None:
    """A floating tensor that a non-tensor pytree leaf holds, or ``None``.

    NOTE [tensors inside opaque leaves]: optree sees an object of a class it does not know (a
    ``types.SimpleNamespace``, a dataclass not registered as a pytree node, a read-only
    mapping, an ``nn.Module``) as one leaf, and a leaf that is not a tensor is a constant, so
    the tensors it holds would be left out of ``J`` without a word (0.69 off on a helper's
    case, session 66; ``torch.func.jacrev`` raises there). Looked for up to
    ``_HIDDEN_DEPTH`` levels deep and ``_HIDDEN_BUDGET`` objects, cycles included: attributes
    (``__dict__``, every class's ``__slots__``), containers' items, a mapping's values, a
    module's parameters, buffers and public attributes; not into functions (their globals
    are not the leaf's).

    Example:
        >>> hidden_tensor(types.SimpleNamespace(scale=torch.ones(2), name="a")).shape
        torch.Size([2])
        >>> hidden_tensor(3) is None and hidden_tensor(types.SimpleNamespace(k=3)) is None
        True
        >>> cyclic = []
        >>> cyclic.append(cyclic)
        >>> hidden_tensor(types.SimpleNamespace(items=cyclic)) is None
        True
    """
    if isinstance(leaf, Tensor):
        return None
    seen: dict[int, Any] = {}  # the objects themselves: ids of temporaries are reused
    level: list[Any] = [leaf]
    for _ in range(_HIDDEN_DEPTH + 1):
        following: list[Any] = []
        for obj in level:
            if id(obj) in seen or isinstance(obj, _NOT_HOLDERS):
                continue
            if isinstance(obj, Tensor):
                if obj.is_floating_point():
                    return obj
                continue
            seen[id(obj)] = obj
            if len(seen) > _HIDDEN_BUDGET:
                return None
            with contextlib.suppress(Exception):  # what cannot be read is not followed
                following.extend(_held_by_leaf(obj))
        level = following
    return None


def _held_by_leaf(obj: Any) -> list[Any]:
    """What :func:`hidden_tensor` looks at next inside ``obj``."""
    if isinstance(obj, nn.Module):
        return [*obj.parameters(), *obj.buffers(),
                *(value for name, value in vars(obj).items() if not name.startswith("_"))]
    if isinstance(obj, CONTAINERS):
        return contents(obj)[:_WIDTH] if len(obj) <= _WIDTH else []
    if isinstance(obj, collections.abc.Mapping):
        return list(obj.values())[:_WIDTH]
    held = [value for attributes in _attributes(obj, False) for value in attributes.values()]
    return held + slot_values(obj)


def slot_values(obj: Any) -> list[Any]:
    """The values of ``obj``'s slots that are set, read through the slots' own descriptors.

    A property or ``__getattr__`` of the class is not run.
    """
    values = []
    for klass in type(obj).__mro__:
        for name in slot_names(klass):
            descriptor = vars(klass).get(name)
            if isinstance(descriptor, types.MemberDescriptorType):
                with contextlib.suppress(AttributeError):  # not set
                    values.append(descriptor.__get__(obj, type(obj)))
    return values


def slot_names(klass: type) -> tuple[str, ...]:
    """The attribute names of a class's ``__slots__`` (private ones mangled), if any.

    Example:
        >>> class Settings:
        ...     __slots__ = ("rate", "__seed")
        >>> slot_names(Settings)
        ('rate', '_Settings__seed')
    """
    slots = vars(klass).get("__slots__", ())
    names = (slots,) if isinstance(slots, str) else tuple(slots)
    return tuple(f"_{klass.__name__.lstrip('_')}{name}"
                 if name.startswith("__") and not name.endswith("__") else name
                 for name in names)


def _tensors_only(items: Sequence[Any] | Any) -> bool:
    """Whether a container holds tensors only (its first, middle and last beyond 256 items).

    A parameter dict, a dataset's list: what ``reach(tensor_containers=False)`` does not look
    into (a module between two tensors was missed when only the ends counted; the review of
    session 60).
    """
    values = contents(items)
    if not values:
        return False
    if len(values) > _CHECKED_ITEMS:
        values = [values[0], values[len(values) // 2], values[-1]]
    return all(issubclass(type(value), Tensor) for value in values)


_CHECKED_ITEMS = 256


def _held_by_function(func: types.FunctionType) -> list[Any]:
    """What a plain function holds: closure cells, defaults, the globals its code names."""
    held: list[Any] = []
    for cell in func.__closure__ or ():
        try:
            held.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    held.append((func.__defaults__, func.__kwdefaults__))
    codes = [func.__code__]
    while codes:  # the names of nested functions' code too (lambdas defined in f)
        code = codes.pop()
        held.extend(func.__globals__[name] for name in code.co_names
                    if name in func.__globals__)
        codes.extend(const for const in code.co_consts if isinstance(const, types.CodeType))
    return held


# NOTE [data assigned to itself]
# ``module.to(dtype)`` or ``module.float()`` in ``f`` runs ``nn.Module._apply``, which assigns
# ``param.data = param.to(dtype)`` to every parameter even when nothing changes (``to`` then
# returns ``param`` itself): ``transformers``' Switch router does it on every call. Inside a
# ``torch.func`` transform torch refuses it ("mutating directly with `.data` inside functorch
# transform") when the parameter is a transform's tensor (``functional_call`` swapped it in:
# the Switch router), and crashes the process (a segmentation fault, plain ``jacrev`` too)
# when ``f`` calls it on the module's own parameters while their values are differentiated
# (session 60's hunt and review: the default ``tg.gramian(f)``, jacobian, ntvp). Such an
# assignment changes nothing, so every evaluation's write guard skips it (the Switch router
# then runs on jacobian too); one on a tensor ``f`` captured is noted in the probe
# (``Probe.assigns_data``), and the backends that evaluate ``f`` under transforms decline it
# before their first evaluation (``refuse_data_assignments``): what crashes there is torch's
# own bookkeeping of that module, not the assignment.
_DATA_SLOT = torch._C.TensorBase.__dict__["data"]


class _WriteGuard(TorchFunctionMode):
    """Refuses, before it happens, a write into memory ``f`` captured or received.

    ``captured`` gives :func:`captured_memory`'s addresses (called at each write: a caller
    that looks them up lazily memoises them); subclasses say how to refuse. Every evaluation
    of ``f`` runs under one, so it also hands ``on_generator`` each ``torch.Generator`` a call
    is given, before the call draws from it (NOTE [explicit generators]).
    """

    def __init__(self, captured: Callable[[], frozenset[int]],
                 on_generator: Callable[[torch.Generator], None] | None = None,
                 parameters: Sequence[Tensor] = ()) -> None:
        super().__init__()
        self._captured = captured
        self._on_generator = on_generator
        self._given_parameters = parameters
        self._parameter_memory: dict[int, Tensor] | None = None  # found at the first write
        self.wrote = False
        """Whether ``f`` wrote into any tensor (its own included)."""
        self.assigned_data = False
        """Whether ``f`` assigned a captured tensor's ``.data`` to itself (NOTE [data assigned
        to itself])."""
        self.renormalised: set[int] = set()
        """The memory of the tensors an embedding's ``max_norm`` renormalised (NOTE [writes
        no mode sees])."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        assigns_data = getattr(func, "__self__", None) is _DATA_SLOT and len(args) == 2
        if assigns_data and args[0] is args[1]:  # NOTE [data assigned to itself]
            self.assigned_data = self.assigned_data or (
                isinstance(args[0], Tensor) and memory_of(args[0]) in self._captured())
            return None
        generator = kwargs.get("generator")
        if self._on_generator is not None and isinstance(generator, torch.Generator):
            self._on_generator(generator)
        # ``t.data = other`` replaces t's values: a write into t (NOTE [writes no mode sees])
        target = args[0] if assigns_data else _written(func, args, kwargs)
        if isinstance(target, Tensor):
            self.wrote = True
            memory = memory_of(target)
            if assigns_data and memory in self._parameters() and _same_values(args[1], target):
                pass  # a parameter converted (module.to(dtype) in f), its values kept
            elif assigns_data and _unchanged(args[1], target):  # buffer.data = buffer.to(device)
                self.assigned_data = self.assigned_data or memory in self._captured()
            elif memory in self._captured() or self._refuses_own(func, memory):
                self._refuse(".data assignment" if assigns_data
                             else getattr(func, "__name__", "a write"), memory)
            if func in _RENORMING:
                self.renormalised.add(memory)
        return func(*args, **kwargs)

    def _refuse(self, write: str, memory: int) -> None:
        raise NotImplementedError

    def _refuses_own(self, func: Any, memory: int) -> bool:
        """A write into a differentiated parameter, other than an embedding's renormalisation.

        NOTE [writes into the parameters]: the evaluation's parameters (the probe's copies,
        or the call's own copies where ``f`` renormalises an embedding) are not captured.
        """
        return func not in _RENORMING and memory in self._parameters()

    def _parameters(self) -> dict[int, Tensor]:
        """The memory of the evaluation's differentiated parameters, each with its tensor."""
        if self._parameter_memory is None:
            self._parameter_memory = {memory_of(tensor): tensor
                                      for tensor in self._given_parameters}
            self._parameter_memory.pop(0, None)
        return self._parameter_memory


# NOTE [writes no mode sees]
# A write guard sees what passes through torch's function modes, and three ways of changing a
# tensor do not: ``t.data = other`` (a descriptor's ``__set__``, which a mode sees, but the
# guards took only ``t.data = t`` for what it is, NOTE [data assigned to itself]),
# ``Tensor.set_`` (no torch-function dispatch at all) and a write through a numpy view
# (``t.detach().numpy()``). In ``f``, on its parameters, each gave a wrong matrix without a
# word: ``auto`` 1.5 off (relative) for ``p["v"].data = 2 * p["v"]``, ``structured`` 32 and
# ``jacobian`` 130 for ``set_``, ``auto`` 7.6 for a numpy write, which also changed the
# caller's tensor (session 67; the first found by session 66's review). The guards now take
# ``t.data = other`` for a write into ``t``; and after the probe, each copy of a parameter
# whose values are no longer the caller's bit for bit -- other than where an embedding's
# ``max_norm`` renormalised it, the one write the copies were made for -- is refused as a
# write into the parameters (NOTE [writes into the parameters]). A write that keeps the
# values (cuDNN's ``flatten_parameters`` moves an LSTM's weights into one buffer with
# ``set_``) is not refused. Later evaluations are not compared: an ``f`` that writes this way
# only on the batch, or into a tensor it captured, is not caught.


def parameter_changed_unseen(leaves: Sequence[Tensor], originals: Sequence[Tensor],
                             renormalised: Iterable[int], memory: Sequence[int]) -> Tensor | None:
    """The first of ``originals`` whose copy among ``leaves`` ``f`` changed unseen, or ``None``.

    NOTE [writes no mode sees]. ``memory`` is each copy's :func:`memory_of` before ``f`` ran,
    ``renormalised`` the guard's :attr:`_WriteGuard.renormalised`.

    Example:
        >>> import torch
        >>> original = torch.ones(3)
        >>> copy = original.clone()
        >>> before = [memory_of(copy)]
        >>> parameter_changed_unseen([copy], [original], set(), before) is None
        True
        >>> with torch.no_grad():
        ...     copy.set_(torch.full((3,), 2.0))  # no torch-function mode sees set_
        tensor([2., 2., 2.])
        >>> parameter_changed_unseen([copy], [original], set(), before) is original
        True
    """
    exempt = set(renormalised)
    for leaf, original, where in zip(leaves, originals, memory, strict=True):
        if where in exempt or memory_of(leaf) in exempt:  # (a table converted, then renormalised)
            continue
        if not _same_values(leaf, original):
            return original
    return None


_SAME_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _unchanged(value: Any, target: Tensor) -> bool:
    """Whether ``target.data = value`` keeps ``target``'s values, dtype and device.

    Such an assignment changes nothing (``self.pe.data = self.pe.data.to(x.device)`` on the
    device it is on; ``x.data = x.data.contiguous()``): noted as NOTE [data assigned to
    itself] notes ``t.data = t``, not refused (session 67's review: refused on every backend,
    where auto and graph were right).
    """
    return isinstance(value, Tensor) and value.dtype == target.dtype \
        and value.device == target.device and _same_values(value, target)


def _same_values(tensor: Any, original: Tensor) -> bool:
    """Whether ``tensor`` holds ``original``'s values, converted to its dtype and device.

    Bit for bit, NaN equal to itself; a conversion (``module.to(dtype)`` in ``f`` assigns
    ``param.data = param.to(dtype)``) keeps them. A transform's tensors are not compared
    (they refuse ``set_`` and numpy views, and keep their own layout).
    """
    if not isinstance(tensor, Tensor) or innermost(tensor) is not tensor \
            or innermost(original) is not original:
        return isinstance(tensor, Tensor)
    if tensor.layout != torch.strided or original.layout != torch.strided \
            or tensor.device.type == "meta" or original.device.type == "meta":
        return True  # nothing to compare (sparse leaves; parameters a plan only shapes)
    if tensor.shape != original.shape:
        return False
    width = _SAME_WIDTH.get(tensor.element_size())
    with torch._C.DisableTorchFunction(), torch.no_grad():
        original = original.to(device=tensor.device, dtype=tensor.dtype)
        if width is None or tensor.is_complex():
            return bool(torch.equal(tensor, original))
        return bool(torch.equal(tensor.view(width), original.view(width)))


class CapturedWrites(_WriteGuard):
    """Raises :class:`CapturedWrite` before a write into memory ``f`` captured or received.

    Args:
        captured: :func:`captured_memory`'s addresses (their tensors alive for the whole
            evaluation, so no tensor made during it takes their memory).
        arguments: :func:`argument_memory`'s names of those that are ``f``'s inputs, for
            the error to name the argument written into.
        parameters: The probe's copies of the differentiated parameters: a write into one is
            refused too, unless it is an embedding's ``max_norm`` renormalisation (NOTE
            [writes into the parameters]).

    ``wrote`` (whether ``f`` wrote into any tensor) is ``Probe.writes``.

    Example:
        >>> import torch
        >>> buffer = torch.zeros(3)
        >>> with CapturedWrites(captured_memory(lambda: buffer, ())):
        ...     h = torch.FloatTensor(3).fill_(2.0)  # made here (a legacy constructor): fine
        ...     buffer.detach().add_(h)  # captured, through an alias
        Traceback (most recent call last):
        ...
        torchgram._core.errors.CapturedWrite: add_
    """

    def __init__(self, captured: frozenset[int],
                 on_generator: Callable[[torch.Generator], None] | None = None,
                 arguments: Mapping[int, str] | None = None,
                 parameters: Sequence[Tensor] = ()) -> None:
        super().__init__(lambda: captured, on_generator, parameters)
        self._arguments = arguments or {}

    def _refuse(self, write: str, memory: int) -> None:
        parameter = self._parameters().get(memory)
        if parameter is not None:
            raise CapturedWrite(write, f"a differentiated parameter of shape "
                                f"{tuple(parameter.shape)}", parameter=True)
        raise CapturedWrite(write, self._arguments.get(memory))


_SINGLE = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
           inspect.Parameter.KEYWORD_ONLY)
"""Kinds of parameters that take one argument each (not ``*args``, ``**kwargs``)."""


def argument_memory(f: Any, args: Sequence[Any], kwargs: Mapping[str, Any],
                    skip: Iterable[Tensor] = ()) -> dict[int, str]:
    """Where the memory of the tensors among ``f``'s arguments starts, each with its name.

    A tensor anywhere in an argument (a pytree) is named by that argument: by its name in
    ``f``'s signature where every argument binds to a named parameter, by its position (or
    keyword) otherwise. ``skip``: tensors left
    out (the differentiated parameters, whose copies ``f`` gets).

    Example:
        >>> import torch
        >>> def f(params, x, *, mask=None): ...
        >>> x, mask = torch.ones(2), torch.ones(2)
        >>> names = argument_memory(f, ({"w": torch.ones(1)}, [x]), {"mask": mask})
        >>> names[memory_of(x[1:])], names[memory_of(mask)]
        ("f's argument 'x'", "f's argument 'mask'")
    """
    named = [(f"f's positional argument {i}", value) for i, value in enumerate(args)]
    named.extend((f"f's argument {key!r}", value) for key, value in kwargs.items())
    try:
        signature = inspect.signature(f)
        bound = signature.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):  # no signature, or the arguments do not bind
        bound = {}
    if bound and all(signature.parameters[name].kind in _SINGLE for name in bound):
        named = [(f"f's argument {name!r}", value) for name, value in bound.items()]
    skipped = {memory_of(tensor) for tensor in skip} | {0}
    found: dict[int, str] = {}
    for name, value in named:
        for leaf in leaves_of(value):
            if isinstance(leaf, Tensor) and (memory := memory_of(leaf)) not in skipped:
                found.setdefault(memory, name)
    return found


def memory_of(tensor: Tensor) -> int:
    """Where ``tensor``'s storage starts (functorch wrappers unwrapped), or 0 where none.

    Example:
        >>> import torch
        >>> table = torch.ones(4, 2)
        >>> memory_of(table[1:]) == memory_of(table.detach()) == memory_of(table) != 0
        True
    """
    if is_lazy(tensor):  # a lazy module's, before its first call
        return 0
    try:
        # Past every torch-function mode: a write guard asks while other modes are active,
        # and the structured pass's tap mode took the storage lookup on a parameter for a
        # use it had not traced and raised, which read as "no storage": the guard let
        # writes into the caller's parameters through (session 66).
        with torch._C.DisableTorchFunction():
            return int(innermost(tensor).untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # no storage (a sparse or nested tensor)
        return 0


class StaleWrites(_WriteGuard):
    """Raises ``UnseenWrite`` before a write into memory ``f`` captured or received.

    NOTE [writes under a cached probe], NOTE [writes its probe did not see]. ``captured``
    gives :func:`captured_memory`'s addresses; it is called at the first write.

    Example:
        >>> import torch
        >>> table = torch.ones(3)
        >>> with StaleWrites(lambda: captured_memory(lambda: table, ())):
        ...     h = torch.zeros(3).add_(1.0)  # made here: fine
        ...     table.detach().mul_(2)  # the caller's memory, through an alias
        Traceback (most recent call last):
        ...
        torchgram._core.errors.UnseenWrite: f wrote into a tensor it captured or received ...
    """

    def __init__(self, captured: Callable[[], frozenset[int]],
                 on_generator: Callable[[torch.Generator], None] | None = None,
                 parameters: Sequence[Tensor] = ()) -> None:
        super().__init__(captured, on_generator, parameters)
        self.written: str | None = None

    def _refuse(self, write: str, memory: int) -> None:
        del memory
        self.written = write
        raise self._error()

    def _error(self) -> UnseenWrite:
        assert self.written is not None
        return UnseenWrite(self.written, f"f wrote into a tensor it captured or received "
                           f"({self.written}), which its probe did not see")

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self.written is not None and exc[0] is None:  # f caught what we raised
            raise self._error()


# NOTE [renormalised once]
# Where f renormalises rows of its parameters in place (an embedding's max_norm), every
# evaluation of a call works on the call's copies of them (NOTE [probing]). The first
# evaluation renormalises the rows; later ones find nothing left to renormalise, but the call
# still writes (embedding_renorm_ bumps the copy's version counter), and a backward through an
# earlier evaluation that saved the table (a head tied to it) then failed torch's check of
# saved tensors: auto and structured refused (a torchgram error naming an in-place write f
# does not make) where graph, which evaluates once, answered (session 49's fuzzer). Under
# RenormalisedOnce such a call renormalises only where a row it reads is above max_norm: the
# same values and gradients, without the write. Under a vmap of batched indices, where a
# tensor's value cannot decide a branch, the call runs as it is.


class RenormalisedOnce(TorchFunctionMode):
    """Embeddings with ``max_norm`` renormalise in place only where a row needs it.

    NOTE [renormalised once].

    Example:
        >>> import torch, torch.nn.functional as F
        >>> table, ids = torch.ones(3, 2), torch.tensor([0, 2])
        >>> with RenormalisedOnce():
        ...     _ = F.embedding(ids, table, max_norm=1.0)  # rows of norm 1.41: renormalised
        ...     version = table._version
        ...     _ = F.embedding(ids, table, max_norm=1.0)  # nothing left to do: no write
        >>> table._version == version
        True
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        weight = _written(func, args, kwargs) if func in _RENORMING else None
        if weight is not None and not _needs_renorm(func, weight, args, kwargs):
            position = _RENORMING[func]
            if len(args) > position:
                args = (*args[:position], None, *args[position + 1:])
            else:
                kwargs = {**kwargs, "max_norm": None}
        return func(*args, **kwargs)


def _needs_renorm(func: Any, weight: Tensor, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> bool:
    """Whether a row the call reads is above its ``max_norm`` (``True`` where unknown)."""
    max_norm, position = _max_norm(func, args, kwargs), _RENORMING[func]
    norm_type = args[position + 1] if len(args) > position + 1 else kwargs.get("norm_type", 2.0)
    indices = next((a for a in (*args[:2], kwargs.get("input")) if isinstance(a, Tensor)
                    and a is not weight and not a.is_floating_point()), None)
    if indices is None:
        return True
    try:
        with torch.no_grad():
            rows = weight.detach()[indices.detach().reshape(-1)]
            return bool((rows.norm(p=norm_type, dim=-1) > max_norm).any())
    except RuntimeError:  # batched indices under vmap: no value decides here
        return True
