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

* an increment is skipped only for a counter in memory ``f`` captured or received (the
  caller's, as ``num_batches_tracked``; ``captured``, from NOTE [captured writes]); one
  ``f`` made itself is incremented, as a plain call would;
* after a skip or a dropped update, every call is looked at (:func:`memory_of` of every
  tensor among its arguments, through lists, tuples and dicts): a use of that memory other
  than reading the counter as a number, incrementing it again, or passing the statistics to
  another training-mode norm call (whose update is dropped too) raises :class:`CounterRead`,
  through any alias (a view, ``.detach()``, an element of a list).

Only evaluations that skip or drop pay for the look (about 1 µs a tensor argument).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from torchgram._core.captured_writes import memory_of
from torchgram._core.census import _argument
from torchgram._core.errors import CounterRead, counter_read_error

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


_WATCHED = frozenset((*_NORMS, Tensor.add_))
"""The calls :class:`FrozenRunningStats` may change (every other runs as it is)."""


def _watched(func: Any) -> bool:
    try:
        return func in _WATCHED
    except TypeError:  # an unhashable callable
        return False


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
    spec = _NORMS.get(func) if _watched(func) else None
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


def _tensors_in(values: Any) -> Iterator[Tensor]:
    """The tensors among a call's arguments, through lists, tuples and dicts."""
    if isinstance(values, Tensor):
        yield values
    elif isinstance(values, list | tuple):
        for value in values:
            yield from _tensors_in(value)
    elif isinstance(values, dict):
        for value in values.values():
            yield from _tensors_in(value)


class FrozenRunningStats(TorchFunctionMode):
    """Norm calls update no running statistics; increments of captured counters are skipped.

    See NOTE [frozen running statistics] and NOTE [frozen memory is watched]. One object per
    evaluation of ``f``.

    Args:
        captured: The memory (:func:`memory_of`) of the tensors ``f`` captured or received,
            asked for at a counter's first increment; ``None``: every counter is the caller's.

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

    def __init__(self, captured: Callable[[], frozenset[int]] | None = None) -> None:
        super().__init__()
        self._captured = captured
        self._skipped: dict[int, tuple[Tensor, int]] = {}  # id -> (counter, increments)
        self._frozen: dict[int, str] = {}  # memory -> what it holds (for the message)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if not self._frozen and not _watched(func):  # most calls: a set lookup, no more
            return func(*args, **kwargs)
        if self._frozen:
            read = self._use_of_frozen(func, args, kwargs)
            if read is not NotImplemented:
                return read
        if _is_counter_increment(func, args, kwargs) and self._callers(args[0]):
            counter, step = args
            _, before = self._skipped.get(id(counter), (counter, 0))
            self._skipped[id(counter)] = (counter, before + step)
            self._frozen[memory_of(counter)] = (
                "it increments a 0-dim integer tensor in place, then uses it in")
            return counter
        rewritten = _without_running_stats(func, args, kwargs)
        if rewritten is not None:
            for stats in _tensors_in((args, kwargs)):
                if stats.is_floating_point() and all(stats is not t for t in
                                                     _tensors_in(rewritten)):
                    self._frozen[memory_of(stats)] = (
                        "it reads running statistics after a training-mode norm call that "
                        "updates them (torchgram leaves them as they were), in")
            args, kwargs = rewritten
        return func(*args, **kwargs)

    def _callers(self, counter: Tensor) -> bool:
        """Whether ``counter`` is in memory ``f`` captured or received (not one it made)."""
        return self._captured is None or memory_of(counter) in self._captured()

    def _use_of_frozen(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The value a number read of a skipped counter gives; else ``NotImplemented``.

        ``NotImplemented`` for a call that touches no frozen memory, or only as allowed (NOTE
        [frozen memory is watched]). Raises :class:`CounterRead` for any other use of frozen memory.
        """
        hits = [t for t in _tensors_in((args, kwargs)) if memory_of(t) in self._frozen]
        if not hits:
            return NotImplemented
        skipped = self._skipped.get(id(hits[0])) if len(hits) == 1 else None
        if skipped is not None and hits[0] is args[0]:
            if _is_counter_increment(func, args, kwargs):
                return NotImplemented  # another increment: counted by the caller
            as_type = _SCALAR_READS.get(func, NotImplemented) if _hashable(func) \
                else NotImplemented
            if as_type is not NotImplemented and len(args) == 1 and not kwargs:
                counter, increments = skipped
                value = counter.item() + increments
                return value if as_type is None else as_type(value)
        rewritten = _without_running_stats(func, args, kwargs)
        if rewritten is not None and not any(memory_of(t) in self._frozen
                                             for t in _tensors_in(rewritten)):
            return NotImplemented  # their next update, dropped too
        raise CounterRead(f"{self._frozen[memory_of(hits[0])]} "
                          f"{getattr(func, '__name__', 'a call')}")


def _hashable(func: Any) -> bool:
    try:
        hash(func)
    except TypeError:
        return False
    return True


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


def _updated_buffers(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """What an aten call writes that is a norm's running statistics or a 0-dim counter."""
    schema = func._schema
    bound = dict(zip((a.name for a in schema.arguments), args, strict=False)) | kwargs
    written = [bound.get(a.name) for a in schema.arguments
               if a.alias_info is not None and a.alias_info.is_write]
    found = [t for t in written if isinstance(t, Tensor) and t.dim() == 0
             and not t.is_floating_point() and not t.is_complex()]
    if "batch_norm" in schema.name and bound.get("training", False):
        found += [bound[name] for name in ("running_mean", "running_var")
                  if isinstance(bound.get(name), Tensor)]
    return found


class RecomputedUpdatesUndone(TorchDispatchMode):
    """Undoes, at exit, what checkpoint recomputations wrote into running statistics.

    NOTE [recomputed running statistics] in ``_api/autograd.py``. A dispatch mode, unlike a
    torch-function mode, is on inside the autograd engine's node calls, where the engine's
    passes recompute a region. Within a recomputation, the first write into a norm's running
    statistics or into a 0-dim integer tensor (``num_batches_tracked``) saves its value; the
    recomputation runs as torch runs it (the same values, the same saved tensors), and the
    saved values are written back at exit.

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

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if _recomputing():
            for buffer in _updated_buffers(func, args, kwargs):
                if id(buffer) not in self._saved:
                    self._saved[id(buffer)] = (buffer, buffer.clone())
        return func(*args, **kwargs)

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        with torch.no_grad():
            for buffer, value in self._saved.values():
                buffer.copy_(value)
        self._saved.clear()
