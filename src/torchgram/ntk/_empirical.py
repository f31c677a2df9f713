"""``torchgram.ntk.empirical_ntk_fn``: neural-tangents' empirical NTK, on torchgram's backends.

# NOTE [kernel tiles]
A kernel between ``N1`` and ``N2`` samples is computed in tiles of samples when
``memory_budget`` is given (with per-sample structure; without it there is one tile): each
tile of ``x1`` is one side computed once (its factors or Jacobian blocks), paired with every
tile of ``x2`` (``x2=None``: the tiles after it, the blocks below the diagonal being their
mirror images; a diagonal batch axis pairs tile ``i`` with tile ``i`` only). The tile size
``t`` is the largest with ``2·t·s + t²·k ≤ memory_budget``, where ``k`` is the bytes of the
kernel per pair of samples and ``s`` an estimate of one sample's share of a side (its
factors and per-row Jacobians: the structured plan's memory, or ``R·P`` entries for the
Jacobian-based backends); the kernel being assembled is not counted. ``progress=True``
shows one step per tile pair.

A tile calls ``f`` on some of the samples, which is ``f`` as called only where samples do
not interact. So before tiling a side, ``f`` runs once on the whole batch (a call of a
coupling op, such as batch-norm with batch statistics or ``scale_grad_by_freq``, or a
random draw ends it there) and once per tile, and every tile's outputs must be the batch's
rows (NOTE [per-sample]); otherwise the side is one tile, over the budget, and
``last_run`` says why. A kernel of leaves that require grad is differentiable (NOTE
[composition]); inside ``torch.func`` transforms the tiles are joined out of place.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from torchgram._api.pipeline import outside_compile
from torchgram._core import _torch_compat, checks
from torchgram._core.checks import fail, function_name
from torchgram._core.cross import CrossProblem, PairSpec, mirror, row_shape
from torchgram._core.display import key_values_html, key_values_text
from torchgram._core.errors import NotPerSample, OutputChanged, output_changes_refused
from torchgram._core.functional import public_call
from torchgram._core.hooked_modules import hooked_attributes_put_back
from torchgram._core.options import Options
from torchgram._core.per_sample import check_tiles, fails_alone
from torchgram._core.problem import (
    Problem,
    build_problem,
    forget_probe,
    refuse_lazy_tensors,
    replace_input_leaves,
    without_inference_tensors,
)
from torchgram._core.progress import Progress
from torchgram._core.result import RunReport
from torchgram.ntk._layout import check_axes, make_spec, nt_shape, to_nt_layout

_API = "torchgram.ntk.empirical_ntk_fn"


@dataclass(frozen=True)
class VmapAxes:
    """neural-tangents' ``vmap_axes``, checked: where the samples are (or ``None``).

    Attributes:
        in_axes: The batch dimension of every tensor in ``x``.
        out_axes: The output dimension indexing samples (``batch_dim``).
        kwargs_axes: Batch dimensions of keyword arguments (others are shared).
    """

    in_axes: int | None
    out_axes: int
    kwargs_axes: Mapping[str, int | None] = field(default_factory=dict)

    @classmethod
    def parse(cls, api: str, vmap_axes: Any) -> VmapAxes | None:
        """``None``, an int (``in_axes = out_axes``), or ``(in_axes, out_axes, kwargs_axes)``."""
        if vmap_axes is None:
            return None
        if isinstance(vmap_axes, int) and not isinstance(vmap_axes, bool):
            return cls(vmap_axes, vmap_axes, {})
        if isinstance(vmap_axes, tuple | list) and len(vmap_axes) == 3:
            in_axes, out_axes, kwargs_axes = vmap_axes
            kwargs_axes = {} if kwargs_axes is None else kwargs_axes
            ok = ((in_axes is None or (isinstance(in_axes, int) and not isinstance(in_axes, bool)))
                  and isinstance(out_axes, int) and not isinstance(out_axes, bool)
                  and isinstance(kwargs_axes, dict)
                  and all(isinstance(k, str) and (v is None or (isinstance(v, int)
                                                                and not isinstance(v, bool)))
                          for k, v in kwargs_axes.items()))
            if ok:
                return cls(in_axes, out_axes, dict(kwargs_axes))
        fail(api, "vmap_axes to be None, an int, or a triple (in_axes, out_axes, kwargs_axes) "
             "of an int or None, an int and a dict {keyword: int or None}", repr(vmap_axes),
             "E.g. vmap_axes=0 (samples along dim 0 of x and of f's output), or None if "
             "the samples of a batch interact.", TypeError)


@dataclass
class KernelRun:
    """What one call of an ``ntk_fn`` did (``ntk_fn.last_run``).

    Attributes:
        shape: The kernel's shape (NT's layout).
        backends: The backend that answered each tile pair's call (``auto``'s choice).
        tiles: ``(tiles of x1, tiles of x2)`` (``x2=None``: of ``x1`` twice).
        blocks: Tile pairs computed.
        tile_size: Samples per tile (``None``: one tile per side).
        seconds: Wall time of the call.
        reports: The backends' reports (one per tile of ``x1``).
        notes: What the call itself noted (e.g. why it did not tile).
    """

    shape: tuple[int, ...]
    backends: tuple[str, ...]
    tiles: tuple[int, int]
    blocks: int
    tile_size: int | None
    seconds: float
    reports: list[RunReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def _rows(self) -> list[tuple[str, str]]:
        notes = [*self.notes,
                 *sorted({note for report in self.reports for note in report.notes})]
        attempts = sorted({f"{name}: {why}" for report in self.reports
                           for name, why in report.attempts})
        ways = self.reports[0].leaf_ways if self.reports else ()
        rows = [("kernel shape", str(list(self.shape))),
                ("backend", ", ".join(self.backends)),
                ("way", ", ".join(sorted({r.way for r in self.reports}))),
                ("tiles", f"{self.tiles[0]} × {self.tiles[1]} ({self.blocks} computed"
                 + (f", {self.tile_size} samples each)" if self.tile_size else ")")),
                ("time", f"{self.seconds:.3g} s")]
        if ways:
            rows.append(("leaf ways", ", ".join(f"{w}×{ways.count(w)}"
                                                 for w in dict.fromkeys(ways))))
        rows += [("gave up on", a) for a in attempts] + [("note", n) for n in notes]
        return rows

    def __repr__(self) -> str:
        return key_values_text("KernelRun", self._rows())

    def _repr_html_(self) -> str:
        return key_values_html("KernelRun", self._rows())


class EmpiricalNTK:
    """The function ``ntk_fn(x1, x2, params, **kwargs)`` of :func:`empirical_ntk_fn`.

    Call it like neural-tangents' ``ntk_fn``; ``repr`` (or a notebook) shows its settings,
    ``last_run`` what the last call did.
    """

    def __init__(self, f: Callable[..., Any], trace_axes: tuple[int, ...],
                 diagonal_axes: tuple[int, ...], vmap_axes: VmapAxes | None,
                 options: Options, progress: bool) -> None:
        self.f = f
        self.trace_axes = trace_axes
        self.diagonal_axes = diagonal_axes
        self.vmap_axes = vmap_axes
        self.options = options
        self.progress = progress
        self.last_run: KernelRun | None = None
        self.__doc__ = (f"Empirical NTK of {function_name(f)} (torchgram.ntk.empirical_ntk_fn):"
                        f" ntk_fn(x1, x2, params, **kwargs) with trace_axes={trace_axes}, "
                        f"diagonal_axes={diagonal_axes}.")

    # -- display ---------------------------------------------------------------------------

    def _rows(self) -> list[tuple[str, str]]:
        vmap = self.vmap_axes
        vmap_text = "None (no batch structure)" if vmap is None else \
            f"in {vmap.in_axes}, out {vmap.out_axes}" + (
                f", kwargs {dict(vmap.kwargs_axes)}" if vmap.kwargs_axes else "")
        options = self.options
        return [("f", function_name(self.f)),
                ("trace_axes", f"{self.trace_axes}" + (" (mean over each traced pair)"
                                                       if self.trace_axes else "")),
                ("diagonal_axes", str(self.diagonal_axes)),
                ("vmap_axes", vmap_text),
                ("backend", options.backend),
                ("chunk_size", str(options.chunk_size)),
                ("memory_budget", "None" if options.memory_budget is None
                 else f"{options.memory_budget:,} bytes"),
                ("progress", str(self.progress))]

    def __repr__(self) -> str:
        return key_values_text("EmpiricalNTK", self._rows())

    def _repr_html_(self) -> str:
        return key_values_html("EmpiricalNTK", self._rows())

    # -- the call --------------------------------------------------------------------------

    @outside_compile  # NOTE [torch.compile]: dynamo traced into the call (raw TypeError)
    @public_call  # NOTE [inference mode], NOTE [the caller's function modes]
    def __call__(self, x1: Any, x2: Any, params: Any, **kwargs: Any) -> Tensor:
        """The empirical NTK between ``x1`` and ``x2`` (``None``: ``x1``), NT's layout."""
        refuse_lazy_tensors(_API, (x1, x2, params, kwargs))  # NOTE [lazy modules]
        x1, x2, params, kwargs = without_inference_tensors((x1, x2, params, kwargs))
        arguments = (x1, x2, params, *kwargs.values())
        # NOTE [tensors hooks set], NOTE [generators f holds]
        with hooked_attributes_put_back(_API, self.f, arguments) as generators:
            try:
                return self._call(x1, x2, params, kwargs, generators, fresh=False)
            except OutputChanged:  # a cached probe went stale: probe afresh, once
                with output_changes_refused(_API):
                    return self._call(x1, x2, params, kwargs, generators, fresh=True)

    def _options(self, kwargs: Mapping[str, Any]) -> Options:
        vmap = self.vmap_axes
        if vmap is None:
            return self.options
        keywords = {name: vmap.kwargs_axes.get(name) for name in kwargs}
        unknown = sorted(set(vmap.kwargs_axes) - set(kwargs))
        if unknown:
            fail(_API, f"vmap_axes' kwargs_axes to name keyword arguments of the call "
                 f"({sorted(kwargs)})", f"kwargs_axes for {unknown}",
                 "Name only keywords the call passes.")
        return self.options.replace(in_dims=(vmap.in_axes, keywords))

    def _call(self, x1: Any, x2: Any, params: Any, kwargs: Mapping[str, Any],
              generators: tuple[Any, ...], *, fresh: bool) -> Tensor:
        start = time.perf_counter()
        kwargs1, kwargs2 = _split_kwargs(kwargs, x2 is None)
        options = self._options(kwargs1)
        left = build_problem(options, self.f, (params, x1), kwargs1, fresh=fresh,
                             generators=generators)
        _check_tensor_output(left)
        right = None if x2 is None else build_problem(options, self.f, (params, x2), kwargs2,
                                                      fresh=fresh, generators=generators)
        if right is not None:
            _check_tensor_output(right)
        shape1 = tuple(left.output.shapes[0])
        shape2 = shape1 if right is None else tuple(right.output.shapes[0])
        batch_axis = None if left.output.batch_dims is None else left.output.batch_dims[0]
        spec = make_spec(_API, self.trace_axes, self.diagonal_axes, shape1, shape2, batch_axis)
        tile = _tile_size(left, right, spec)
        tile_notes: list[str] = []
        tiles1 = _tiles(left, tile, fresh, tile_notes)
        tiles2 = tiles1 if right is None else _tiles(right, tile, fresh, tile_notes)
        if spec.batch_mode != "free" and len(tiles1) != len(tiles2):
            # a diagonal batch axis pairs tile i with tile i: both sides tiled, or neither
            tile_notes.append("one tile per side: the other side could not be tiled")
            tiles1, tiles2 = [left], [left if right is None else right]
        plan = _pairing(len(tiles1), len(tiles2), self_kernel=right is None,
                        diagonal=spec.batch_mode != "free")
        single = len(tiles1) == 1 and len(tiles2) == 1
        # inside torch.func transforms, tiles are joined out of place: no writes of batched
        # values into a fresh buffer (NOTE [composition])
        joined: dict[tuple[int, int], Tensor] | None = (
            {} if left.composition.transforms and not single else None)
        canonical = None if single or joined is not None else _canonical(left, right, spec)
        reports, backends = [], []
        total = sum(len(rights) for _, rights in plan)
        try:
            with Progress(self.progress, total, "kernel tiles") as bar:
                for i, rights in plan:
                    problem = CrossProblem(
                        tiles1[i], tuple(None if j is None else tiles2[j] for j in rights),
                        spec, on_block=bar.update)
                    result = _run(problem)
                    reports.append(result.report)
                    if result.report.backend not in backends:
                        backends.append(result.report.backend)
                    for j, block in zip(rights, result.blocks, strict=True):
                        if joined is not None:
                            joined[(i, i if j is None else j)] = block.to(left.compute_dtype)
                            continue
                        if canonical is None:
                            canonical = block
                            continue
                        _place(canonical, block, spec, tiles1, tiles2, i, i if j is None else j,
                               self_kernel=right is None)
        except OutputChanged:
            for side in (left, right, *tiles1, *tiles2):
                if side is not None:
                    forget_probe(side)
            left.draw.rewind()  # the call starts afresh, from its own random state
            raise
        if joined is not None:
            canonical = _join_tiles(joined, spec, len(tiles1), len(tiles2),
                                    self_kernel=right is None)
        assert canonical is not None
        kernel = to_nt_layout(canonical, spec, shape1, shape2).to(left.output.dtype)
        unseen = next((side for side in (left, right, *tiles1, *tiles2)
                       if side is not None and side.unseen_ops), None)
        if unseen is not None:  # NOTE [unseen calls]: the kernel's value, not its derivative
            from torchgram._api.pipeline import refused_derivatives

            kernel = refused_derivatives(unseen, [kernel])[0]
        self.last_run = KernelRun(nt_shape(spec, shape1, shape2), tuple(backends),
                                  (len(tiles1), len(tiles2)), total, tile,
                                  time.perf_counter() - start, reports, tile_notes)
        return kernel


def _run(problem: CrossProblem) -> Any:
    from torchgram._api.pipeline import compute_cross

    return compute_cross(problem)


def _split_kwargs(kwargs: Mapping[str, Any],
                  same: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """neural-tangents' rule: a pair ``(a, b)`` gives ``a`` to ``x1``'s call, ``b`` to ``x2``'s."""
    first, second = {}, {}
    for name, value in kwargs.items():
        if isinstance(value, tuple) and len(value) == 2:
            first[name], second[name] = value
        else:
            first[name] = second[name] = value
    return (first, first) if same else (first, second)


def _check_tensor_output(problem: Problem) -> None:
    if not problem.output.is_tensor:
        fail(_API, "f(params, x) to return one tensor", "a pytree of "
             f"{problem.output.treespec.num_leaves} tensors",
             "Return the output whose kernel you want (one ntk_fn per output).", TypeError)


def _side_bytes_per_sample(problem: Problem) -> float:
    """An estimate of one sample's share of a side's pieces (NOTE [kernel tiles])."""
    rows = problem.rows_per_sample
    numel = sum(leaf.numel() for leaf in problem.leaves)
    dense = float(rows * numel * problem.itemsize)
    if problem.options.backend not in ("auto", "structured") or problem.composition.transforms \
            or problem.differentiates is not None:  # nothing is traced inside torch.func
        return dense  # transforms (NOTE [composition]) or of an f differentiating itself
    from torchgram.backends.structured import plan_problem

    try:
        plan = plan_problem(problem, dead_positions=False)  # NOTE [dead positions]
    except NotPerSample:  # f fails on a batch of one (tracing runs one sample): no plan
        return dense
    return max(1.0, sum(p.memory for p in plan.leaves) / max(1, problem.samples))


def _tile_size(left: Problem, right: Problem | None, spec: PairSpec) -> int | None:
    """Samples per tile (NOTE [kernel tiles]); ``None``: one tile per side."""
    budget = left.memory_budget
    if budget is None or left.batch is None:
        return None
    samples = max(left.samples, right.samples if right is not None else 0)
    f1, d, _ = spec.row_groups(row_shape(left))
    f2, _, _ = spec.row_groups(row_shape(right or left))
    pair = f1 * f2 * d * left.itemsize
    per_sample = _side_bytes_per_sample(left)
    if spec.batch_mode == "free":  # 2 t s + t² k <= budget
        t = (-2 * per_sample + math.sqrt(4 * per_sample**2 + 4 * pair * budget)) / (2 * pair)
    else:
        t = budget / (2 * per_sample + pair)
    size = int(max(1, min(samples, t)))
    return None if size >= samples else size


def _tiles(problem: Problem, tile: int | None, fresh: bool,
           notes: list[str]) -> list[Problem]:
    """The problem cut into tiles of ``tile`` samples (itself when one tile).

    A tile is ``f`` called on some of the samples, which computes the same rows as the whole
    batch only where the samples do not interact: tiles are used only after their outputs
    were found equal to the batch's (NOTE [per-sample]); otherwise (samples that interact,
    random draws, ``f`` failing on a tile) the side is one tile, with a note in ``notes``.
    """
    batch = problem.batch
    if tile is None or batch is None or batch.size <= tile:
        return [problem]
    try:
        tiles = []
        for first in range(0, batch.size, tile):
            count = min(tile, batch.size - first)
            args, kwargs = replace_input_leaves(problem.args, problem.kwargs, batch.positions,
                                                batch.narrow(first, count))
            tiles.append(_tile_problem(problem, args, kwargs, fresh))
        check_tiles(problem, tiles)
    except NotPerSample as why:
        notes.append(f"one tile per side, over memory_budget: tiles of the batch would not "
                     f"compute f as called ({why.reason})")
        return [problem]
    except RuntimeError as error:  # NOTE [old-style autograd.Functions]
        refusal = _torch_compat.refused_under_transforms(error)
        if refusal is None:
            raise
        notes.append("one tile per side, over memory_budget: the check of the tiles' "
                     f"derivatives runs f under torch.func.vjp, which refuses {refusal.what}")
        return [problem]
    return tiles


def _tile_problem(problem: Problem, args: tuple[Any, ...], kwargs: dict[str, Any],
                  fresh: bool) -> Problem:
    """The call on one tile's inputs (probing ``f`` there); ``NotPerSample`` if ``f`` fails."""
    try:
        return build_problem(problem.options, problem.f, args, kwargs, fresh=fresh,
                             generators=problem.draw.generators)
    except (NotPerSample, OutputChanged):
        raise
    except Exception as error:  # noqa: BLE001 -- f fails on a tile (batch-norm of one ...)
        raise fails_alone(error) from error


def _pairing(n1: int, n2: int, *, self_kernel: bool,
             diagonal: bool) -> list[tuple[int, list[int | None]]]:
    """For each tile of ``x1``, the tiles of ``x2`` it meets (``None``: itself).

    Example:
        >>> _pairing(3, 3, self_kernel=True, diagonal=False)
        [(0, [None, 1, 2]), (1, [None, 2]), (2, [None])]
        >>> _pairing(2, 3, self_kernel=False, diagonal=False)
        [(0, [0, 1, 2]), (1, [0, 1, 2])]
    """
    if diagonal:
        return [(i, [None if self_kernel else i]) for i in range(n1)]
    if self_kernel:
        return [(i, [None, *range(i + 1, n1)]) for i in range(n1)]
    return [(i, list(range(n2))) for i in range(n1)]


def _canonical(left: Problem, right: Problem | None, spec: PairSpec) -> Tensor:
    """The zero canonical kernel ``[Bd, D, F1, N1, F2, N2]`` to fill."""
    f1, d, _ = spec.row_groups(row_shape(left))
    f2, _, _ = spec.row_groups(row_shape(right or left))
    n1, n2 = left.samples, (right or left).samples
    mode = spec.batch_mode
    shape = ((1, d, f1, n1, f2, n2) if mode == "free" else
             (n1 if mode == "diagonal" else 1, d, f1, 1, f2, 1))
    return torch.zeros(shape, dtype=left.compute_dtype, device=left.output.device)


def _place(canonical: Tensor, block: Tensor, spec: PairSpec, tiles1: Sequence[Problem],
           tiles2: Sequence[Problem], i: int, j: int, *, self_kernel: bool) -> None:
    """Write tile pair ``(i, j)``'s block (and its mirror image for a self kernel)."""
    block = block.to(canonical.dtype)
    start1 = sum(t.samples for t in tiles1[:i])
    start2 = sum(t.samples for t in tiles2[:j])
    mode = spec.batch_mode
    if mode == "trace":
        canonical.add_(block)
        return
    if mode == "diagonal":
        canonical[start1:start1 + block.shape[0]] = block
        return
    rows1, rows2 = slice(start1, start1 + block.shape[3]), slice(start2, start2 + block.shape[5])
    canonical[:, :, :, rows1, :, rows2] = block
    if self_kernel and i != j:
        canonical[:, :, :, rows2, :, rows1] = mirror(block)


def _join_tiles(blocks: dict[tuple[int, int], Tensor], spec: PairSpec, n1: int, n2: int, *,
                self_kernel: bool) -> Tensor:
    """The canonical kernel from the blocks of tile pairs ``(i, j)``, out of place.

    What :func:`_place` writes into a buffer, joined with ``cat`` and ``+`` instead (a self
    kernel's missing pairs are the mirror images of the pairs computed).
    """
    mode = spec.batch_mode
    if mode == "trace":
        total = None
        for block in blocks.values():
            total = block if total is None else total + block
        assert total is not None
        return total
    if mode == "diagonal":
        return torch.cat([blocks[(i, i)] for i in range(n1)], dim=0)

    def pair(i: int, j: int) -> Tensor:
        block = blocks.get((i, j))
        if block is None and self_kernel:
            return mirror(blocks[(j, i)])
        assert block is not None
        return block

    columns = n1 if self_kernel else n2
    return torch.cat([torch.cat([pair(i, j) for j in range(columns)], dim=5)
                      for i in range(n1)], dim=3)


def empirical_ntk_fn(
    f: Callable[..., Any],
    *,
    trace_axes: int | Sequence[int] = (-1,),
    diagonal_axes: int | Sequence[int] = (),
    vmap_axes: Any = 0,
    backend: str = "auto",
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    progress: bool = False,
) -> EmpiricalNTK:
    """neural-tangents' ``empirical_ntk_fn``: the empirical NTK of ``f(params, x)``.

    Returns ``ntk_fn(x1, x2, params, **kwargs)`` computing
    ``Θ(x1, x2) = ∂f(params, x1)/∂params · ∂f(params, x2)/∂paramsᵀ`` with neural-tangents'
    semantics, shapes and values (NOTE [NT layout]): ``x2=None`` means ``x1``; the kernel of
    outputs ``[N1, K]`` and ``[N2, K]`` is ``[N1, N2, K, K]`` (pairs of axes side by side);
    each axis in ``trace_axes`` is contracted and **averaged** (NT divides by the axis size:
    ``trace_axes=(-1,)`` gives ``[N1, N2]`` with ``(1/K) Σ_k``); each axis in
    ``diagonal_axes`` keeps only its diagonal and appears once (``(0,)`` with ``x2=None``:
    ``[N1, K, K]``, one block per sample). The kernel between two input sets is computed
    from both sides' pieces (NOTE [cross kernels]), and only the pairs kept are formed (a
    traced logit axis costs ``K`` times less); only the graph walk, which ``auto`` takes for
    an ``f`` that differentiates itself, joins both sets into one batch (checked to compute
    each set's rows).

    Args:
        f: ``f(params, x, **kwargs)`` returning one tensor. ``params`` is any pytree; every
            floating tensor leaf is differentiated (``tg.functionalize(model)`` gives one).
        trace_axes: Output axes whose pairs are averaged away (NT's default ``(-1,)``).
        diagonal_axes: Output axes whose pairs keep only ``i == j``. An axis cannot be in
            both; a traced or diagonal axis must have the same size for ``x1`` and ``x2``.
        vmap_axes: ``0`` (default): output dim 0 indexes samples, each depending on sample
            ``i`` of ``x`` only (dim 0 of every tensor in ``x``), like ``tg.gramian(...,
            batch_dim=0)``; an int ``d`` for dim ``d`` of both; ``(in_axes, out_axes,
            kwargs_axes)`` as in neural-tangents (keyword arguments not named in
            ``kwargs_axes`` are shared); ``None``: no batch structure. The promise is checked
            (NOTE [per-sample]): where samples interact, the kernel is that of ``f`` as
            called (what ``None`` gives), never a wrong one.
        backend: ``"auto"`` or a ``tg.gramian`` backend (``"graph"`` computes a kernel
            between two input sets from both joined into one batch, with a batch axis only).
        chunk_size: Rows per vectorized pass, as for ``tg.gramian``.
        memory_budget: Bytes: bounds the tiles the kernel is computed in (NOTE [kernel
            tiles]) and is passed to the backend.
        progress: Show a ``tqdm`` bar over the tiles (when there are several).

    Returns:
        An :class:`EmpiricalNTK`: ``ntk_fn(x1, x2, params, **kwargs)`` returns the kernel
        in ``f``'s output dtype. A keyword argument given as a pair ``(a, b)`` passes ``a``
        to ``f(params, x1)`` and ``b`` to ``f(params, x2)``, as in neural-tangents.

    Raises:
        TypeError, ValueError: Bad configuration when built; bad axes, inputs or outputs
            when called (an axis both traced and diagonal, a diagonal batch axis with
            ``N1 != N2``...), before any Jacobian work.

    Example:
        >>> import torch, torchgram as tg
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 4))
        >>> fn, params = tg.functionalize(model)
        >>> x1, x2 = torch.randn(5, 3), torch.randn(2, 3)
        >>> ntk_fn = tg.ntk.empirical_ntk_fn(fn)                 # trace_axes=(-1,)
        >>> ntk_fn(x1, x2, params).shape                         # [N1, N2]
        torch.Size([5, 2])
        >>> full = tg.ntk.empirical_ntk_fn(fn, trace_axes=())
        >>> full(x1, None, params).shape                         # [N1, N1, K, K]
        torch.Size([5, 5, 4, 4])
        >>> per_sample = tg.ntk.empirical_ntk_fn(fn, trace_axes=(), diagonal_axes=(0,))
        >>> per_sample(x1, None, params).shape                   # [N1, K, K]
        torch.Size([5, 4, 4])
        >>> torch.allclose(ntk_fn(x1, x2, params), full(x1, x2, params).diagonal(
        ...     dim1=2, dim2=3).mean(-1), atol=1e-6)
        True
    """
    trace = check_axes(_API, "trace_axes", trace_axes)
    diagonal = check_axes(_API, "diagonal_axes", diagonal_axes)
    both = sorted(set(trace) & set(diagonal))
    if both:
        fail(_API, "trace_axes and diagonal_axes to name different axes",
             f"axis {both[0]} in both", "A traced axis keeps only its diagonal already (and "
             "averages it): drop it from diagonal_axes, or from trace_axes to keep the "
             "diagonal entries apart. (neural-tangents' default implementation rejects this "
             "too.)")
    vmap = VmapAxes.parse(_API, vmap_axes)
    checks.check_bool(_API, "progress", progress)
    options = Options.validate(
        _API, f, 0, backend=backend, chunk_size=chunk_size,
        batch_dim=None if vmap is None else vmap.out_axes,
        in_dims=0 if vmap is None else (vmap.in_axes, {}), memory_budget=memory_budget)
    return EmpiricalNTK(f, trace, diagonal, vmap, options, progress)


__all__ = ["EmpiricalNTK", "KernelRun", "VmapAxes", "empirical_ntk_fn"]

