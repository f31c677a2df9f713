"""Normalisation layers' running statistics stay as they are while torchgram evaluates ``f``.

NOTE [frozen running statistics]
The idiomatic ``torch.func`` way to make a module a function, ``f = lambda p, x:
torch.func.functional_call(model, (p, buffers), (x,))``, captures the module's buffers. A
batch norm in training mode (and an instance norm that tracks running statistics) then
updates ``buffers`` in place on every evaluation of ``f``: ``running_mean``,
``running_var`` and the ``num_batches_tracked`` counter. torchgram evaluates ``f`` several
times per call (the probe, the batched pass, the per-sample check), and partly inside
``torch.func`` transforms, which refuse to mutate a captured tensor. Before session 31 that
gave torch's raw ``RuntimeError`` ("attempted to call in-place operation ... that would
mutate a captured Tensor") from ``jacobian``, ``ntvp`` and ``auto`` -- the default -- and,
from ``structured`` and ``graph``, the right ``G`` with the user's running statistics
updated two or three times by one call.

In training mode those statistics are written, never read: the layer normalises with the
batch's own statistics. So every evaluation torchgram makes runs under
:class:`FrozenRunningStats`, which calls the norms without their running buffers (the same
outputs, bit for bit) and skips in-place increments of a 0-dim integer tensor by a Python
int (``num_batches_tracked.add_(1)``, which the module makes just before the norm call): a
torchgram call then leaves every buffer as it found it, as ``tg.functionalize``'s ``fn``
does (it runs on copies). A skipped counter keeps its meaning: reading it as a number
(``float(t)``, ``int(t)``, ``t.item()``: batch norm with ``momentum=None`` does) gives the
value it would have had; any other use of it in ``f`` raises :class:`CounterRead` (a
torchgram error: never a matrix computed from a value ``f`` did not see).

NOTE [frozen memory is watched]
Until session 56 a skipped counter was recognised by its object only, and the running
statistics a dropped update left stale not at all, so a hunt found two silent wrong
matrices: a counter ``f`` made itself, incremented through a view (``counts[0].add_(3)``)
or read inside a list (``torch.stack([c, c])``), lost its increments (G all zeros); and an
``f`` reading a batch norm's running statistics after its training-mode call (a batch-renorm
style term, or the same module in eval mode next) used their old values (0.96 and 0.84
off, relative). Now:

* an increment is skipped unless the counter is in memory one of ``f``'s own factory calls
  made (``torch.zeros``, ``torch.tensor``, ``new_zeros``, ...: :data:`_FACTORIES`, seen by
  the mode); ``f``'s own counters run as written, and any other (the caller's, as
  ``num_batches_tracked``; one made by another op: refused if then used) is skipped. (A
  first version asked NOTE [captured writes]'s lookup of what ``f`` captured; a review found
  that lookup blind to a model held by another Python module or in ``__slots__``, whose
  counters then ran: G 3-15x off, the caller's counter moved.)
* after a skip or a dropped update, every call is looked at (:func:`memory_of` of every
  tensor among its arguments, through lists, tuples and dicts): a use of that memory other
  than reading the counter as a number, incrementing it again, or passing the statistics to
  another training-mode norm call (whose update is dropped too) raises :class:`CounterRead`,
  through any alias (a view, ``.detach()``, an element of a list). The frozen tensors are
  kept alive while watched: a first version kept only their memory, and a freed copy's
  memory, handed to a new tensor, was refused as a read (a review: 16-21 of 30
  ``tg.functionalize`` calls of a batch-norm ResNet). A tensor that is not a view and is
  larger than every frozen storage is not looked up (the activations: most calls).

Only evaluations that skip or drop pay for the look.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from torchgram._core._torch_compat import in_checkpoint_forward, innermost, saved_tensor_hooks
from torchgram._core.captured_writes import memory_of
from torchgram._core.census import _argument
from torchgram._core.errors import (
    CounterRead,
    NormInCheckpoint,
    RunningStatsDifferentiated,
    counter_read_error,
)

# The running buffers' positions in each call, and the flag that says batch statistics
# are used (training for batch norm, use_input_stats for instance norm).
_NORMS: dict[Any, tuple[tuple[int, str], tuple[int, str], tuple[int, str, bool]]] = {
    F.batch_norm: ((1, "running_mean"), (2, "running_var"), (5, "training", False)),
    torch.batch_norm: ((3, "running_mean"), (4, "running_var"), (5, "training", False)),
    F.instance_norm: ((1, "running_mean"), (2, "running_var"), (5, "use_input_stats", True)),
    torch.instance_norm: ((3, "running_mean"), (4, "running_var"),
                          (5, "use_input_stats", True)),
}

_SCALAR_READS = {Tensor.__float__: float, Tensor.__int__: int, Tensor.__index__: int,
                 Tensor.item: None}
"""Reads of a tensor as a Python number, and the type each gives (``None``: the dtype's)."""


_FACTORIES = frozenset({
    torch.zeros, torch.ones, torch.full, torch.empty, torch.tensor, torch.as_tensor,
    torch.scalar_tensor, torch.arange, torch.zeros_like, torch.ones_like, torch.full_like,
    torch.empty_like, Tensor.new_zeros, Tensor.new_ones, Tensor.new_full, Tensor.new_empty,
    Tensor.new_tensor,
})
"""Calls that make a tensor from nothing: a counter they make is ``f``'s own."""


_WATCHED = frozenset((*_NORMS, Tensor.add_, *_FACTORIES))
"""The calls :class:`FrozenRunningStats` may change (every other runs as it is)."""


def _among(func: Any, functions: frozenset[Any] | dict[Any, Any]) -> bool:
    try:
        return func in functions
    except TypeError:  # an unhashable callable
        return False


# NOTE [running statistics differentiated]
# A batch norm in eval mode reads its running mean and variance, and torch's batch norm has no
# derivative with respect to them: where they are among the differentiated tensors
# (``functional_call(model, dict(model.state_dict()), ...)``), every backend met torch's raw
# "native_batch_norm is not differentiable with respect to argument 'running_mean'" in its
# backward (session 66's review), which errors.torch_refusals turned into a ValueError
# after the work. The probe's FrozenRunningStats, given the probe's copies of the
# parameters, refuses such a call before any Jacobian work (session 67). In training mode the
# running statistics are not read (FrozenRunningStats drops them): their blocks are zero.


def _refuse_differentiated_statistics(func: Any, args: tuple[Any, ...],
                                      kwargs: dict[str, Any], parameters: frozenset[int]) -> None:
    """Raise :class:`RunningStatsDifferentiated` for an eval-mode norm reading a parameter.

    NOTE [running statistics differentiated].
    """
    (mean_at, mean_name), (var_at, var_name), (flag_at, flag_name, flag_default) = _NORMS[func]
    if _argument(args, kwargs, flag_at, flag_name, flag_default):
        return  # batch statistics: the running ones are not read
    for at, name in ((mean_at, mean_name), (var_at, var_name)):
        statistic = _argument(args, kwargs, at, name, None)
        if isinstance(statistic, Tensor) and memory_of(statistic) in parameters:
            raise RunningStatsDifferentiated(name)


def _without_running_stats(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                           ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """A norm call that would update running statistics, without them; else ``None``.

    Example:
        >>> x, mean, var = torch.randn(4, 3), torch.zeros(3), torch.ones(3)
        >>> args, kwargs = _without_running_stats(F.batch_norm, (x, mean, var),
        ...                                       {"training": True})
        >>> args[1:], kwargs
        ((None, None), {'training': True})
        >>> _without_running_stats(F.batch_norm, (x, mean, var), {}) is None  # eval mode
        True
    """
    spec = _NORMS.get(func) if _among(func, _NORMS) else None
    if spec is None:
        return None
    (mean_at, mean_name), (var_at, var_name), (flag_at, flag_name, flag_default) = spec
    if not _argument(args, kwargs, flag_at, flag_name, flag_default):
        return None  # running statistics are read (eval mode), not written
    if _argument(args, kwargs, mean_at, mean_name, None) is None and \
            _argument(args, kwargs, var_at, var_name, None) is None:
        return None
    positional = list(args)
    keywords = dict(kwargs)
    for at, name in ((mean_at, mean_name), (var_at, var_name)):
        if at < len(positional):
            positional[at] = None
        elif name in keywords:
            keywords[name] = None
    return tuple(positional), keywords


def _is_counter_increment(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``t.add_(n)`` of a 0-dim integer tensor ``t`` by a Python int (``num_batches_tracked``)."""
    if func is not Tensor.add_ or kwargs or len(args) != 2:
        return False
    counter, step = args
    return (isinstance(counter, Tensor) and counter.dim() == 0
            and not counter.is_floating_point() and not counter.is_complex()
            and counter.dtype != torch.bool and isinstance(step, int)
            and not isinstance(step, bool))


def _tensors_in(values: Any) -> list[Tensor]:
    """The tensors among a call's arguments, through lists, tuples and dicts.

    Example:
        >>> a, b = torch.zeros(1), torch.ones(2)
        >>> [t.shape for t in _tensors_in(((a, [b, 3]), {"x": a}))]
        [torch.Size([1]), torch.Size([2]), torch.Size([1])]
    """
    found: list[Tensor] = []
    _collect(values, found)
    return found


_CONTAINERS = (list, tuple, dict)


def _collect(values: Any, found: list[Tensor]) -> None:
    # Plain loops and type checks: every call after a freeze comes here (a generator over
    # isinstance with union types cost a batch-norm CNN's evaluation 50 %).
    if isinstance(values, Tensor):
        found.append(values)
        return
    for value in (values.values() if type(values) is dict else values):
        if isinstance(value, Tensor):
            found.append(value)
        elif type(value) in _CONTAINERS:
            _collect(value, found)


class FrozenRunningStats(TorchFunctionMode):
    """Norm calls update no running statistics; increments of the caller's counters are skipped.

    See NOTE [frozen running statistics] and NOTE [frozen memory is watched]. One object per
    evaluation of ``f``.

    Example:
        >>> bn = torch.nn.BatchNorm1d(3)
        >>> x = torch.randn(4, 3)
        >>> with FrozenRunningStats():
        ...     y = bn(x)
        >>> torch.equal(y, torch.nn.functional.batch_norm(x, None, None, bn.weight, bn.bias,
        ...                                               training=True))
        True
        >>> bn.running_mean.abs().sum().item(), bn.num_batches_tracked.item()  # untouched
        (0.0, 0)
    """

    def __init__(self, parameter_memory: frozenset[int] = frozenset()) -> None:
        super().__init__()
        # NOTE [running statistics differentiated]: the memory of the probe's copies of the
        # parameters (memory_of)
        self._parameter_memory = parameter_memory - {0}
        self._skipped: dict[int, tuple[Tensor, int]] = {}  # id -> (counter, increments)
        # memory -> (what it holds, for the message; the tensor, kept so that its memory is
        # not given to another while watched)
        self._frozen: dict[int, tuple[str, Tensor]] = {}
        self._largest = 0  # bytes of the largest frozen storage
        self._made: set[int] = set()  # memory of the tensors f's factory calls made
        # NOTE [recomputed checkpoints differ]: the saved-tensor hooks in force at the start
        self._hooks_at_entry = saved_tensor_hooks()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if not self._frozen and not _among(func, _WATCHED):  # most calls: a set lookup, no more
            return func(*args, **kwargs)
        if self._frozen:
            read = self._use_of_frozen(func, args, kwargs)
            if read is not NotImplemented:
                return read
        if _is_counter_increment(func, args, kwargs) and not self._made_by_f(args[0]):
            counter, step = args
            _, before = self._skipped.get(id(counter), (counter, 0))
            self._skipped[id(counter)] = (counter, before + step)
            self._freeze(counter, "it increments a 0-dim integer tensor in place, then uses it in")
            return counter
        if self._parameter_memory and _among(func, _NORMS):
            _refuse_differentiated_statistics(func, args, kwargs, self._parameter_memory)
        rewritten = _without_running_stats(func, args, kwargs)
        if rewritten is not None:
            if self._in_a_checkpoint_region():  # NOTE [recomputed checkpoints differ]
                raise NormInCheckpoint(f"{getattr(func, '__name__', func)} in training mode "
                                       "inside a torch.utils.checkpoint region")
            kept = {id(t) for t in _tensors_in(rewritten)}
            for stats in _tensors_in((args, kwargs)):
                if stats.is_floating_point() and id(stats) not in kept:
                    self._freeze(stats, "it reads running statistics after a training-mode "
                                 "norm call that updates them (torchgram leaves them as they "
                                 "were), in")
            args, kwargs = rewritten
        result = func(*args, **kwargs)
        if _among(func, _FACTORIES) and isinstance(result, Tensor):
            self._made.add(memory_of(result))  # (memory_of reads past the other modes)
        return result

    def _in_a_checkpoint_region(self) -> bool:
        """Whether a non-reentrant checkpoint region of ``f`` is being run (its hooks on top)."""
        return saved_tensor_hooks() != self._hooks_at_entry and in_checkpoint_forward()

    def _made_by_f(self, counter: Tensor) -> bool:
        return memory_of(counter) in self._made

    def _freeze(self, tensor: Tensor, what: str) -> None:
        with torch._C.DisableTorchFunction():
            self._frozen[memory_of(tensor)] = (what, tensor)
            self._largest = max(self._largest, _storage_bytes(tensor))

    def _hits(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
        """The call's tensor arguments in frozen memory (one loop: most calls come here)."""
        hits: list[Tensor] = []
        largest, frozen = self._largest, self._frozen
        # The other modes of the evaluation would see every numel() and untyped_storage() of
        # the look (a review: ntvp 25-40 % slower on a batch-norm CNN): torch functions off.
        with torch._C.DisableTorchFunction():
            for value in (*args, *kwargs.values()) if kwargs else args:
                if isinstance(value, Tensor):
                    if _in_memory(value, largest, frozen):
                        hits.append(value)
                elif type(value) in _CONTAINERS:
                    hits.extend(t for t in _tensors_in(value)
                                if _in_memory(t, largest, frozen))
        return hits

    def _watched_memory(self, tensor: Tensor) -> bool:
        """Whether ``tensor``'s memory is frozen."""
        with torch._C.DisableTorchFunction():
            return _in_memory(tensor, self._largest, self._frozen)

    def _use_of_frozen(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The value a number read of a skipped counter gives; else ``NotImplemented``.

        ``NotImplemented`` for a call that touches no frozen memory, or only as allowed (NOTE
        [frozen memory is watched]). Raises :class:`CounterRead` for any other use of frozen
        memory.
        """
        hits = self._hits(args, kwargs)
        if not hits:
            return NotImplemented
        skipped = self._skipped.get(id(hits[0])) if len(hits) == 1 else None
        if skipped is not None and hits[0] is args[0]:
            if _is_counter_increment(func, args, kwargs):
                return NotImplemented  # another increment: counted by the caller
            as_type = _SCALAR_READS.get(func, NotImplemented) \
                if _among(func, _SCALAR_READS) else NotImplemented
            if as_type is not NotImplemented and len(args) == 1 and not kwargs:
                counter, increments = skipped
                value = counter.item() + increments
                return value if as_type is None else as_type(value)
        rewritten = _without_running_stats(func, args, kwargs)
        if rewritten is not None and not any(self._watched_memory(t)
                                             for t in _tensors_in(rewritten)):
            return NotImplemented  # their next update, dropped too
        raise CounterRead(f"{self._frozen[memory_of(hits[0])][0]} "
                          f"{getattr(func, '__name__', 'a call')}")


def _in_memory(tensor: Tensor, largest: int, memory: dict[int, Any]) -> bool:
    """Whether ``tensor`` is in ``memory`` (by :func:`memory_of`), with a cheap no first.

    A tensor (functorch wrappers unwrapped) that is not a view and is larger than ``largest``
    bytes (every storage in ``memory``) is not an alias of one: the activations, most calls.
    """
    tensor = innermost(tensor)
    if tensor._base is None and tensor.numel() * tensor.element_size() > largest:
        return False
    return memory_of(tensor) in memory  # 0 (no storage: sparse, nested) is never frozen


def _storage_bytes(tensor: Tensor) -> int:
    tensor = innermost(tensor)
    try:
        return int(tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return tensor.numel() * tensor.element_size()


@contextlib.contextmanager
def counters_refused(api: str) -> Iterator[None]:
    """Turn :class:`CounterRead` into the torchgram ``ValueError`` that names the fix."""
    try:
        yield
    except CounterRead as error:
        raise counter_read_error(api, error) from error


def _recomputing() -> bool:
    """Whether a checkpoint region is being recomputed (its saved-tensor hooks are on top)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and "_recomputation_hook" in getattr(hooks[0], "__qualname__", "")


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """The tensors an aten call writes into.

    Its schema's mutable arguments, and a training batch norm's running statistics
    (``native_batch_norm`` updates them unannotated).
    """
    schema = func._schema
    bound = dict(zip((a.name for a in schema.arguments), args, strict=False)) | kwargs
    found = [bound.get(a.name) for a in schema.arguments
             if a.alias_info is not None and a.alias_info.is_write]
    if "batch_norm" in schema.name and bound.get("training", False):
        found += [bound.get("running_mean"), bound.get("running_var")]
    return [t for t in found if isinstance(t, Tensor)]


class RecomputedUpdatesUndone(TorchDispatchMode):
    """Undoes, at exit, what checkpoint recomputations wrote into tensors made before them.

    NOTE [recomputed running statistics] in ``_api/autograd.py``. A dispatch mode, unlike a
    torch-function mode, is on inside the autograd engine's node calls, where the engine's
    passes recompute a region. Within a recomputation the tensors its calls make are noted;
    the first write into any other (a norm's running statistics, ``num_batches_tracked``, an
    instance norm's statistics copied back, any buffer) saves its value; the recomputation
    runs as torch runs it (the same values, the same saved tensors), and the saved values are
    written back at exit.

    Example:
        >>> bn = torch.nn.BatchNorm1d(3)
        >>> x = torch.randn(4, 3, requires_grad=True)
        >>> y = torch.utils.checkpoint.checkpoint(bn, x, use_reentrant=False).sum()
        >>> int(bn.num_batches_tracked)  # the forward's update
        1
        >>> with RecomputedUpdatesUndone():
        ...     _ = torch.autograd.grad(y, x)  # recomputes the region
        >>> int(bn.num_batches_tracked)
        1
    """

    def __init__(self) -> None:
        super().__init__()
        self._saved: dict[int, tuple[Tensor, Tensor]] = {}
        self._made: set[int] = set()  # memory of what recomputations made

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if not _recomputing():
            return func(*args, **kwargs)
        for target in _written(func, args, kwargs):
            memory = memory_of(target)
            if memory not in self._made and memory not in self._saved:
                self._saved[memory] = (target, target.clone())
        result = func(*args, **kwargs)
        inputs = {memory_of(t) for t in _tensors_in((args, kwargs))}
        for made in _tensors_in(result):  # new memory only: a view (an alias) is not made
            if (memory := memory_of(made)) not in inputs:
                self._made.add(memory)
        return result

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        with torch.no_grad():
            for target, value in self._saved.values():
                target.copy_(value)
        self._saved.clear()
        self._made.clear()
