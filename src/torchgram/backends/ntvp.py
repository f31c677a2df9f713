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
* Forward-mode AD must exist for every op of ``f``: see NOTE [missing forward AD]; at kinks
  it takes the backward's derivative: see NOTE [kinks in forward mode].

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
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from torchgram._core import _torch_compat, functional
from torchgram._core.census import refusing_gradient_hooks
from torchgram._core.errors import BackendCannotRun, NotPerSample, OutputChanged
from torchgram._core.per_sample import batch_rows, check_samples, fails_alone
from torchgram._core.problem import Problem, TensorAux
from torchgram._core.progress import Progress
from torchgram._core.result import BackendResult, RunReport
from torchgram._core.threads import FORWARD_AD_LOCK, forward_mode_pass, math_attention
from torchgram.backends._draws_under_transforms import refuse_data_assignments, refuse_draws
from torchgram.backends._embedding import checked_conventions
from torchgram.backends._forward_mode_faults import RefuseWrongTangents, WrongForwardDerivative
from torchgram.backends._grouping import rows_per_chunk
from torchgram.backends._kinks import ReverseKinks, TieInForwardMode
from torchgram.backends._no_grad_tangents import GradOffInForwardMode, NoGradStopsTangents
from torchgram.backends._registry import register
from torchgram.backends._vmap_or_loop import per_sample_or_batch
from torchgram.backends.jacobian import jacobian_backend, replace_leaves, row_vjps

Tangents = tuple[Tensor, ...]
"""One tensor per differentiated leaf, ``[c, *leaf.shape]``: the vjps of ``c`` rows."""


@register("ntvp")
def ntvp_backend(problem: Problem) -> BackendResult:
    """Compute the Gramian blocks of ``problem`` column by column, as ``J (Jᵀ e_i)``."""
    refuse_data_assignments(problem, "ntvp")  # NOTE [data assigned to itself]
    # NOTE [ntvp diagonal]
    # G_ii = ||Jᵀ e_i||² (per leaf: the sum of squares of leaf l's part) needs the vjps only,
    # no forward-mode pass. That is exactly the jacobian backend's diagonal mode: chunked
    # vjps (per-sample gradients with batch_dim), squared and summed per leaf, each chunk
    # freed, no block assembled, chunk sized by chunk_size or memory_budget over the
    # transient c × P. Same bound as here, so the diagonal is delegated to it.
    if problem.diagonal:
        result = jacobian_backend(problem)
        result.report.backend = "ntvp"
        result.report.notes.append("diagonal: the jacobian backend's vjps (no forward mode)")
        return result
    _prepare_forward_ad(problem.api)
    # NOTE [gradient hooks inside f], NOTE [embedding conventions]
    with refusing_gradient_hooks(problem.api, "ntvp"), \
            checked_conventions(problem, "ntvp", write_out=True):
        return per_sample_or_batch(
            problem, "ntvp", lambda loop, per_sample: _run(problem, loop, per_sample=per_sample))


def _run(problem: Problem, loop: bool, *, per_sample: bool) -> BackendResult:
    way = "per-sample vjps" if per_sample else "rows of the batch"
    report = RunReport("ntvp", f"{way}, {'loops' if loop else 'vmap'}")
    if per_sample:
        return _per_sample_rows(problem, report, loop)
    return _dense_rows(problem, report, loop)


# -- dense rows ------------------------------------------------------------------------------

def _dense_rows(problem: Problem, report: RunReport, loop: bool) -> BackendResult:
    aux_parts = TensorAux()

    def rows_fn(*leaves: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        rows, aux = problem.rows(leaves)
        return rows, aux_parts.split(aux)

    rows, vjp_fn, aux_tensors = functional.vjp_with_aux(rows_fn, *problem.leaves)
    refuse_draws(problem, "ntvp")  # NOTE [draws under torch.func]
    num_rows = rows.numel()
    columns = _Columns(problem, report)
    chunk = 1 if loop else _rows_per_chunk(problem, num_rows)
    with Progress(problem.options.progress, -(-num_rows // chunk), "ntvp row chunks") as bar:
        for start in range(0, num_rows, chunk):
            stop = min(start + chunk, num_rows)
            columns.push(slice(start, stop), row_vjps(vjp_fn, rows, start, stop))
            bar.update()
    return BackendResult(columns.blocks(), report, symmetric=False,
                         aux=aux_parts.join(aux_tensors), rows=rows.detach())


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
# sample's rows (c < K), so it never holds more than c vjps. A chunk's rows are stored at
# their output rows (``Problem.sample_major_index``), so the blocks are in output order.

def _per_sample_rows(problem: Problem, report: RunReport, loop: bool) -> BackendResult:
    batch = problem.batch
    assert batch is not None
    columns = _Columns(problem, report)
    rows_per_sample = problem.rows_per_sample
    if rows_per_sample == 0:
        return BackendResult(columns.blocks(), report)
    index = problem.sample_major_index
    batch_outputs, aux = batch_rows(problem)  # to check the samples run alone against
    chunk = 1 if loop else _rows_per_chunk(problem, problem.num_rows)
    chunks = list(_sample_chunks(batch.size, rows_per_sample, chunk))
    with Progress(problem.options.progress, len(chunks), "ntvp row chunks") as bar:
        for first, count, k_start, k_stop in chunks:
            vjps, sample_outputs = _sample_vjps(problem, batch.narrow(first, count), k_start,
                                                k_stop, loop)
            check_samples(problem, sample_outputs, torch.arange(first, first + count),
                          batch_outputs)
            columns.push(index[first:first + count, k_start:k_stop].reshape(-1), vjps)
            del vjps  # freed before the next chunk's exist
            bar.update()
    return BackendResult(columns.blocks(), report, symmetric=False, aux=aux,
                         rows=batch_outputs)


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


def _sample_vjps(problem: Problem, inputs: tuple[Tensor, ...], k_start: int, k_stop: int,
                 loop: bool) -> tuple[Tangents, Tensor]:
    """The vjps of rows ``k_start..k_stop-1`` of each sample in ``inputs``, and their rows.

    Returns the vjps (sample-major) and the samples' rows ``[count, K]``.
    """
    batch = problem.batch
    assert batch is not None

    def one_sample(*sample: Tensor) -> tuple[Tangents, Tensor]:  # batch dim kept
        rows, vjp_fn = functional.vjp(lambda *leaves: problem.sample_rows(leaves, sample),
                                      *problem.leaves)
        return row_vjps(vjp_fn, rows, k_start, k_stop), rows.detach()

    count = inputs[0].shape[batch.dims[0]]
    if count == 1:
        try:
            vjps, rows = one_sample(*inputs)
        except (BackendCannotRun, OutputChanged, NotPerSample):
            raise
        except Exception as error:
            if not loop:
                raise
            raise fails_alone(error) from error
        return vjps, rows.unsqueeze(0)

    def unsqueezed(*sample: Tensor) -> tuple[Tangents, Tensor]:
        return one_sample(*(x.unsqueeze(d) for x, d in zip(sample, batch.dims, strict=True)))

    per_sample, rows = torch.func.vmap(unsqueezed, in_dims=batch.dims)(*inputs)
    return tuple(t.flatten(0, 1) for t in per_sample), rows


# -- pushing forward -------------------------------------------------------------------------

# NOTE [non-finite pushes]
# Forward mode may give a non-finite derivative where the backward gives a finite one: at a
# kink the backward selects (``threshold_backward``, ``where``) and so drops the infinite
# derivative of a later ``sqrt`` or ``pow(·, 1/p)`` at 0, where forward mode multiplies the
# selected 0 by it: ``0 · inf = NaN``. ``F.lp_pool2d`` over a window of zeros after a ReLU,
# ``sqrt(clamp_min(d² - r², 0))`` for a point inside the radius, ``atan2`` at (0, 0): ntvp's
# G held NaN where the oracle's is finite (session 53's hunt of ``nn`` modules). Entry
# ``(i, j)`` of the oracle's G is finite wherever rows ``i`` and ``j`` of ``J`` are, and row
# ``i`` of ``J`` is the vjp ``Jᵀ e_i``: so a non-finite entry of ntvp's G between two finite
# vjps is forward mode's, and ntvp declines, naming the backends that can. (Under the
# caller's ``vmap`` the rows of the stored values are not those of G: there ntvp declines on
# any non-finite entry when every vjp is finite.) The check costs one host synchronisation
# per call where G is finite; where it is not, the vjps of the batch's rows are computed
# again to tell (a pass over every chunk's vjps cost more than ntvp's own pushes: 90 against
# 25 ms for the MLP 784-512-512-10 at B = 16).


class _Columns:
    """The ``[m, m]`` result(s), filled ``c`` rows at a time by pushing vjps forward.

    Row ``i`` is computed as ``J (Jᵀ e_i)``, column ``i`` by other rows' pushes: equal in
    exact arithmetic, not bitwise, so the result is marked not symmetric and the sink
    averages it with its transpose (factorizations downstream, Cholesky or ``eigh``, rely on
    exact symmetry). When ``G`` must be differentiable (NOTE [composition]) the pushed rows
    are kept and put in order at the end, out of place (``vmap`` refuses in-place writes of
    batched values into a fresh buffer).
    """

    def __init__(self, problem: Problem, report: RunReport) -> None:
        self.problem = problem
        self.report = report
        num_rows = problem.num_rows
        count = len(problem.leaves) if problem.per_leaf else 1
        self.dtype = problem.compute_dtype
        self._pieces: list[list[tuple[Tensor, Tensor]]] | None = None
        if problem.composition.differentiable:
            self._pieces = [[] for _ in range(count)]
            self._blocks = []
            return
        self._blocks = [torch.zeros(num_rows, num_rows, dtype=self.dtype,
                                    device=problem.output.device) for _ in range(count)]

    def push(self, rows: slice | Tensor, tangents: Tangents) -> None:
        """Store ``J v`` (``J_l v_l`` per leaf) at ``rows``, for the vjps ``v`` of ``rows``."""
        problem = self.problem
        leaves = problem.leaves
        self.report.row_chunks.append((tangents[0].shape[0], _bytes(tangents)))
        if not problem.per_leaf:
            self._store(0, rows, tangents, _push_forward(
                problem, lambda *ls: problem.rows(ls)[0], leaves, tangents))
            return
        for index, tangent in enumerate(tangents):
            if problem.mutates_leaves:  # every leaf an input: f writes into them (max_norm)
                alone = tuple(t if i == index else torch.zeros_like(t)
                              for i, t in enumerate(tangents))
                self._store(index, rows, (tangent,), _push_forward(
                    problem, lambda *ls: problem.rows(ls)[0], leaves, alone))
                continue

            def rows_of_leaf(leaf: Tensor, index: int = index) -> Tensor:
                return problem.rows(replace_leaves(leaves, (index,), (leaf,)))[0]

            self._store(index, rows, (tangent,),
                        _push_forward(problem, rows_of_leaf, (leaves[index],), (tangent,)))

    def _store(self, block: int, rows: slice | Tensor, tangents: Tangents, pushed: Tensor) -> None:
        self.report.pushes.append((tangents[0].shape[0], _bytes(tangents), _bytes((pushed,))))
        pushed = pushed.to(self.dtype)
        if self._pieces is None:
            self._blocks[block][rows] = pushed
            return
        if isinstance(rows, slice):
            rows = torch.arange(rows.start, rows.stop, device=pushed.device)
        self._pieces[block].append((rows, pushed))

    def blocks(self) -> tuple[Tensor, ...]:
        """The filled blocks (not yet symmetric); refuses forward mode's non-finite entries."""
        blocks = self._assembled()
        refuse_forward_mode_non_finite(blocks, self.problem)  # NOTE [non-finite pushes]
        return blocks

    def _assembled(self) -> tuple[Tensor, ...]:
        if self._pieces is None:
            return tuple(self._blocks)
        num_rows = self.problem.num_rows
        blocks = []
        for pieces in self._pieces:
            if not pieces:
                blocks.append(torch.zeros(num_rows, num_rows, dtype=self.dtype,
                                          device=self.problem.output.device))
                continue
            order = torch.cat([rows for rows, _ in pieces])
            blocks.append(torch.cat([pushed for _, pushed in pieces])[torch.argsort(order)])
        return tuple(blocks)


def refuse_forward_mode_non_finite(blocks: Sequence[Tensor], rows: Problem,
                                   columns: Problem | None = None) -> None:
    """Decline where forward mode made an entry of ``blocks`` non-finite.

    NOTE [non-finite pushes]. ``rows`` and ``columns`` (default: ``rows``) are the problems
    of the blocks' rows and columns. One host synchronisation where every entry is finite;
    the rows' vjps are computed again only where one is not.
    """
    non_finite = [~_torch_compat.innermost(block).isfinite() for block in blocks]
    if not bool(torch.stack([entries.any() for entries in non_finite]).any()):
        return
    per_leaf = len(blocks) > 1  # a block per leaf: its entries need that leaf's rows only
    finite_rows = _finite_vjps(rows, per_leaf=per_leaf)
    finite_columns = finite_rows if columns is None else _finite_vjps(columns,
                                                                      per_leaf=per_leaf)
    if finite_rows.dim() == 1:  # under vmap: whether every vjp is finite
        pairs = finite_rows & finite_columns
    else:
        pairs = finite_rows[:, :, None] & finite_columns[:, None, :]
    exact_rows = finite_rows.dim() == 2  # not under vmap: the oracle's non-finite entries
    # are known too, those of rows whose vjp is not finite; forward mode gave some of them
    # finite values (0 at a where(h > 0, sqrt(h), 0) whose h is 0, session 58's hunt)

    def wrong(k: int, entries: Tensor) -> Tensor:
        pair = pairs[k if per_leaf else 0]
        # non-finite between finite rows; with exact rows, also finite where a row is not
        return ((entries == pair) if exact_rows else (entries & pair)).any()

    if bool(torch.stack([wrong(k, entries) for k, entries in enumerate(non_finite)]).any()):
        raise BackendCannotRun(
            rows.api, "ntvp", "forward-mode derivatives that are finite where the "
            "backward's are (it pushes vjps forward with torch.func.jvp)",
            "non-finite entries of G between rows whose gradients are finite (or finite "
            "entries where a row's gradient is not): forward mode "
            "multiplied an infinite derivative by a zero that the backward selects (e.g. "
            "sqrt or pow(x, 1/p) at 0 after relu or clamp, lp_pool over zeros, atan2 at "
            "(0, 0))", _alternatives(rows),
            "Or keep those inputs away from 0 (add a small eps).")


def _finite_vjps(problem: Problem, *, per_leaf: bool = False) -> Tensor:
    """``[1, m]``: whether each row's vjp through the whole batch (a row of J) is finite.

    ``per_leaf``: ``[L, m]``, each leaf's part of it. A per-leaf block's entry is finite
    where that leaf's rows are, whatever the others' (a ``-inf`` activation of one sample
    makes the next layer's weight rows NaN, not the first layer's: ntvp's first-layer block
    held forward mode's NaN, session 58's hunt). Under the caller's ``vmap``, ``[1]`` or
    ``[L]``: whether all are (the stored rows are not G's).
    """
    batched = "vmap" in problem.composition.transforms
    num_rows = problem.num_rows
    rows, vjp_fn = functional.vjp(lambda *leaves: problem.rows(leaves)[0], *problem.leaves)
    chunk = _rows_per_chunk(problem, num_rows)
    finite = []
    for start in range(0, num_rows, chunk):
        values = [_torch_compat.innermost(vjp)
                  for vjp in row_vjps(vjp_fn, rows, start, min(start + chunk, num_rows))]
        if batched:
            finite.append(torch.stack([value.isfinite().all() for value in values]))
        else:
            finite.append(torch.stack([value.isfinite().reshape(value.shape[0], -1).all(1)
                                       for value in values]))  # [L, c]
    found = torch.stack(finite, -1).all(-1) if batched else torch.cat(finite, -1)
    return found if per_leaf else found.all(0, keepdim=True)


def _bytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _push_forward(problem: Problem, rows_fn: Callable[..., Tensor],
                  primals: Sequence[Tensor], tangents: Tangents) -> Tensor:
    """``[c, m]``: ``rows_fn``'s jvp at ``primals`` along each of the ``c`` tangents.

    A primal whose entries share memory (an expanded leaf: a stride 0 across a dim of
    several entries) is copied first: forward AD writes each tangent into a view of its
    primal and refuses one that overlaps itself; the copy has the same entries.
    """
    primals = tuple(primal.clone() if _overlaps_itself(primal) else primal
                    for primal in primals)

    def push(*tangent: Tensor) -> Tensor:
        return torch.func.jvp(rows_fn, primals, tangent)[1]

    def pushed() -> Tensor:
        # forward AD is process-wide: NOTE [threads]
        with FORWARD_AD_LOCK, forward_mode_pass(), _forward_mode(problem):
            if tangents[0].shape[0] == 1:
                return push(*(t[0] for t in tangents)).unsqueeze(0)
            return torch.func.vmap(push)(*tangents)

    return functional.with_grad(pushed)  # grad mode on: NOTE [no_grad in forward mode]


def _overlaps_itself(tensor: Tensor) -> bool:
    """Whether two entries of ``tensor`` may be one memory location.

    A stride 0 (``expand``), but also windows sharing entries (``unfold`` with a step below
    the window, a Toeplitz ``as_strided`` view): forward AD gives such a primal tangents that
    are wrong, silently (a basis tangent read as 0; ``ntvp``'s G 0.5-0.97 off, session 58).
    Sufficient test: sorted by stride, each dim must step over all the smaller ones; a layout
    that fails it without overlapping is only copied for nothing.

    Example:
        >>> _overlaps_itself(torch.zeros(3, 1).expand(3, 5)), _overlaps_itself(torch.zeros(3, 5).T)
        (True, False)
        >>> _overlaps_itself(torch.zeros(8).unfold(0, 4, 1)), _overlaps_itself(torch.zeros(8)[::2])
        (True, False)
    """
    extent = 1  # entries spanned by the smaller-stride dims so far
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape,
                                                      strict=True) if n > 1):
        if stride < extent:
            return True
        extent = stride * (size - 1) + extent
    return False


def _rows_per_chunk(problem: Problem, num_rows: int) -> int:
    width = sum(leaf.numel() for leaf in problem.leaves)
    return rows_per_chunk(problem.chunk_size, num_rows, width, problem.itemsize,
                          problem.memory_budget)


# -- forward-mode AD: setup and errors -------------------------------------------------------

# NOTE [first forward-AD call]
# The first forward-mode product in a process imports torch's jvp decompositions, which
# call torch.jit.script and, in torch >= 2.11, emit a DeprecationWarning that the user cannot
# act on (and that fails programs running with -W error). One tiny jvp at first use, with
# just that warning ignored, does the import once.

_forward_ad_ready = False


def _prepare_forward_ad(api: str = "torchgram") -> None:
    """Refuse a call in a forward-mode level (torch nests none); import jvp's decompositions.

    The level is process-wide: read under :data:`FORWARD_AD_LOCK`, which another thread's
    ntvp pass holds while its own level is open (NOTE [threads]).
    """
    with FORWARD_AD_LOCK:
        level_open = _torch_compat.forward_ad_level_open()
    if level_open:
        raise BackendCannotRun(
            api, "ntvp", "a call outside torch.autograd.forward_ad.dual_level() (it pushes "
            "vjps forward with torch.func.jvp, and torch nests no forward-mode levels)",
            "a call inside a dual level", _ALTERNATIVES,
            "Or call it outside the dual_level() block.")
    global _forward_ad_ready
    with FORWARD_AD_LOCK:  # once, and never beside another thread's warning filters
        if _forward_ad_ready:
            return
        _first_jvp()
        _forward_ad_ready = True


def _first_jvp() -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`?torch\.jit\.script`? is deprecated",
                                category=DeprecationWarning)
        torch.func.jvp(torch.sin, (torch.zeros(()),), (torch.zeros(()),))


# NOTE [missing forward AD]
# Some ops have no forward-mode derivative (torch 2.13: e.g. torch.cdist, embedding_bag,
# grid_sample, ctc_loss), nor does a custom autograd.Function without a jvp staticmethod.
# ntvp then raises BackendCannotRun naming the op and the reverse-mode backends that can
# (NOTE [declared inability]): it never falls back silently when chosen explicitly (the user
# picked ntvp for its memory bound, and the jacobian backend would hold m × P); auto moves on
# to its next candidate. The one exception is attention: the fused
# scaled_dot_product_attention kernels (flash, memory-efficient, cuDNN) have no forward AD,
# but its math implementation does and computes the same function. The forward-mode pass
# therefore runs with only the math kernel enabled (a process-wide setting, restored when the
# last thread using it leaves: NOTE [threads]); the reverse-mode pass keeps the user's kernels.

_ALTERNATIVES = ("jacobian", "graph")


def _alternatives(problem: Problem) -> tuple[str, ...]:
    """The backends that can run this call where ntvp declines: not graph inside transforms."""
    return ("jacobian",) if problem.composition.transforms else _ALTERNATIVES


def _dtype_mixing(problem: Problem) -> tuple[str, str] | None:
    """Where ``f`` mixes floating dtypes (autocast, or leaves of several), and the way out.

    Forward mode may then fail where the plain call ran (NOTE [missing forward AD]).
    """
    if torch.is_autocast_enabled(problem.output.device.type):
        return "under torch.autocast", "Or call it outside torch.autocast."
    dtypes = sorted({str(leaf.dtype) for leaf in problem.leaves})
    if len(dtypes) > 1:
        return (f"on parameters of several dtypes ({', '.join(dtypes)})",
                "Or give every parameter one dtype.")
    return None


@contextlib.contextmanager
def _forward_mode(problem: Problem) -> Iterator[None]:
    """Run forward-mode AD with attention's math kernel, the backward's derivatives at kinks.

    Where ``G`` may be differentiated or the caller's ``vmap`` batches the primals, ops whose
    forward-mode derivative torch gets wrong there are refused (NOTE [forward-mode
    derivatives torch gets wrong]).

    NOTE [kinks in forward mode], NOTE [no_grad in forward mode]; explains ops that lack
    forward AD (NOTE [missing forward AD]).
    """
    try:
        composed_forward = "jvp" in problem.composition.transforms
        stops = NoGradStopsTangents(refuse=composed_forward)
        kinks = ReverseKinks(refuse_ties=composed_forward)
        differentiated = problem.composition.may_be_differentiated
        batched = "vmap" in problem.composition.transforms
        faults = RefuseWrongTangents(differentiated=differentiated, batched=batched)
        with math_attention(), kinks, stops, faults:  # NOTE [no_grad in forward mode]
            yield
    except WrongForwardDerivative as err:
        if err.first_order:
            raise BackendCannotRun(
                problem.api, "ntvp", "an f without ops whose forward-mode derivative torch "
                "gets wrong (cholesky_inverse, logcumsumexp)", f"{err.call} in f",
                _alternatives(problem), "Or replace that operation.") from err
        if err.differentiated:
            situation = "when G is differentiated"
            ops = ("determinants, linear solves, householder_product, cholesky_inverse, cumprod "
                   "of a tensor holding zeros")
            fix = "Or compute G outside the differentiation."
        else:
            situation = "under torch.func.vmap"
            ops = "determinants, linear solves, lu_solve"
            fix = "Or loop over the batch instead of vmap."
        raise BackendCannotRun(
            problem.api, "ntvp", f"an f without ops whose forward-mode derivative torch gets "
            f"wrong {situation} ({ops})",
            f"{err.call} in f ({problem.composition.describe()})", _alternatives(problem),
            fix) from err
    except TieInForwardMode as err:
        raise BackendCannotRun(
            problem.api, "ntvp", "an f without ties at fmax or at clamp with a tensor bound "
            "when G is differentiated in forward mode (jvp, jacfwd): torch's forward mode takes "
            "another derivative there than its backward, and ntvp's pass cannot take the "
            "backward's for its own tangents alone",
            f"{err} with an input equal to its bound inside f "
            f"{problem.composition.describe()}", _alternatives(problem),
            "Or differentiate G in reverse mode (grad, vjp).") from err
    except GradOffInForwardMode as err:
        raise BackendCannotRun(
            problem.api, "ntvp", "an f without no_grad regions when G is differentiated in "
            "forward mode (jvp, jacfwd): its pass cannot stop its own tangents there alone",
            f"{err} called with grad mode off inside f {problem.composition.describe()}",
            _alternatives(problem), "Or write the stop-gradient as .detach().") from err
    except (NotImplementedError, RuntimeError) as err:
        missing = _torch_compat.missing_forward_ad(err)
        mixing = _dtype_mixing(problem)
        if missing is None and isinstance(err, RuntimeError) and mixing is not None:
            # f ran plainly (the probe); torch 2.13's forward mode with mixed dtypes does not
            # always: its tangents can take another dtype than their primals (under autocast,
            # a grouped conv after a batch norm: "Input type (torch.FloatTensor) and weight
            # type (CPUBFloat16Type) should be the same", session 26; a float32 LayerNorm
            # between bfloat16 layers: "expected m1 and m2 to have the same dtype", session 39)
            where, fix = mixing
            raise BackendCannotRun(
                problem.api, "ntvp", f"forward-mode AD that torch runs {where}",
                f"torch's error in forward mode {where}: {str(err).splitlines()[0]}",
                _ALTERNATIVES, fix) from err
        if missing is None and isinstance(err, RuntimeError) and \
                any(fault in str(err) for fault in _FORWARD_MODE_FAULTS):
            # torch's own forward-mode formula gives a tangent of another shape than its
            # primal (_weight_norm with a 0-d g: weight_norm(dim=None); session 58's hunt),
            # or views one its decomposition cannot (group_norm of a channels_last input,
            # where f ran plainly: session 60's hunt, also through auto's NTK plans)
            raise BackendCannotRun(
                problem.api, "ntvp", "forward-mode derivatives that torch computes for f's ops",
                f"torch's error in forward mode: {str(err).splitlines()[0].rstrip('.')}",
                _ALTERNATIVES,
                "") from err
        if missing is None:
            raise
        kind, name = missing
        if kind == "op":
            got = (f"an operation without a forward-mode derivative in torch "
                   f"{torch.__version__}: aten::{name}")
            fix = "Or replace that operation."
        else:
            got = (f"the custom autograd.Function {_functions_without_jvp(problem)} without a "
                   "jvp staticmethod")
            fix = ("Or give the Function a jvp staticmethod (see the PyTorch notes "
                   "'Extending torch.func with autograd.Function').")
        raise BackendCannotRun(
            problem.api, "ntvp", "every operation of f to support forward-mode AD "
            "(it pushes vjps forward with torch.func.jvp)", got, _ALTERNATIVES,
            fix) from err


_FORWARD_MODE_FAULTS = (
    "Trying to set a forward gradient that has a different size",
    "view size is not compatible with input tensor's size and stride",
)
"""torch's errors from its own forward-mode formulas, on calls ``f`` made plainly."""


def _functions_without_jvp(problem: Problem) -> str:
    """Names of the custom ``autograd.Function``s of ``f`` without a ``jvp`` (error path).

    One plain forward records ``f``'s graph; its custom Function nodes say their class.
    """
    leaves = tuple(leaf.detach().requires_grad_() for leaf in problem.leaves)
    with torch.enable_grad():
        rows, _ = problem.rows(leaves)
    names, seen, stack = set(), set(), [rows.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        cls = _torch_compat.custom_function_class(node)
        if cls is not None and getattr(cls, "jvp", None) is torch.autograd.Function.jvp:
            names.add(cls.__qualname__)
        stack.extend(child for child, _ in node.next_functions)
    return ", ".join(sorted(names)) or "(name not found)"
