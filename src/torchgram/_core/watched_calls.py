"""Calls whose derivatives torch gets wrong: what the probe records, evaluations and walks do.

One table serves the probe (:class:`~torchgram._core.census.OpCensus` records the calls ``f``
makes, in ``Probe.decomposed``), the check of a cached probe (``ProbeCheck``: a call it did not
record starts the call over, NOTE [stale probes]), every later evaluation of ``f`` (the mode of
each recorded call, in the table's order) and the graph walks (:func:`check_node`, for graphs
built outside those evaluations):

* ``prelu``, run as ``where`` (NOTE [prelu as where]);
* determinants, refused at exactly singular matrices (NOTE [singular determinants]);
* ``as_strided_scatter``, run as ``where`` over its view (NOTE [as_strided_scatter's backward]);
* ``scatter_reduce``, max/min without ``self`` run from a ``∓inf`` buffer (NOTE
  [scatter_reduce's ties with the excluded self]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from typing import Any

from torch.overrides import TorchFunctionMode

from torchgram._core.as_strided_scatter import (
    AS_STRIDED_SCATTER,
    AS_STRIDED_SCATTER_NODE,
    AsStridedScatterRewritten,
    calls_as_strided_scatter,
    check_as_strided_scatter_node,
)
from torchgram._core.determinants import (
    DETERMINANT,
    DETERMINANT_NODES,
    SingularDeterminantsRefused,
    check_determinant_node,
    computes_determinant,
)
from torchgram._core.prelu import PRELU, PreluAsWhere, calls_prelu
from torchgram._core.scatter_reduce import (
    SCATTER_REDUCE,
    SCATTER_REDUCE_NODE,
    ScatterReduceWithoutSelf,
    calls_scatter_reduce,
    check_scatter_reduce_node,
)

WATCHED_CALLS: tuple[tuple[Callable[[Any], bool], str, type[TorchFunctionMode]], ...] = (
    (calls_prelu, PRELU, PreluAsWhere),
    (computes_determinant, DETERMINANT, SingularDeterminantsRefused),
    (calls_as_strided_scatter, AS_STRIDED_SCATTER, AsStridedScatterRewritten),
    (calls_scatter_reduce, SCATTER_REDUCE, ScatterReduceWithoutSelf),
)
"""Per watched call: whether a torch function is it, the name probes record, the mode."""

_NODE_CHECKS: dict[str, Callable[[Any, str], None]] = {
    **dict.fromkeys(DETERMINANT_NODES, check_determinant_node),
    AS_STRIDED_SCATTER_NODE: check_as_strided_scatter_node,
    SCATTER_REDUCE_NODE: check_scatter_reduce_node,
}
CHECKED_NODES = frozenset(_NODE_CHECKS)
"""The names of the autograd nodes :func:`check_node` reads."""


def watched_name(func: Any) -> str | None:
    """The name probes record for ``func``, if it is a watched call.

    Example:
        >>> import torch
        >>> watched_name(torch.linalg.det), watched_name(torch.add)
        ('a determinant', None)
    """
    for calls, name, _ in WATCHED_CALLS:
        if calls(func):
            return name
    return None


@contextlib.contextmanager
def watched_calls_modes(recorded: Collection[str]) -> Iterator[None]:
    """The modes of the watched calls whose names are in ``recorded``, in the table's order."""
    with contextlib.ExitStack() as stack:
        for _, name, mode in WATCHED_CALLS:
            if name in recorded:
                stack.enter_context(mode())
        yield


def check_node(node: Any, name: str) -> None:
    """Raise ``node``'s ``DerivativeFault`` where torch's backward of it is wrong.

    ``name`` is the node's name; every other node passes after one lookup.
    """
    check = _NODE_CHECKS.get(name)
    if check is not None:
        check(node, name)
