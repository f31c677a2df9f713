"""``backend="ntvp"``: the Gramian without the Jacobian, from vjps pushed forward by jvps.

Column ``i`` of ``G = J Jᵀ`` is ``J (Jᵀ e_i)`` (DESIGN.md §2): a reverse-mode product
(``torch.func.vjp``) gives ``v_i = Jᵀ e_i``, a parameter-shaped pytree, and a forward-mode
product (``torch.func.jvp``) pushes it through ``f`` to ``J v_i``, the ``m`` entries of
``G[:, i]``. Both are ``vmap``-ped over a chunk of ``c`` rows (``chunk_size``; ``1`` is a plain
loop without ``vmap``), so the rows of ``G`` are filled ``c`` at a time.

Memory: per chunk, the ``c`` vjps (``c × P`` numbers, ``P`` = all parameters), the jvp's
tangents of one forward pass (``c ×`` the activations of ``f``; forward mode stores no graph)
and ``c × m`` outputs; plus the ``[m, m]`` result and, for dense rows, the saved activations
of one full-batch forward. Never ``m × P``. ``chunk_size=None`` with a ``memory_budget``
picks the largest ``c`` with ``c · P · itemsize ≤ memory_budget``; with neither, all ``m``
rows form one chunk (then the vjps alone are ``m × P``: pass ``chunk_size`` or
``memory_budget`` to bound them). Time: ``⌈m / c⌉`` vmapped vjps and jvps (``L`` jvps per
chunk with ``per_leaf=True``), i.e. about ``m`` backward and ``m`` forward passes of work.

* ``per_leaf=True``: ``G_l[:, i] = J_l (J_lᵀ e_i)``; one jvp per leaf, with only leaf ``l``
  as a primal (the others are constants, which is a zero tangent, without its arithmetic).
* ``batch_dim``: see NOTE [ntvp per-sample rows].
* ``diagonal=True``: see NOTE [ntvp diagonal].
* Forward-mode AD must exist for every op of ``f``: see NOTE [missing forward AD].

Example:
    >>> import torch, torchgram as tg
    >>> def f(params, x):
    ...     return torch.tanh(x @ params["w"]) @ params["v"]
    >>> params = {"w": torch.randn(3, 4), "v": torch.randn(4)}
    >>> x = torch.randn(6, 3)
    >>> G = tg.gramian(f, backend="ntvp", chunk_size=2)(params, x)
    >>> torch.allclose(G, tg.gramian(f, backend="jacobian")(params, x), atol=1e-5)
    True
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchgram._checks import fail
from torchgram._problem import GramianProblem
from torchgram.backends._grouping import rows_per_chunk
from torchgram.backends._registry import register
from torchgram.backends._sink import GramSink
from torchgram.backends.jacobian import _row_vjps, jacobian_backend, replace_leaves

Tangents = tuple[Tensor, ...]
"""One tensor per differentiated leaf, ``[c, *leaf.shape]``: the vjps of ``c`` rows."""


@register("ntvp")
def ntvp_backend(problem: GramianProblem, sink: GramSink) -> Any:
    """Compute the Gramian blocks of ``problem`` column by column, as ``J (Jᵀ e_i)``."""
    # NOTE [ntvp diagonal]
    # G_ii = ||Jᵀ e_i||² (per leaf: the sum of squares of leaf l's part) needs the vjps only,
    # no forward-mode pass. That is exactly the jacobian backend's diagonal mode: chunked
    # vjps (per-sample gradients with batch_dim), squared and summed per leaf, each chunk
    # freed, no block assembled, chunk sized by chunk_size or memory_budget over the
    # transient c × P. Same bound as here, so the diagonal is delegated to it.
    if problem.diagonal:
        return jacobian_backend(problem, sink)
    _prepare_forward_ad()
    if problem.batch is None:
        return _dense_rows(problem, sink)
    aux = problem.probe()  # the row count K per sample sizes the chunks; aux of the batch
    _per_sample_rows(problem, sink)
    return aux


# -- dense rows ------------------------------------------------------------------------------

def _dense_rows(problem: GramianProblem, sink: GramSink) -> Any:
    rows, vjp_fn, aux_tensors = torch.func.vjp(
        lambda *leaves: problem.rows_with_tensor_aux(leaves), *problem.leaves, has_aux=True)
    aux = problem.restore_aux(aux_tensors)
    num_rows = rows.numel()
    columns = _Columns(problem, num_rows)
    chunk = _rows_per_chunk(problem, num_rows)
    for start in range(0, num_rows, chunk):
        stop = min(start + chunk, num_rows)
        columns.push(slice(start, stop), _row_vjps(vjp_fn, rows, start, stop))
    columns.flush(sink)
    return aux


# -- per-sample rows -------------------------------------------------------------------------

# NOTE [ntvp per-sample rows]
# With batch_dim, row (b, k) depends on sample b only, so its vjp Jᵀ e_(b,k) is a gradient
# of f on sample b alone: per chunk, a vmap over its samples of (one single-sample forward,
# then the vjps of the chunk's rows of that sample) -- about B times less work than a
# full-batch backward per row, and no full-batch graph is kept. The jvp cannot be split
# that way: column (b, k) of G pairs row (b, k) with the rows of *every* sample, i.e.
# J v = [J_b' v]_b' over all b'. One full-batch forward-mode pass computes all of them at the
# cost of B single-sample ones, and better vectorized, so the jvp runs on the full batch.
# A chunk is either whole samples (c ≥ K rows per sample: c // K samples) or a slice of one
# sample's rows (c < K), so it never holds more than c vjps. Results land in the rows
# problem.canonical_rows() assigns to (b, k).

def _per_sample_rows(problem: GramianProblem, sink: GramSink) -> None:
    batch, spec = problem.batch, problem.output
    assert batch is not None and spec is not None
    num_rows = spec.num_rows
    rows_per_sample = num_rows // batch.size
    if rows_per_sample == 0:
        return
    canonical = problem.canonical_rows()
    columns = _Columns(problem, num_rows)
    chunk = _rows_per_chunk(problem, num_rows)
    for first, count, k_start, k_stop in _sample_chunks(batch.size, rows_per_sample, chunk):
        inputs = tuple(t.narrow(d, first, count) for t, d in zip(batch.tensors, batch.dims,
                                                                   strict=True))
        # the vjps are not bound to a name: they are freed before the next chunk's exist
        columns.push(canonical[first:first + count, k_start:k_stop].reshape(-1),
                     _sample_vjps(problem, inputs, k_start, k_stop))
    columns.flush(sink)


def _sample_chunks(num_samples: int, rows_per_sample: int,
                   chunk: int) -> Iterator[tuple[int, int, int, int]]:
    """``(first sample, sample count, first row, stop row)`` of each chunk of ``chunk`` rows.

    Example:
        >>> list(_sample_chunks(3, 2, 4))
        [(0, 2, 0, 2), (2, 1, 0, 2)]
        >>> list(_sample_chunks(2, 3, 2))
        [(0, 1, 0, 2), (0, 1, 2, 3), (1, 1, 0, 2), (1, 1, 2, 3)]
    """
    if chunk >= rows_per_sample:
        samples = chunk // rows_per_sample
        for first in range(0, num_samples, samples):
            yield first, min(samples, num_samples - first), 0, rows_per_sample
        return
    for sample in range(num_samples):
        for start in range(0, rows_per_sample, chunk):
            yield sample, 1, start, min(start + chunk, rows_per_sample)


def _sample_vjps(problem: GramianProblem, inputs: tuple[Tensor, ...], k_start: int,
                 k_stop: int) -> Tangents:
    """The vjps of rows ``k_start..k_stop-1`` of each sample in ``inputs``, sample-major."""
    batch = problem.batch
    assert batch is not None

    def one_sample(*sample: Tensor) -> Tangents:  # inputs of one sample, batch dim kept
        rows, vjp_fn = torch.func.vjp(lambda *leaves: problem.sample_rows(leaves, sample),
                                      *problem.leaves)
        return _row_vjps(vjp_fn, rows, k_start, k_stop)

    count = inputs[0].shape[batch.dims[0]]
    if count == 1:
        return one_sample(*inputs)

    def unsqueezed(*sample: Tensor) -> Tangents:
        return one_sample(*(x.unsqueeze(d) for x, d in zip(sample, batch.dims, strict=True)))

    per_sample = torch.func.vmap(unsqueezed, in_dims=batch.dims)(*inputs)
    return tuple(t.flatten(0, 1) for t in per_sample)


# -- pushing forward -------------------------------------------------------------------------

class _Columns:
    """The ``[m, m]`` result(s), filled ``c`` rows at a time by pushing vjps forward."""

    def __init__(self, problem: GramianProblem, num_rows: int) -> None:
        self.problem = problem
        spec = problem.output
        assert spec is not None
        count = len(problem.leaves) if problem.per_leaf else 1
        self.blocks = [torch.zeros(num_rows, num_rows, dtype=spec.dtype, device=spec.device)
                       for _ in range(count)]

    def push(self, rows: slice | Tensor, tangents: Tangents) -> None:
        """Store ``J v`` (``J_l v_l`` per leaf) at ``rows``, for the vjps ``v`` of ``rows``."""
        problem = self.problem
        leaves = problem.leaves
        if not problem.per_leaf:
            self.blocks[0][rows] = _push_forward(problem, lambda *ls: problem.rows(ls)[0],
                                                 leaves, tangents)
            return
        for index, (block, tangent) in enumerate(zip(self.blocks, tangents, strict=True)):
            def rows_of_leaf(leaf: Tensor, index: int = index) -> Tensor:
                return problem.rows(replace_leaves(leaves, (index,), (leaf,)))[0]

            block[rows] = _push_forward(problem, rows_of_leaf, (leaves[index],), (tangent,))

    def flush(self, sink: GramSink) -> None:
        """Hand the blocks to the sink, symmetrized.

        Row ``i`` was computed as ``J (Jᵀ e_i)``, column ``i`` by other rows' pushes: equal in
        exact arithmetic, not bitwise. Averaging with the transpose makes ``G`` exactly
        symmetric, which factorizations downstream (Cholesky, ``eigh``) rely on.
        """
        for index, block in enumerate(self.blocks):
            sink.add(index, (block + block.mT).mul_(0.5))


def _push_forward(problem: GramianProblem, rows_fn: Callable[..., Tensor],
                  primals: Sequence[Tensor], tangents: Tangents) -> Tensor:
    """``[c, m]``: ``rows_fn``'s jvp at ``primals`` along each of the ``c`` tangents."""

    def push(*tangent: Tensor) -> Tensor:
        return torch.func.jvp(rows_fn, tuple(primals), tangent)[1]

    with _forward_mode(problem.api):
        if tangents[0].shape[0] == 1:
            return push(*(t[0] for t in tangents)).unsqueeze(0)
        return torch.func.vmap(push)(*tangents)


def _rows_per_chunk(problem: GramianProblem, num_rows: int) -> int:
    width = sum(leaf.numel() for leaf in problem.leaves)
    itemsize = max(leaf.element_size() for leaf in problem.leaves)
    return rows_per_chunk(problem.chunk_size, num_rows, width, itemsize, problem.memory_budget)


# -- forward-mode AD: setup and errors -------------------------------------------------------

# NOTE [first forward-AD call]
# The first forward-mode product in a process imports torch's jvp decompositions, which
# call torch.jit.script and, in torch >= 2.11, emit a DeprecationWarning that the user cannot
# act on (and that fails programs running with -W error). One tiny jvp at first use, with
# just that warning ignored, does the import once.

@functools.cache
def _prepare_forward_ad() -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`?torch\.jit\.script`? is deprecated",
                                category=DeprecationWarning)
        torch.func.jvp(torch.sin, (torch.zeros(()),), (torch.zeros(()),))


# NOTE [missing forward AD]
# Some ops have no forward-mode derivative (torch 2.13: e.g. torch.cdist, embedding_bag,
# grid_sample, ctc_loss), nor does a custom autograd.Function without a jvp staticmethod.
# ntvp then raises a NotImplementedError naming the op and suggesting a reverse-mode
# backend; it never falls back silently: the user picked ntvp for its memory bound, and the
# jacobian backend would hold m × P. The one exception is attention: the fused
# scaled_dot_product_attention kernels (flash, memory-efficient, cuDNN) have no forward AD,
# but its math implementation does and computes the same function. The forward-mode pass
# therefore runs with only the math kernel enabled (torch.nn.attention.sdpa_kernel, a
# process-wide setting restored on exit); the reverse-mode pass keeps the user's kernels.

_NATIVE_OP = re.compile(r"Trying to use forward AD with (\S+) that does not support it")
_CUSTOM_FUNCTION = "must implement the jvp function for custom autograd.Function"
_FIX = ("Use backend='jacobian' or backend='graph' (reverse mode only) for this function, "
        "or ")


@contextlib.contextmanager
def _forward_mode(api: str) -> Iterator[None]:
    """Run forward-mode AD with attention's math kernel; explain ops that lack forward AD."""
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    except (NotImplementedError, RuntimeError) as err:
        message = str(err)
        native = _NATIVE_OP.search(message)
        if native is not None:
            got = (f"an operation without a forward-mode derivative in torch "
                   f"{torch.__version__}: aten::{native.group(1)}")
            fix = _FIX + "replace that operation."
        elif _CUSTOM_FUNCTION in message:
            got = (f"the custom autograd.Function {_custom_function_name(err)} without a jvp "
                   "staticmethod")
            fix = _FIX + "give the Function a jvp staticmethod (see the PyTorch notes "
            fix += "'Extending torch.func with autograd.Function')."
        else:
            raise
        try:
            fail(api, "every operation of f to support forward-mode AD (backend='ntvp' "
                 "pushes vjps forward with torch.func.jvp)", got, fix, NotImplementedError)
        except NotImplementedError as clear:
            raise clear from err


def _custom_function_name(err: BaseException) -> str:
    """The innermost user ``autograd.Function`` on ``err``'s traceback, best effort."""
    name = "(name not found)"
    frame = err.__traceback__
    while frame is not None:
        function = frame.tb_frame.f_locals.get("autograd_function")
        if isinstance(function, type) and issubclass(function, torch.autograd.Function):
            name = function.__qualname__
        frame = frame.tb_next
    return name
