"""Where the generators ``f`` holds hide: what modules and functions name.

NOTE [generators f holds] in ``rng.py``. The walk of
:func:`~torchgram._core.hooked_modules.reached` visits ``f``, its arguments and what they hold;
a module it finds holds more than its parameters: attributes (a generator, a list of them, a
helper object), forward hooks, and the code of its class, whose ``forward`` may call helpers
that draw from a module-level generator. These helpers say what to look at there, cheaply: they
run for every module of every call.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor, nn

from torchgram._core.captured_writes import CONTAINERS, contents, slot_names, slot_values
from torchgram._core.rng import generator_class

MODULE_INTERNALS = frozenset(vars(nn.Module()))
"""The attributes every module has (parameters, buffers, submodules, hooks, flags)."""

PLAIN = frozenset({str, bytes, int, float, bool, type(None), Tensor, nn.Parameter})
"""Classes of values that hold nothing to look into."""
CODE = frozenset({types.FunctionType, staticmethod, classmethod, property})
"""Classes of a class's attributes that are its code (what :func:`named_by_calls` reads)."""

CALLED_FUNCTIONS = 64
"""Functions :func:`named_by_calls` looks into at most, from one module class or ``f``."""

_LIBRARIES = frozenset({"torch", "torchgram", "numpy", "functools", "builtins", "typing",
                        "collections", "math", "contextlib", "warnings"})
"""Packages whose functions and module attributes draw from no generator of the user's."""


def _in_library(module_name: object) -> bool:
    return isinstance(module_name, str) and module_name.partition(".")[0] in _LIBRARIES


def is_generator(value: Any) -> bool:
    """Whether ``value`` is an instance of a generator class (one dict lookup once known).

    Example:
        >>> import random
        >>> is_generator(random.Random(0)), is_generator(3)
        (True, False)
    """
    return generator_class(type(value))


def may_hold(value: Any) -> bool:
    """Whether a module's attribute may hold a generator: a container or an object.

    By its class alone (an object's ``__class__`` or ``__getattr__`` is not run).

    Example:
        >>> may_hold([1]), may_hold(3), may_hold(nn.Linear(1, 1))
        (True, False, False)
    """
    kind = type(value)
    try:
        if kind in PLAIN or issubclass(kind, _NOT_HOLDING):
            return False
    except TypeError:  # a class whose metaclass defines __eq__ without __hash__
        return False
    return issubclass(kind, CONTAINERS) or kind.__dictoffset__ != 0 \
        or any(slot_names(klass) for klass in kind.__mro__)


_NOT_HOLDING = (Tensor, nn.Module, type, types.ModuleType, types.FunctionType,
                types.BuiltinFunctionType)


def items_of(holder: Any, width: int) -> list[Any]:
    """What a container or an object holds right inside it, read without running its code.

    Its items (containers of at most ``width``), or its attributes and slots.
    """
    if issubclass(type(holder), CONTAINERS):  # (by its class: a proxy's __class__ may raise)
        return contents(holder) if len(holder) <= width else []
    try:
        attributes = object.__getattribute__(holder, "__dict__")
    except Exception:  # noqa: BLE001 -- none, or a class that computes it
        attributes = None
    held = list(dict.values(attributes)) if type(attributes) is dict else []
    return held + slot_values(holder)


def global_hook_functions() -> list[Callable[..., Any]]:
    """The forward hooks registered for every module (``register_module_forward_hook``)."""
    module = sys.modules["torch.nn.modules.module"]
    return [*getattr(module, "_global_forward_pre_hooks", {}).values(),
            *getattr(module, "_global_forward_hooks", {}).values()]


def named_by_calls(functions: Iterable[Any], classes: tuple[type, ...] = (),
                   seen: set[int] | None = None) -> list[Any]:
    r"""What ``functions`` name, and the functions among that name, transitively.

    A function names its closure's contents, its defaults, the globals its code (and nested
    code) names, the attributes of ``classes`` it names (``self.helper``) and those of the
    modules it names (``augment.random_mask``). Functions of torch, numpy and torchgram are
    not looked into, nor their modules' attributes; at most :data:`CALLED_FUNCTIONS`, and
    none of ``seen`` (the ids of those an earlier search of the same walk looked into, which it
    extends: the helpers every layer class calls are read once).

    Example:
        >>> import random
        >>> user_code = {"__name__": "user_code", "rng": random.Random(0)}
        >>> exec("def helper():\n    return rng.random()\n"
        ...      "def forward():\n    return helper()\n", user_code)
        >>> user_code["rng"] in named_by_calls([user_code["forward"]])
        True
    """
    pending: list[tuple[Any, bool]] = [(function, True) for function in functions]
    named: list[Any] = []
    seen = set() if seen is None else seen
    looked_into = 0
    while pending and looked_into < CALLED_FUNCTIONS:
        value, method = pending.pop(0)
        function = _function_of(value)
        if function is None or id(function) in seen or _in_library(function.__module__):
            continue
        seen.add(id(function))
        looked_into += 1
        values, methods = _named_by(function, classes if method else ())
        named.extend(values)
        pending.extend((value, False) for value in values if callable(value))
        pending.extend((value, True) for value in methods)
    return named


def _function_of(value: Any) -> types.FunctionType | None:
    """The plain function behind ``value``, or ``None``.

    A method, a static or class method, a partial, a property's getter.
    """
    for _ in range(4):
        if isinstance(value, types.FunctionType):
            return value
        if isinstance(value, (staticmethod, classmethod, types.MethodType)):
            value = value.__func__
        elif isinstance(value, functools.partial):
            value = value.func
        elif isinstance(value, property):
            value = value.fget
        else:
            return None
    return None


def _named_by(function: types.FunctionType,
              classes: tuple[type, ...]) -> tuple[list[Any], list[Any]]:
    """What ``function`` names, and the attributes of ``classes`` it names (its methods)."""
    named: list[Any] = []
    for cell in function.__closure__ or ():
        with contextlib.suppress(ValueError):  # an empty cell
            named.append(cell.cell_contents)
    named.extend(function.__defaults__ or ())
    names, codes = function.__globals__, [function.__code__]
    modules: list[tuple[types.ModuleType, tuple[str, ...]]] = []
    methods: list[Any] = []
    while codes:
        code = codes.pop()
        for name in code.co_names:
            value = names.get(name)
            if isinstance(value, types.ModuleType):
                if not _in_library(value.__name__):
                    modules.append((value, code.co_names))
            elif value is not None:
                named.append(value)
        for klass in classes:  # self.rng, self.helper(): the class's own attributes
            in_class = vars(klass)
            methods.extend(in_class[name] for name in code.co_names if name in in_class)
        codes.extend(const for const in code.co_consts if isinstance(const, types.CodeType))
    for module, attribute_names in modules:  # `lib.helper()`: its dict (no lazy imports)
        contents = vars(module)
        named.extend(contents[name] for name in attribute_names if name in contents)
    named.extend(methods)
    return named, methods


def hook_functions(module: nn.Module) -> list[Callable[..., Any]]:
    """The forward hooks of ``module`` (a random mask applied by a hook)."""
    return [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
