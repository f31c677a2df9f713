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
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar, cast

from torch import Tensor, nn
from torch.nn.modules.lazy import LazyModuleMixin

from torchgram._core.captured_writes import reach
from torchgram._core.checks import fail
from torchgram._core.generator_search import (
    CODE,
    MODULE_INTERNALS,
    PLAIN,
    global_hook_functions,
    hook_functions,
    is_generator,
    items_of,
    may_hold,
    named_by_calls,
)
from torchgram._core.model_caches import cache_state, is_cache, refuse_changed_caches
from torchgram._core.rng import global_generators
from torchgram._core.side_gradients import gradients_outside_the_graph_refused

Fn = TypeVar("Fn", bound=Callable[..., Any])

_BUDGET = 512
"""Objects the walk for modules visits at most, nearest first (tensors included: a closure
over lists of 100 × 1000 tensors cost 64 ms a call when they were not counted; ~0.3 ms a call
at most now)."""
_WIDTH = 1024
"""Containers larger than this are data, not modules (a list of 70 pruned layers is searched:
a limit of 64 missed it, session 60's review; an ``nn.ModuleList`` is a module)."""


class Reached(NamedTuple):
    """What the walk from ``f`` and its arguments found that a call must look after.

    Attributes:
        hooked: The attributes of the modules with forward hooks, and copies of them (NOTE
            [tensors hooks set]).
        generators: The host generators ``f`` holds (NOTE [generators f holds]).
        modules: Every module reached (NOTE [gradients outside the graph]).
        caches: The ``transformers`` caches reached (NOTE [model caches]).
    """

    hooked: list[tuple[dict[str, Any], dict[str, Any]]]
    generators: tuple[Any, ...]
    modules: tuple[nn.Module, ...]
    caches: tuple[Any, ...] = ()


def reached(api: str, f: Any, args: Sequence[Any] = ()) -> Reached:
    """The hooked modules' attributes and the generators that ``f`` reaches.

    From ``f`` (its closure, bound instance, defaults, globals) and its arguments ``args`` (a
    sequence, each one walked), containers of tensors only left out (parameter dicts, a
    dataset's list: they hold no modules, and counted in the walk's budget they hid one; the
    reviews of session 60). A lazy module reached that is not initialised yet is refused
    (NOTE [lazy modules]).

    Example:
        >>> import random, torch
        >>> layer, rng = torch.nn.Linear(2, 2), random.Random(0)
        >>> _ = layer.register_forward_pre_hook(lambda module, inputs: None)
        >>> found = reached("api", lambda x: layer(x) * rng.random())
        >>> [copy is not attributes for attributes, copy in found.hooked]
        [True]
        >>> found.generators == (rng,)
        True
    """
    modules: dict[int, nn.Module] = {}
    generators: dict[int, Any] = {}
    caches: dict[int, Any] = {}
    classes: set[type] = set()
    held: list[Any] = []  # what modules and functions hold beyond parameters and submodules
    looked: dict[int, Any] = {}  # (the objects themselves: ids of freed ones are reused)
    functions: set[int] = set()  # looked into by named_by_calls (alive: modules hold them)

    def add(module: nn.Module) -> None:
        for sub in module.modules():
            if id(sub) in modules:
                continue
            modules[id(sub)] = sub
            for name, value in vars(sub).items():  # a generator kept as a module's attribute
                try:
                    if name in MODULE_INTERNALS or type(value) in PLAIN:  # most: a flag, a size
                        continue
                except TypeError:  # a class whose metaclass defines __eq__ without __hash__
                    continue
                if is_generator(value):
                    add_generator(value)
                elif may_hold(value):  # a list of generators, a helper object
                    look_into(value)
            if sub._forward_pre_hooks or sub._forward_hooks:  # a random mask's hook
                add_named(named_by_calls(hook_functions(sub), seen=functions))
            kind = type(sub)
            if kind not in classes:  # what its forward names, and the helpers it calls
                classes.add(kind)
                mro = tuple(klass for klass in kind.__mro__ if klass not in _BASES)
                add_named([value for klass in mro for value in vars(klass).values()
                           if type(value) not in CODE and is_generator(value)])
                add_named(named_by_calls([_own_attribute(kind, "forward")], mro,
                                          seen=functions))

    def add_named(values: list[Any]) -> None:  # what code names: one level inside
        for value in values:
            if is_generator(value):
                add_generator(value)
            elif may_hold(value):
                look_into(value, deep=False)

    def look_into(value: Any, *, deep: bool = True) -> None:
        if id(value) in looked:  # a config object every layer holds
            return
        looked[id(value)] = value
        for item in items_of(value, _WIDTH):  # right inside it: whatever the budget
            if is_generator(item):
                add_generator(item)
        if deep:  # what a module holds: walked further, within the budget
            held.append(value)

    def add_generator(obj: Any) -> None:
        if is_generator(obj) and obj not in global_ones:
            generators.setdefault(id(obj), obj)

    def add_object(obj: Any) -> None:  # what the walks visit beyond tensors and modules
        add_generator(obj)
        if is_cache(obj):
            caches.setdefault(id(obj), obj)

    global_ones = global_generators()
    # Modules sit near f (a closure cell, a global, self): a bounded walk, which a closure
    # over a dataset of records does not make slow (the full walk: 18 ms a call for 4000
    # records, session 60's review). Then what f's calls name, what the modules found hold and
    # their classes' code names (NOTE [generators f holds]), within a budget of their own.
    reach(f, args, lambda tensor: None, add, budget=_BUDGET, width=_WIDTH,
          tensor_containers=False, on_object=add_object, by_class=True)
    add_named(named_by_calls([f, *global_hook_functions()], seen=functions))
    if held:
        reach(None, held, lambda tensor: None, add, budget=_HELD_BUDGET, width=_WIDTH,
              tensor_containers=False, on_object=add_object, by_class=True)
    lazy = next((module for module in modules.values()
                 if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params()),
                None)
    if lazy is not None:
        fail(api, "f whose lazy modules are initialised", f"a {type(lazy).__name__} not "
             "called yet (its parameters are made by its first call, which torchgram's "
             "evaluations must not be: they run f several times, under checks that refuse the "
             "initialisation's writes)", "Run the model once on a batch (model(x)) first; a "
             "lazy layer that no forward calls stays uninitialised: call it once on its own, "
             "or remove it.")
    return Reached(hooked_snapshot(modules.values()), tuple(generators.values()),
                   tuple(modules.values()), tuple(caches.values()))


_HELD_BUDGET = 128
"""Objects the second walk visits at most, among what the modules and f's calls hold (a
model's config object is one, with its hundred settings)."""
_BASES = (nn.Module, object)


def _own_attribute(kind: type, name: str) -> Any:
    """A class's attribute as its class dict holds it (a descriptor is not called).

    A scripted module's ``forward`` raises when it is (the review of session 61).
    """
    for klass in kind.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return None


def hooked_snapshot(modules: Iterable[nn.Module]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The attributes of those of ``modules`` with forward hooks, and copies of them."""
    return [(module.__dict__, dict(module.__dict__)) for module in modules
            if module._forward_pre_hooks or module._forward_hooks]


# NOTE [lazy modules]
# A lazy module (nn.LazyLinear, nn.LazyBatchNorm1d, ...) makes its parameters at its first
# call: materialised with torch.empty, then filled by reset_parameters, drawing random
# numbers. Made inside one of torchgram's evaluations, the writes of that initialisation met
# the write guards (a LazyBatchNorm1d's running_mean.zero_(): refused, its weight left as
# torch.empty's garbage, which the caller's next forward used; under a cached probe the call
# went on: G 0.65-1.0 off; the review of session 60), and the draw made f look random. So a
# lazy module f reaches (NOTE [tensors hooks set]'s walk) must be initialised first, and lazy
# tensors among the arguments are refused as well (build_problem, tg.ntk, tg.functionalize,
# the eager API's inputs). The walk cannot tell the lazy modules f calls from those it only
# reaches: a lazy layer that no forward calls is refused too (remove it, or give it its
# shapes once with a call of its own).


@contextlib.contextmanager
def hooked_attributes_put_back(api: str, f: Any,
                               args: Sequence[Any] = ()) -> Iterator[tuple[Any, ...]]:
    """Around a call: what forward hooks set on the modules ``f`` reaches is put back after it.

    NOTE [tensors hooks set]; ``args``: the call's arguments, which may hold modules too.
    Gives the generators ``f`` holds, found by the same walk (NOTE [generators f holds]). A
    call whose backward passes accumulated into the ``.grad`` of a parameter of those modules
    is refused after it (NOTE [gradients outside the graph]).
    """
    found = reached(api, f, args)
    parameters = (parameter for module in found.modules
                  for parameter in module._parameters.values() if parameter is not None)
    caches = [cache_state(cache) for cache in found.caches]  # NOTE [model caches]
    try:
        with gradients_outside_the_graph_refused(api, parameters):
            yield found.generators
    finally:
        for attributes, before in found.hooked:
            put_back_tensors(attributes, before)
    refuse_changed_caches(api, found.caches, caches)


def puts_back_hooked_attributes(api: str, f: Any) -> Callable[[Fn], Fn]:
    """Decorate a call of ``f``'s arguments with :func:`hooked_attributes_put_back`.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> _ = layer.register_forward_hook(lambda m, args, out: setattr(m, "last", out))
        >>> @puts_back_hooked_attributes("api", layer)
        ... def call(x):
        ...     return layer(x)
        >>> _ = call(torch.ones(1, 2))
        >>> hasattr(layer, "last")
        False
    """
    def decorate(call: Fn) -> Fn:
        @functools.wraps(call)
        def around(*args: Any, **kwargs: Any) -> Any:
            with hooked_attributes_put_back(api, f, (*args, *kwargs.values())):
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
