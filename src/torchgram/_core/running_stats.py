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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

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


class FrozenRunningStats(TorchFunctionMode):
    """Norm calls update no running statistics; counter increments are skipped.

    See NOTE [frozen running statistics]. One object per evaluation of ``f``.

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

    def __init__(self) -> None:
        super().__init__()
        self._skipped: dict[int, tuple[Tensor, int]] = {}  # id -> (counter, increments)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if not self._skipped and not _watched(func):  # most calls: a set lookup, no more
            return func(*args, **kwargs)
        if self._skipped:
            read = self._read_of_skipped(func, args, kwargs)
            if read is not NotImplemented:
                return read
        if _is_counter_increment(func, args, kwargs):
            counter, step = args
            _, before = self._skipped.get(id(counter), (counter, 0))
            self._skipped[id(counter)] = (counter, before + step)
            return counter
        rewritten = _without_running_stats(func, args, kwargs)
        if rewritten is not None:
            args, kwargs = rewritten
        return func(*args, **kwargs)

    def _read_of_skipped(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The value a read of a skipped counter gives, or ``NotImplemented`` if none is read.

        Raises :class:`CounterRead` when ``f`` uses the counter other than as a number.
        """
        touched = [self._skipped[id(a)] for a in (*args, *kwargs.values())
                   if isinstance(a, Tensor) and id(a) in self._skipped]
        if not touched:
            return NotImplemented
        counter, increments = touched[0]
        if _is_counter_increment(func, args, kwargs):
            return NotImplemented  # another increment: counted by the caller
        try:
            as_type = _SCALAR_READS.get(func, NotImplemented)
        except TypeError:
            as_type = NotImplemented
        if as_type is NotImplemented or len(args) != 1 or kwargs:
            raise CounterRead("it increments a 0-dim integer tensor in place, then uses it in "
                              + getattr(func, "__name__", "a call"))
        value = counter.item() + increments
        return value if as_type is None else as_type(value)


@contextlib.contextmanager
def counters_refused(api: str) -> Iterator[None]:
    """Turn :class:`CounterRead` into the torchgram ``ValueError`` that names the fix."""
    try:
        yield
    except CounterRead as error:
        raise counter_read_error(api, error) from error
