"""Shared machinery of the transforms: validated options, and one Gramian computation.

``gramian`` and ``aggregated_grad`` both validate their options here when they are built,
and run :func:`run_gramian` when they are called.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from torchgram import _checks
from torchgram._problem import GramianProblem, OutputSpec, make_batch_spec
from torchgram._pytree import DiffLeaves, select_diff_leaves
from torchgram.backends import NO_AUX, Backend, backend_names, get_backend
from torchgram.backends._sink import GramSink


@dataclass(frozen=True)
class GramianOptions:
    """The validated options of a transform (see ``torchgram.gramian`` for their meaning)."""

    api: str
    f: Callable[..., Any]
    argnums: tuple[int, ...]
    single_argnum: bool
    has_aux: bool
    backend: str
    chunk_size: int | None
    batch_dim: int | None
    in_dims: int | None | tuple[int | None, ...]
    diagonal: bool
    per_leaf: bool
    memory_budget: int | None

    @property
    def run_backend(self) -> Backend:
        """The backend function."""
        return get_backend(self.backend)


def validate_options(api: str, f: Callable[..., Any], argnums: int | Sequence[int], *,
                     has_aux: bool, backend: str, chunk_size: int | None,
                     batch_dim: int | None, in_dims: int | None | Sequence[int | None],
                     diagonal: bool, per_leaf: bool,
                     memory_budget: int | None) -> GramianOptions:
    """Check every option of a transform when it is built; raise with the API's name."""
    _checks.check_callable(api, f)
    nums, single = _checks.normalize_argnums(api, argnums)
    _checks.check_bool(api, "has_aux", has_aux)
    _checks.check_bool(api, "diagonal", diagonal)
    _checks.check_bool(api, "per_leaf", per_leaf)
    _checks.check_choice(api, "backend", backend, backend_names())
    _checks.check_positive_int(api, "chunk_size", chunk_size,
                               "chunk_size counts Jacobian rows per vectorized pass, e.g. 32.")
    _checks.check_positive_int(api, "memory_budget", memory_budget,
                               "memory_budget is a number of bytes, e.g. 2**30 for 1 GiB.")
    _checks.check_batch_dim(api, batch_dim)
    _checks.check_in_dims(api, in_dims)
    in_dims_value = tuple(in_dims) if isinstance(in_dims, list | tuple) else in_dims
    return GramianOptions(api, f, nums, single, has_aux, backend, chunk_size, batch_dim,
                          in_dims_value, diagonal, per_leaf, memory_budget)


@dataclass
class GramianRun:
    """What one computation produced.

    Attributes:
        problem: The normalised problem (its ``output`` spec, ``pullback``, ``output_rows``).
        diff: The differentiated leaves.
        blocks: The Gramian ``[m, m]`` (or ``[m]`` diagonal) — one per leaf with ``per_leaf``.
        aux: ``f``'s aux output, or ``None`` without ``has_aux``.
    """

    problem: GramianProblem
    diff: DiffLeaves
    blocks: list[Tensor]
    aux: Any

    @property
    def spec(self) -> OutputSpec:
        """The output's structure."""
        assert self.problem.output is not None
        return self.problem.output


def build_problem(options: GramianOptions, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> GramianProblem:
    """Validate a call's arguments against the options and normalise them into a problem."""
    api = options.api
    argnums = _checks.resolve_argnums(api, options.argnums, len(args))
    diff = select_diff_leaves(args, argnums)
    if not diff.leaves:
        _checks.fail(api, f"floating-point tensor leaves in the differentiated argument(s) "
                     f"{argnums}",
                     "none (" + ", ".join(type(args[i]).__name__ for i in argnums) + ")",
                     "Pass the parameters (a tensor or a pytree of float tensors) at argnums, "
                     "or change argnums.", TypeError)
    batch = (None if options.batch_dim is None
             else make_batch_spec(api, args, argnums, options.batch_dim, options.in_dims))
    return GramianProblem(
        api=api, f=options.f, args=args, kwargs=kwargs, diff=diff, has_aux=options.has_aux,
        batch=batch, chunk_size=options.chunk_size, memory_budget=options.memory_budget,
        diagonal=options.diagonal, per_leaf=options.per_leaf,
    )


def run_gramian(options: GramianOptions, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                keep_pullback: bool = False) -> GramianRun:
    """Validate the call's arguments, then compute the Gramian blocks."""
    problem = build_problem(options, args, kwargs)
    diff = problem.diff
    problem.keep_pullback = keep_pullback
    sink = GramSink(len(diff.leaves), per_leaf=options.per_leaf, diagonal=options.diagonal)
    aux = options.run_backend(problem, sink)
    if problem.output is None or (options.has_aux and aux is NO_AUX):
        aux = problem.probe()  # a backend that evaluated nothing on the full batch
    spec = problem.output
    assert spec is not None
    blocks = sink.result(spec.num_rows, spec.dtype, spec.device)
    return GramianRun(problem, diff, blocks, aux if options.has_aux else None)


def shape_result(block: Tensor, spec: OutputSpec, diagonal: bool) -> Tensor:
    """Reshape an ``[m, m]`` (or ``[m]``) block to ``S + S`` (``S``) for a tensor output."""
    if not spec.is_tensor:
        return block
    shape = spec.shapes[0]
    return block.reshape(shape if diagonal else (*shape, *shape))
