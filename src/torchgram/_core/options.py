"""The options of a transform, validated once when it is built.

``torchgram.gramian``, ``torchgram.aggregated_grad`` and ``torchgram.explain`` take the same
keyword options; each builds one :class:`Options` with :meth:`Options.validate`, which is
the only place they are checked. Every message names the API that refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

from torchgram._core import checks

BackendName = Literal["auto", "graph", "jacobian", "ntvp", "structured"]
"""The ``backend=`` values (``"auto"`` picks among the others)."""

BACKEND_NAMES: tuple[str, ...] = get_args(BackendName)

InDims = int | None | tuple[int | None | dict[str, int | None], ...]
"""Where the samples are in the non-differentiated arguments (like ``torch.func.vmap``): one
int or ``None`` for every argument, or one per non-differentiated positional argument,
optionally followed by a dict for keyword arguments (NOTE [in_dims])."""


@dataclass(frozen=True)
class Options:
    """The validated options of a transform (see ``torchgram.gramian`` for their meaning).

    Attributes:
        api: The public API, named in every error message.
        argnums: The differentiated positional arguments (negatives resolved per call).
        single_argnum: Whether ``argnums`` was a bare int (results are then not tuples).
        has_aux: Whether ``f`` returns ``(output, aux)``.
        backend: The backend name.
        chunk_size: Jacobian rows per vectorized pass (``None``: all; ``1``: a loop).
        batch_dim: The output dimension indexing independent samples, or ``None``.
        in_dims: Where the samples are in the inputs, with ``batch_dim``.
        diagonal: Whether only ``G[i, i]`` is wanted.
        per_leaf: Whether one block per differentiated leaf is wanted.
        memory_budget: Bytes of Jacobian a backend may hold at once (``None``: no cap).
        progress: Whether to show a progress bar over the row chunks (NOTE [progress]).

    Example:
        >>> options = Options.validate("torchgram.gramian", abs, (0, -1), chunk_size=8)
        >>> options.argnums, options.single_argnum, options.backend
        ((0, -1), False, 'auto')
        >>> Options.validate("torchgram.gramian", abs, chunk_size=0)
        Traceback (most recent call last):
        ...
        ValueError: torchgram.gramian: expected chunk_size to be a positive int, but got 0. ...
    """

    api: str
    argnums: tuple[int, ...]
    single_argnum: bool
    has_aux: bool
    backend: BackendName
    chunk_size: int | None
    batch_dim: int | None
    in_dims: InDims
    diagonal: bool
    per_leaf: bool
    memory_budget: int | None
    progress: bool = False

    @classmethod
    def validate(cls, api: str, f: Callable[..., Any], argnums: int | Sequence[int] = 0, *,
                 has_aux: bool = False, backend: str = "auto", chunk_size: int | None = None,
                 batch_dim: int | None = None, in_dims: Any = 0, diagonal: bool = False,
                 per_leaf: bool = False, memory_budget: int | None = None,
                 progress: bool = False) -> Options:
        """Check every option of a transform when it is built; raise with the API's name."""
        checks.check_callable(api, f)
        nums, single = checks.normalize_argnums(api, argnums)
        checks.check_bool(api, "has_aux", has_aux)
        checks.check_bool(api, "diagonal", diagonal)
        checks.check_bool(api, "per_leaf", per_leaf)
        checks.check_bool(api, "progress", progress)
        checks.check_choice(api, "backend", backend, BACKEND_NAMES)
        chunk_size = checks.positive_int(
            api, "chunk_size", chunk_size,
            "chunk_size counts Jacobian rows per vectorized pass, e.g. 32.")
        memory_budget = checks.positive_int(
            api, "memory_budget", memory_budget,
            "memory_budget is a number of bytes, e.g. 2**30 for 1 GiB.")
        checks.check_batch_dim(api, batch_dim)
        checks.check_in_dims(api, in_dims)
        in_dims_value = in_dims
        if isinstance(in_dims, list | tuple):
            in_dims_value = tuple(dict(entry) if isinstance(entry, dict) else entry
                                  for entry in in_dims)
        return cls(api, nums, single, has_aux, cast(BackendName, backend), chunk_size,
                   batch_dim, in_dims_value, diagonal, per_leaf, memory_budget, progress)

    def replace(self, **changes: Any) -> Options:
        """A copy with some options changed (e.g. ``backend`` when ``auto`` delegates)."""
        return dataclasses.replace(self, **changes)
