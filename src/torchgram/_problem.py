"""One Gramian call, normalised: the pure function of the differentiated leaves.

Backends see a :class:`GramianProblem` and nothing of the user's calling convention:

* ``rows(leaves)`` evaluates ``f`` and returns its output flattened to the ``m`` rows of
  the Jacobian (``optree.tree_leaves`` order, each leaf flattened row-major), plus aux;
* with per-sample structure (``batch_dim``), ``sample_rows(leaves, sample_inputs)``
  evaluates ``f`` on one sample seen as a batch of one and returns that sample's ``K`` rows;
  ``canonical_rows()`` then says where row ``k`` of sample ``b`` sits among the ``m`` rows.

Outputs are validated on every evaluation (shape checks only, no host sync), so a bad
output is reported by the first forward, before any Jacobian work.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch import Tensor

from torchgram._checks import fail
from torchgram._pytree import DiffLeaves

_TENSOR_SLOT = object()


@dataclass(frozen=True)
class OutputSpec:
    """Structure of ``f``'s output, as seen on the full batch.

    Attributes:
        treespec: The output's optree treespec (a single leaf for a tensor output).
        shapes: The full shape of every output leaf.
        dtype: The common floating dtype of the output; the Gramian has this dtype.
        device: The device of the first output leaf; the Gramian lives there.
        batch_dims: With per-sample structure, the sample dimension of every output leaf
            (non-negative); otherwise ``None``.
    """

    treespec: optree.PyTreeSpec
    shapes: tuple[torch.Size, ...]
    dtype: torch.dtype
    device: torch.device
    batch_dims: tuple[int, ...] | None

    @property
    def num_rows(self) -> int:
        """``m``: the total number of output entries, i.e. of Jacobian rows."""
        return sum(math.prod(shape) for shape in self.shapes)

    @property
    def is_tensor(self) -> bool:
        """Whether ``f`` returned a bare tensor (the Gramian then has shape ``S + S``)."""
        return self.treespec.num_nodes == 1 and self.treespec.num_leaves == 1


@dataclass(frozen=True)
class BatchSpec:
    """Where the samples are in the inputs (DESIGN.md §3).

    Attributes:
        batch_dim: The output dimension that indexes samples, as the user gave it.
        size: The number of samples ``B``.
        positions: For every batched input tensor, ``(arg position, leaf index)``.
        dims: The (non-negative) batch dimension of every batched input tensor.
        tensors: The batched input tensors themselves.
    """

    batch_dim: int
    size: int
    positions: tuple[tuple[int, int], ...]
    dims: tuple[int, ...]
    tensors: tuple[Tensor, ...]


class GramianProblem:
    """The function, its differentiated leaves, its inputs and the call's options.

    Args:
        api: Name of the public API, used in error messages.
        f: The user's function.
        args: The positional arguments of the call.
        kwargs: Keyword arguments, passed through to ``f`` (never differentiated or batched).
        diff: The differentiated leaves.
        has_aux: Whether ``f`` returns ``(output, aux)``.
        batch: The per-sample structure, or ``None`` for dense rows.
        chunk_size: Rows per vectorized pass (``None``: all at once; ``1``: a plain loop).
        memory_budget: Bytes of Jacobian a backend may hold at once (``None``: no cap).
        diagonal: Whether only the diagonal of the Gramian is wanted.
        per_leaf: Whether one block per leaf is wanted (otherwise only their sum).
    """

    def __init__(
        self,
        *,
        api: str,
        f: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        diff: DiffLeaves,
        has_aux: bool,
        batch: BatchSpec | None,
        chunk_size: int | None,
        memory_budget: int | None,
        diagonal: bool,
        per_leaf: bool,
    ) -> None:
        self.api = api
        self.f = f
        self.args = args
        self.kwargs = kwargs
        self.diff = diff
        self.has_aux = has_aux
        self.batch = batch
        self.chunk_size = chunk_size
        self.memory_budget = memory_budget
        self.diagonal = diagonal
        self.per_leaf = per_leaf
        self.output: OutputSpec | None = None
        # Set by callers that also want J^T w (aggregated_grad); backends that keep what makes
        # it cheap (e.g. the assembled Jacobian) then install `pullback`.
        self.keep_pullback = False
        self.pullback: Callable[[Tensor], tuple[Tensor, ...]] | None = None
        # The output rows [m] (canonical order), recorded by backends that see them for free.
        self.output_rows: Tensor | None = None
        self._aux_spec: optree.PyTreeSpec | None = None
        self._aux_constants: list[Any] = []

    @property
    def leaves(self) -> tuple[Tensor, ...]:
        """The differentiated leaves (detached)."""
        return self.diff.leaves

    # -- evaluation -------------------------------------------------------------------------

    def call(self, leaves: tuple[Tensor, ...],
             args: tuple[Any, ...] | None = None) -> tuple[Any, Any]:
        """Run ``f`` with ``leaves`` in place of the parameters; return ``(output, aux)``."""
        full_args = self.diff.rebuild_args(self.args if args is None else args, leaves)
        result = self.f(*full_args, **self.kwargs)
        if not self.has_aux:
            return result, None
        if not isinstance(result, tuple | list) or len(result) != 2:
            got = (f"a {type(result).__name__} of length {len(result)}"
                   if isinstance(result, tuple | list) else type(result).__name__)
            fail(self.api, "f to return a pair (output, aux) because has_aux=True", got,
                 "Return `out, aux` from f, or drop has_aux=True.", TypeError)
        return result[0], result[1]

    def rows(self, leaves: tuple[Tensor, ...]) -> tuple[Tensor, Any]:
        """Evaluate ``f`` on the full inputs; return its output as an ``[m]`` vector and aux."""
        out, aux = self.call(leaves)
        out_leaves = self._check_output(out, per_sample=False)
        assert self.output is not None  # recorded by _check_output
        return _concat_rows(out_leaves, self.output.dtype), aux

    def rows_with_tensor_aux(self, leaves: tuple[Tensor, ...]) -> tuple[Tensor, tuple[Tensor, ...]]:
        """:meth:`rows` for ``torch.func`` transforms, whose aux must be tensors only.

        The aux's tensor leaves are returned; the rest of it is kept aside, and
        :meth:`restore_aux` puts the transformed tensor leaves back in place.
        """
        rows, aux = self.rows(leaves)
        aux_leaves, self._aux_spec = optree.tree_flatten(aux, none_is_leaf=True)
        self._aux_constants = [_TENSOR_SLOT if isinstance(a, Tensor) else a for a in aux_leaves]
        return rows, tuple(a for a in aux_leaves if isinstance(a, Tensor))

    def restore_aux(self, aux_tensors: tuple[Tensor, ...]) -> Any:
        """Rebuild the aux pytree from its tensor leaves (see :meth:`rows_with_tensor_aux`)."""
        tensors = iter(aux_tensors)
        leaves = [next(tensors) if constant is _TENSOR_SLOT else constant
                  for constant in self._aux_constants]
        return optree.tree_unflatten(self._aux_spec, leaves)

    def sample_rows(self, leaves: tuple[Tensor, ...], sample_inputs: tuple[Tensor, ...]) -> Tensor:
        """Evaluate ``f`` on one sample (a batch of one); return that sample's ``[K]`` rows.

        ``sample_inputs`` are the batched input tensors restricted to one sample, with their
        batch dimension kept (size 1), in the order of ``self.batch.positions``.
        """
        batch = self._require_batch()
        args = _replace_input_leaves(self.args, batch.positions, sample_inputs)
        out, _ = self.call(leaves, args)
        out_leaves = self._check_output(out, per_sample=True)
        spec = self.output
        assert spec is not None and spec.batch_dims is not None
        squeezed = [leaf.squeeze(dim)
                    for leaf, dim in zip(out_leaves, spec.batch_dims, strict=True)]
        return _concat_rows(squeezed, spec.dtype)

    def output_value(self) -> Any:
        """``f``'s output on the full inputs (detached), in ``f``'s own structure.

        Rebuilt from :attr:`output_rows` when a backend recorded them, otherwise computed by
        one gradient-free forward.
        """
        if self.output_rows is None:
            with torch.no_grad():
                self.output_rows = self.rows(self.leaves)[0]
        spec = self.output
        assert spec is not None
        pieces = self.output_rows.split([math.prod(shape) for shape in spec.shapes])
        leaves = [piece.reshape(shape) for piece, shape in zip(pieces, spec.shapes, strict=True)]
        return optree.tree_unflatten(spec.treespec, leaves)

    def probe(self) -> Any:
        """Evaluate ``f`` once on the full inputs, without gradients; return its aux.

        This validates the output and records its shapes (``self.output``) when a backend
        needs them before its first differentiated pass, and gives the aux of the whole batch
        to backends that only ever evaluate single samples.
        """
        with torch.no_grad():
            return self.rows(self.leaves)[1]

    # -- row bookkeeping --------------------------------------------------------------------

    def canonical_rows(self) -> Tensor:
        """``[B, K]`` index: row ``k`` of sample ``b`` is row ``index[b, k]`` of the output.

        The per-sample row order is that of :meth:`sample_rows`: output leaves in order, each
        flattened row-major with its batch dimension removed.
        """
        batch = self._require_batch()
        spec = self.output
        if spec is None or spec.batch_dims is None:
            raise RuntimeError("canonical_rows() needs one evaluation of sample_rows() first")
        columns = []
        offset = 0
        for shape, dim in zip(spec.shapes, spec.batch_dims, strict=True):
            numel = math.prod(shape)
            index = torch.arange(offset, offset + numel, device=spec.device).reshape(shape)
            columns.append(index.movedim(dim, 0).reshape(batch.size, -1))
            offset += numel
        return torch.cat(columns, dim=1)

    def _require_batch(self) -> BatchSpec:
        if self.batch is None:
            raise RuntimeError("per-sample evaluation needs batch_dim")
        return self.batch

    # -- output validation ------------------------------------------------------------------

    def _check_output(self, out: Any, *, per_sample: bool) -> list[Tensor]:
        out_leaves, treespec = optree.tree_flatten(out)
        if not out_leaves:
            fail(self.api, "f to return a floating tensor or a pytree of them",
                 f"an empty pytree {out!r:.80}", "Return the losses or outputs to differentiate.",
                 TypeError)
        for leaf in out_leaves:
            if not isinstance(leaf, Tensor):
                fail(self.api, "f to return a floating tensor or a pytree of them",
                     f"a leaf of type {type(leaf).__name__}",
                     "Return torch tensors (wrap Python numbers with torch.as_tensor).", TypeError)
            if leaf.is_complex():
                fail(self.api, "real floating outputs", f"dtype {leaf.dtype}",
                     "The Gramian of a complex function is not defined here: return "
                     "torch.view_as_real(out) to treat real and imaginary parts as rows.",
                     TypeError)
            if not leaf.is_floating_point():
                fail(self.api, "floating outputs", f"dtype {leaf.dtype}",
                     "Integer and boolean outputs have no derivative: return a floating "
                     "tensor (e.g. the loss before argmax).", TypeError)
        if self.output is None:
            self.output = self._make_spec(out_leaves, treespec, per_sample)
        return out_leaves

    def _make_spec(self, out_leaves: list[Tensor], treespec: optree.PyTreeSpec,
                   per_sample: bool) -> OutputSpec:
        dtype = out_leaves[0].dtype
        for leaf in out_leaves[1:]:
            dtype = torch.promote_types(dtype, leaf.dtype)
        shapes = tuple(leaf.shape for leaf in out_leaves)
        batch_dims = None
        if self.batch is not None:
            batch_dims = tuple(self._output_batch_dim(shape, per_sample) for shape in shapes)
            if per_sample:
                shapes = tuple(
                    torch.Size((*shape[:dim], self.batch.size, *shape[dim + 1:]))
                    for shape, dim in zip(shapes, batch_dims, strict=True)
                )
        return OutputSpec(treespec, shapes, dtype, out_leaves[0].device, batch_dims)

    def _output_batch_dim(self, shape: torch.Size, per_sample: bool) -> int:
        batch = self._require_batch()
        ndim = len(shape)
        if not -ndim <= batch.batch_dim < ndim:
            fail(self.api, f"batch_dim within [-{ndim}, {ndim}) for an output of "
                 f"{ndim} dimension(s)", f"batch_dim={batch.batch_dim} (output shape "
                 f"{tuple(shape) if not per_sample else 'of one sample ' + str(tuple(shape))})",
                 "batch_dim names the output dimension that indexes samples.")
        dim = batch.batch_dim % ndim
        expected = 1 if per_sample else batch.size
        if shape[dim] != expected:
            seen = "one sample (a batch of one)" if per_sample else "the whole batch"
            fail(self.api, f"output dim {dim} (batch_dim) to have size {expected} for {seen}",
                 f"an output of shape {tuple(shape)}",
                 "Check batch_dim and in_dims: each output entry along batch_dim must depend "
                 "on the matching sample of the batched inputs only.")
        return dim


def _concat_rows(out_leaves: list[Tensor], dtype: torch.dtype) -> Tensor:
    if len(out_leaves) == 1:
        return out_leaves[0].reshape(-1).to(dtype)
    return torch.cat([leaf.reshape(-1).to(dtype) for leaf in out_leaves])


def _replace_input_leaves(args: tuple[Any, ...], positions: tuple[tuple[int, int], ...],
                          values: tuple[Tensor, ...]) -> tuple[Any, ...]:
    """Return ``args`` with leaf ``j`` of argument ``i`` replaced, for each ``(i, j)``."""
    by_arg: dict[int, list[tuple[int, Tensor]]] = {}
    for (i, j), value in zip(positions, values, strict=True):
        by_arg.setdefault(i, []).append((j, value))
    rebuilt = list(args)
    for i, replacements in by_arg.items():
        leaves, spec = optree.tree_flatten(args[i])
        for j, value in replacements:
            leaves[j] = value
        rebuilt[i] = optree.tree_unflatten(spec, leaves)
    return tuple(rebuilt)


def make_batch_spec(api: str, args: tuple[Any, ...], argnums: tuple[int, ...], batch_dim: int,
                    in_dims: int | None | tuple[int | None, ...]) -> BatchSpec:
    """Find the batched input tensors from ``in_dims`` and check their batch sizes agree."""
    input_positions = [i for i in range(len(args)) if i not in argnums]
    if isinstance(in_dims, tuple | list):
        if len(in_dims) != len(input_positions):
            fail(api, f"in_dims with one entry per non-differentiated positional argument "
                 f"({len(input_positions)} here: positions {input_positions})",
                 f"in_dims={tuple(in_dims)!r} with {len(in_dims)} entries",
                 "Give an int (batched) or None (shared) for each input, or a single int.")
        per_input = tuple(in_dims)
    else:
        per_input = (in_dims,) * len(input_positions)
    positions, dims, tensors = [], [], []
    for i, dim in zip(input_positions, per_input, strict=True):
        if dim is None:
            continue
        for j, leaf in enumerate(optree.tree_leaves(args[i])):
            if not isinstance(leaf, Tensor):
                continue
            if leaf.dim() == 0 or not -leaf.dim() <= dim < leaf.dim():
                fail(api, f"in_dims entry {dim} to be a valid dimension of every tensor in "
                     f"argument {i}", f"a tensor of shape {tuple(leaf.shape)}",
                     "Set that argument's in_dims entry to None if it is shared by all samples.")
            positions.append((i, j))
            dims.append(dim % leaf.dim())
            tensors.append(leaf)
    if not tensors:
        fail(api, "at least one batched input tensor when batch_dim is given",
             f"in_dims={in_dims!r} selecting no tensor among the inputs",
             "Pass the batch as a positional argument with in_dims pointing at its sample "
             "dimension, or drop batch_dim.")
    sizes = {tensor.shape[dim] for tensor, dim in zip(tensors, dims, strict=True)}
    if len(sizes) != 1:
        described = ", ".join(
            f"arg {i} leaf {j}: {tuple(t.shape)} at dim {d}"
            for (i, j), t, d in zip(positions, tensors, dims, strict=True)
        )
        fail(api, "all batched inputs to have the same batch size",
             f"different sizes {sorted(sizes)} ({described})",
             "Fix in_dims (None for shared inputs) or the inputs' shapes.")
    size = sizes.pop()
    if size == 0:
        fail(api, "a non-empty batch", "batch size 0", "Pass at least one sample.")
    return BatchSpec(batch_dim, size, tuple(positions), tuple(dims), tuple(tensors))
