"""When evaluating ``f`` one sample at a time gives its Gramian, and how that is checked.

# NOTE [per-sample]
``batch_dim`` promises that output row ``(b, k)`` depends on sample ``b`` only. Backends use
it two ways (DESIGN.md §3):

* by **evaluating f per sample** (a batch of one, under ``vmap`` or in a loop): the jacobian
  and ntvp backends, and the structured backend for leaves no rule covers. This is only the
  Gramian of ``f`` as called if ``f`` on sample ``b`` alone computes what ``f`` on the batch
  computes for sample ``b``. It is not when samples interact (batch-norm in training mode,
  ``x - x.mean(0)``, in-batch contrastive losses), when ``f`` draws random numbers (dropout:
  a batch of one sees other draws), or when ``f`` fails on a batch of one (batch-norm of one
  value per channel). So every per-sample way **checks** it, on every call: it compares the
  per-sample outputs with one evaluation of the whole batch (:func:`check_samples`), and
  a per-sample evaluation that draws random numbers, or fails where the batch did not,
  raises :class:`NotPerSample`;
* by **running f on the whole batch** with plain autograd and reading per-sample pieces
  from it (the structured backend's batched pass): random draws are then those of one
  plain call, but samples must still not interact; known interacting ops (batch-norm in
  training mode, ``scale_grad_by_freq`` embeddings) are recognised by name and the outputs
  of samples run alone are compared with the batch's (:func:`check_samples` again), with
  the derivative check below and where the run rewrote a call: NOTE [when the values are
  compared]).

A backend whose per-sample way does not hold computes the **same matrix from the whole
batch** (its rows without batch structure): for interacting samples that is the exact
coupled Gramian of ``f`` as called (what ``batch_dim=None`` returns), never a wrong matrix.
``tg.explain(..., run=True)`` reports it. The comparison tolerates the round-off of running
a batch of one instead of the batch (:func:`tolerance`: 1e-5 relative in float32, where the
real models of the benchmarks differ by 5e-8 at most). It is a check of values, so an
interaction whose effect on the checked outputs happens to fall within it passes while its
effect on the Jacobian need not be small: ``x - x.mean(0)`` of a width-1 ``h`` whose mean over
samples ``0`` and ``B - 1`` matched the batch's to 9e-5 passed at the former 1e-4 and gave
``G`` 2e-3 off (update hunt 3). Such a ``batch_dim`` is the caller's broken promise; the check
makes its acceptance a coincidence of measure about the tolerance, not a guarantee.

Values can also agree exactly while the Jacobians do not: samples that are the same where
they meet (``h = x·w`` equal for every sample, one token each with the same id) give the same
``h - h.mean(0)`` alone and in the batch, while its derivative in ``w`` is ``x_b - mean(x)``
in the batch and zero alone (kernel hunt 2: jacobian and ntvp 0.5 off, relative). So the
evaluation of the whole batch that the per-sample ways compare with is also a **derivative
check** (:func:`check_derivatives`), on every call, of that call's values (NOTE [the
derivative check on every call]): one vector-Jacobian product of the batch's rows, with
random positive weights on all rows, must equal the sum of the same products of each sample
run alone (one ``vmap`` over the samples; where ``vmap`` cannot run ``f``, each of
:func:`separating_groups`' groups runs apart instead). The structured backend's batched pass
has its own (NOTE [checking the batched pass]).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch import Tensor

from torchgram._core import _torch_compat, functional
from torchgram._core.census import OpCensus, again_with_graph, may_need_a_graph
from torchgram._core.errors import BackendCannotRun, NotPerSample, OutputChanged
from torchgram._core.problem import Problem, replace_input_leaves
from torchgram._core.pytree import detach_tree
from torchgram._core.vmap_failures import failure_key, remember, remembered


def tolerance(dtype: torch.dtype) -> float:
    """Relative difference allowed between a sample run alone and the same sample in a batch.

    Example:
        >>> tolerance(torch.float32), tolerance(torch.float64)
        (1e-05, 1e-09)
    """
    bits = torch.finfo(dtype).bits
    return 1e-9 if bits > 32 else 1e-5 if bits == 32 else 1e-4  # 16 bits: as before


def working_tolerance(problem: Problem) -> float:
    """:func:`tolerance` of the least precise of ``f``'s output, parameters and batched inputs.

    A float64 output of a float32 model (``cross_entropy(logits.double(), y)``) carries the
    model's float32 round-off: compared at float64's tolerance, a sample alone differed from
    the batch by float32 round-off and the samples were said to interact (the data-parallel
    Gramian refused; a helper's hunt, session 57).
    """
    dtypes = [problem.output.dtype, *(leaf.dtype for leaf in problem.leaves)]
    if problem.batch is not None:
        dtypes += [t.dtype for t in problem.batch.tensors if t.is_floating_point()]
    return max(tolerance(dtype) for dtype in dtypes if dtype.is_floating_point)


def batch_rows(problem: Problem, *, eager: bool = False) -> tuple[Tensor, Any]:
    """``f``'s output rows ``[m]`` on the whole batch (output order) and aux.

    Without gradients, unless ``G`` is differentiable (its aux then is too).

    Raises :class:`NotPerSample` if that evaluation drew random numbers or called an op that
    makes samples interact, and inside ``torch.func.vmap``, where the comparison with samples
    run alone (:func:`check_samples`) is data-dependent control flow, which ``vmap`` refuses
    (NOTE [composition]). ``eager``: the derivative check by plain autograd
    (:func:`compare_pullbacks`).
    """
    if "vmap" in problem.composition.transforms:
        raise NotPerSample("inside torch.func.vmap, samples run alone cannot be compared with "
                           "the batch (data-dependent)")
    keep_graph = problem.composition.differentiable and torch.is_grad_enabled()  # for aux
    with_graph = problem.differentiates is not None and not keep_graph
    census = OpCensus()
    try:
        rows, aux = _rows_under(census, problem, keep_graph, with_graph=with_graph)
    except Exception as error:  # NOTE [gradient hooks inside f]: on a tensor requiring grad
        if keep_graph or with_graph or not may_need_a_graph(error):
            raise
        saw_graph_calls = census.needs_graph > 0
        census = OpCensus()
        rows, aux = again_with_graph(error, saw_graph_calls, lambda: _rows_under(
            census, problem, keep_graph, with_graph=True))
    if problem.draw.random:
        raise NotPerSample("f draws random numbers (dropout, ...): one sample at a time it "
                           "would see other draws than the batch's", random=True)
    if census.coupling:
        raise NotPerSample(f"f calls {census.coupling[0]}: its samples interact")
    check_derivatives(problem, eager=eager)
    return rows, aux


def _rows_under(census: OpCensus, problem: Problem, keep_graph: bool, *,
                with_graph: bool) -> tuple[Tensor, Any]:
    """``problem.rows`` on the batch under ``census``; ``with_graph``: in leaves requiring grad.

    ``keep_graph``: the rows are differentiated (:func:`batch_rows`), with their graph.

    An evaluation with a graph is for an ``f`` that needs one without being differentiated:
    its own backward (NOTE [f that differentiates itself]), gradient hooks on its tensors
    (NOTE [gradient hooks inside f]); its rows and aux are returned detached.
    """
    leaves = problem.leaves
    if with_graph:
        leaves = tuple(leaf.detach().requires_grad_() for leaf in leaves)
    with torch.set_grad_enabled(keep_graph or with_graph), census:
        rows, aux = problem.rows(leaves)
    if with_graph:
        return rows.detach(), detach_tree(aux)
    return rows, aux


def separating_groups(samples: int) -> tuple[tuple[int, ...], ...]:
    """Groups of samples such that for any two samples ``b ≠ c`` one group has ``b``, not ``c``.

    Sample ``b`` belongs to the groups of ``code(b)``, the ``b``-th ``⌊n/2⌋``-subset of
    ``range(n)``, ``n`` the smallest with enough subsets (equal-size subsets never contain
    one another): 2 groups for 2 samples, 3 for 3, 4 for 4 to 6, 8 for 64, 13 for 1024. A
    check that the cotangent of each group's rows vanishes outside the group sees any
    cotangent moving between samples, where even- and odd-numbered groups miss those that
    stay within one (session 28). The even- and odd-numbered samples are :func:`even_odd`.

    Example:
        >>> separating_groups(5)
        ((0, 1, 2), (0, 3, 4), (1, 3), (2, 4))
        >>> len(separating_groups(64)), len(separating_groups(1024))
        (8, 13)
    """
    if samples <= 1:
        return ()
    count = max(2, math.ceil(math.log2(samples)))
    while math.comb(count, count // 2) < samples:
        count += 1
    codes = list(itertools.islice(itertools.combinations(range(count), count // 2), samples))
    return tuple(tuple(b for b, code in enumerate(codes) if group in code)
                 for group in range(count))


def even_odd(samples: int) -> tuple[tuple[int, ...], ...]:
    """The even- and the odd-numbered samples (``()`` for one sample).

    Example:
        >>> even_odd(5)
        ((0, 2, 4), (1, 3))
    """
    if samples <= 1:
        return ()
    return tuple(range(0, samples, 2)), tuple(range(1, samples, 2))


def check_derivatives(problem: Problem, *, eager: bool = False) -> None:
    """Raise :class:`NotPerSample` unless samples run alone have the batch's derivatives.

    On every call, for this call's values (NOTE [the derivative check on every call]): the
    vector-Jacobian product of the batch's rows with random positive weights on all of them
    must equal the sum over samples of each sample's own product with the same weights, the
    samples run alone under one ``vmap`` (:func:`_samples_alone`), through
    :func:`compare_pullbacks`. Where ``vmap`` cannot run ``f`` (or the call's vjps run one at
    a time: ``chunk_size=1``, NOTE [wrong batching rules]) each of :func:`separating_groups`'
    groups runs apart instead (:func:`_compare_group`). Either way a coupling among middle
    samples that their values do not show (``h + m·Σ_c m_c (h_c - h_c.detach())`` on samples
    1 and 2) is seen: jacobian 0.52 and ntvp 0.32 off before session 28, and again on a later
    call of the signature (its first call with ``m = 0``: 0.50 and 0.25 off) while only the
    signature's first call was thorough.
    """
    batch = problem.batch
    if batch is None or batch.size < 2 or not problem.leaves:
        return
    index = problem.sample_major_index  # [B, K]: each sample's rows in the output order
    key = failure_key(problem, "the derivative check", True)  # NOTE [vmap failures remembered]
    failure = None
    if not problem.loops_only and remembered(key) is None:
        weights = positive_weights(tuple(index.shape), index.device, problem.output.dtype)
        try:
            compare_pullbacks(problem, _on_rows(index.numel(), index, weights),
                              [(lambda *values: _samples_alone(problem, values), weights)],
                              "the samples run alone", eager=eager)
            return
        except (NotPerSample, OutputChanged, BackendCannotRun):
            raise
        except Exception as error:  # noqa: BLE001 -- NOTE [vmap or loop]: the groups need no
            failure = error  # vmap
    for group in separating_groups(batch.size):
        _compare_group(problem, index, list(group), [list(group)], eager)
    if failure is not None:  # the groups ran: the failure was vmap's
        remember(key, failure)


def _samples_alone(problem: Problem, leaves: tuple[Tensor, ...]) -> Tensor:
    """Each sample's rows ``[B, K]``, ``f`` on it alone (a batch of one), under one ``vmap``.

    The evaluation the per-sample ways of the jacobian and ntvp backends make (there with
    the rows' vjps inside).
    """
    batch = problem.batch
    assert batch is not None
    count = len(leaves)

    def one_sample(*values: Tensor) -> Tensor:
        sample = tuple(x.unsqueeze(d) for x, d in zip(values[count:], batch.dims, strict=True))
        return problem.sample_rows(values[:count], sample)

    return torch.func.vmap(one_sample, in_dims=(None,) * count + batch.dims)(*leaves,
                                                                            *batch.tensors)


# NOTE [the derivative check on every call]
# The check compares the batch's derivatives with those of the samples run alone for the
# values of the call it runs in, so it runs on every call. It ran thoroughly only on a call
# signature's first call, and later calls ran apart only samples 0 and B - 1: a coupling of
# middle samples that depends on the values (flags in an input, a global list f reads, a
# Python attribute of a model switched between calls) and was absent on the first call was
# missed, and jacobian and ntvp returned a wrong matrix, their kernels and aggregated_grad
# too (0.50 and 0.25 off, relative; a helper's hunt after session 50). Running the separating
# groups on every call would cost a third more per call on jacobian and ntvp (benchmarks'
# mlp, B = 64, one thread: 8 groups of 32, each a backward of the batch and one of the
# group; +30% to +41% over no check, two runs) and 2.6 times as much on jacobian for the
# cnn (+216%); the check is now one comparison for the whole batch:
#
#   D(w) = J_batchᵀ w − Σ_b J_bᵀ w_b,
#
# J_batch the Jacobian of the batch's rows, J_b that of sample b's rows with b run alone,
# w the weights of all rows. D is linear in w, and the zero map exactly when every sample
# alone has the batch's derivatives of its rows (D(e_(b,k)) is the difference of row (b, k)'s
# two gradients), which makes the per-sample Gramian G. Otherwise the w with D(w) = 0 form a
# proper subspace, of measure zero, which the weights (a fixed draw from [0.5, 1.5), as the
# groups' are) miss unless f is built around that draw. Each sample runs alone (a batch of
# one under vmap, what the per-sample ways evaluate), so no coupling can hide inside a part
# run together, which is what made parts of the batch need separating groups. The cost is a
# vmapped evaluation of the B samples and one backward, beside the batch's backward: +4% to
# +8% over no check on that mlp, about what the two samples apart cost (+3% to +6%), and
# +38% on the cnn's jacobian (+22%; ntvp +2%, against +3%). Where vmap cannot run f, or the
# call's vjps run one at a time (chunk_size=1, NOTE [wrong batching rules]), the separating
# groups run apart (complete too, without vmap), on every call: that costs more there (a
# review, an MLP whose f branches on .item(), one thread, loaded machine: jacobian 36-42 ->
# 55-59 ms, ntvp 113-131 -> 152-159 ms; with chunk_size=1, 49 -> 56 and 122 -> 135 ms), the
# price of checking this call's values on the paths that are slow already. An output of
# another structure for a sample alone raises OutputChanged, as the per-sample ways' own
# evaluation does: the call is probed afresh, and the probe (a batch of one) reports it, as
# on a first call.


def _on_rows(count: int, rows: Tensor, weights: Tensor) -> Tensor:
    """``[count]`` weights: ``weights`` at the rows ``rows`` (same shape) names, else zero."""
    spread = torch.zeros(count, dtype=weights.dtype, device=weights.device)
    spread[rows.reshape(-1)] = weights.reshape(-1)
    return spread


def _compare_group(problem: Problem, index: Tensor, samples: list[int],
                   subsets: list[list[int]], eager: bool = False) -> None:
    """:func:`compare_pullbacks` of ``samples``' rows, run apart as ``subsets``."""
    weights = positive_weights((len(samples), index.shape[1]), index.device,
                               problem.output.dtype)
    compare_pullbacks(problem, _on_rows(index.numel(), index[samples], weights), [
        (lambda *values, subset=subset: subset_rows(problem, subset, values),
         weights[[samples.index(sample) for sample in subset]])
        for subset in subsets], f"samples {samples} run apart", eager=eager)


def positive_weights(shape: tuple[int, ...], device: torch.device,
                     dtype: torch.dtype) -> Tensor:
    """Random weights in ``[0.5, 1.5)`` for :func:`compare_pullbacks`.

    From a generator of their own: ``f``'s draws are left alone.
    """
    generator = torch.Generator(device=device).manual_seed(0)
    return (0.5 + torch.rand(shape, generator=generator, dtype=torch.float64,
                             device=device)).to(dtype)


def compare_pullbacks(problem: Problem, weights: Tensor,
                      parts: Sequence[tuple[Callable[..., Tensor], Tensor]], what: str, *,
                      eager: bool = False) -> None:
    """Raise :class:`NotPerSample` unless the batch's rows and the parts' have one derivative.

    The vector-Jacobian product of the batch's rows ``[m]`` with ``weights [m]`` must equal
    the sum over the parts of the product of each part's rows (``rows(*leaves)``) with its
    weights, within :func:`tolerance` relative to the largest entry of the products.
    The products are ``torch.func.vjp``'s, which composes with the transforms a call may run
    under (NOTE [composition]) and refuses what they refuse (which the per-sample ways rely
    on: their own ``vmap`` would); with ``eager``, outside transforms, plain autograd's, which
    runs any ``f`` torch's backward runs (the graph walk's check). With grad mode on (NOTE
    [backward under no_grad]); at most two gradients are held at once. ``what`` names the
    parts in the message.
    """
    leaves = problem.leaves
    # an f assigning its module's .data crashes torch under vjp (NOTE [data assigned to itself])
    eager = (eager or problem.assigns_data) and not problem.composition.transforms

    def pullback(rows: Callable[..., Tensor], row_weights: Tensor) -> list[Tensor]:
        if not eager:
            _, pull = functional.vjp(rows, *leaves)
            return list(pull(row_weights))
        # plain autograd: it also runs the f that torch.func refuses (old-style
        # autograd.Functions, requires_grad_() inside f, f differentiating itself)
        values = tuple(leaf.detach().requires_grad_() for leaf in leaves)
        out = rows(*values)
        grads = torch.autograd.grad(out, values, row_weights, allow_unused=True) \
            if out.requires_grad else (None,) * len(values)  # f constant in its leaves
        return [torch.zeros_like(value) if grad is None else grad
                for value, grad in zip(values, grads, strict=True)]

    def compare() -> bool:
        # the batch's products less the parts' own
        difference = pullback(lambda *values: problem.rows(values)[0], weights)
        scale = [_largest(grad) for grad in difference]
        for rows, part_weights in parts:
            for k, grad in enumerate(pullback(rows, part_weights)):
                scale[k] = torch.maximum(scale[k], _largest(grad))
                difference[k] = difference[k] - grad
        rtol = working_tolerance(problem)
        overall = max((float(largest) for largest in scale), default=0.0)
        return all(bool((gap.detach().abs() <= rtol * largest + _round_off(gap, overall)).all())
                   for gap, largest in zip(difference, scale, strict=True))

    if not functional.with_grad(compare):
        raise NotPerSample(f"{what} have other derivatives than in the batch: the samples "
                           "interact (e.g. x - x.mean(0))")


# NOTE [leaves without a gradient]
# compare_pullbacks allows each leaf a gap relative to that leaf's largest product. A leaf
# whose derivative is zero in exact arithmetic has products that are round-off alone -- an
# attention's key bias (a constant added to every score of a query, which the softmax
# removes) -- and two round-offs differ by as much as they are large: BERT's key biases in
# float64, 1.6e-22 apart on a scale of 1.4e-21 (float32: 3e-13 on 9e-13), where the other
# leaves' products reach 0.04. The check then took every such model for one whose samples
# interact: the per-sample ways of jacobian, ntvp and graph fell back to the whole batch
# (exact, slower), and a kernel between two input sets on graph was declined naming a coupling
# that is not there (session 49). Each leaf's gap may now also reach ROUND_OFF_UNITS units of
# round-off of the largest product of any leaf (4 eps: 5e-7 in float32, against the 1e-5
# relative tolerance; a coupling confined to a leaf whose products are that small moves the
# Gramian by less than round-off).
ROUND_OFF_UNITS = 4.0


def _round_off(gap: Tensor, overall: float) -> float:
    """``ROUND_OFF_UNITS`` units of round-off of ``overall`` in ``gap``'s dtype."""
    return ROUND_OFF_UNITS * torch.finfo(gap.dtype).eps * overall if gap.is_floating_point() \
        else 0.0


def _largest(grad: Tensor) -> Tensor:
    """``max |grad|``, zero for a gradient without entries (a zero-size leaf's).

    Example:
        >>> _largest(torch.tensor([1.0, -3.0])), _largest(torch.zeros(0, 3))
        (tensor(3.), tensor(0.))
    """
    grad = grad.detach()
    return grad.abs().amax() if grad.numel() else grad.new_zeros(())


def subset_rows(problem: Problem, samples: list[int],
                leaves: tuple[Tensor, ...] | None = None) -> Tensor:
    """``f`` on the batch restricted to ``samples`` (in that order): their rows ``[n, K]``.

    ``leaves``: in place of the call's differentiated leaves. Raises :class:`NotPerSample`
    when the output's structure is not the batch's with ``n`` samples (then ``f`` does not
    treat a smaller batch like the whole one).
    """
    batch = problem.batch
    assert batch is not None
    index = torch.tensor(samples, device=batch.tensors[0].device)
    inputs = tuple(t.index_select(d, index.to(t.device))
                   for t, d in zip(batch.tensors, batch.dims, strict=True))
    args, kwargs = replace_input_leaves(problem.args, problem.kwargs, batch.positions, inputs)
    try:
        out, _ = problem.call(problem.leaves if leaves is None else leaves, args, kwargs,
                              full=False)
    except (NotPerSample, OutputChanged, BackendCannotRun):
        raise
    except Exception as error:  # f fails on part of the batch (a hard-coded batch size ...)
        if _torch_compat.refused_under_transforms(error) is not None:
            raise  # the backend's to translate (NOTE [old-style autograd.Functions])
        raise fails_alone(error) from error
    out_leaves, treespec = optree.tree_flatten(out)
    spec, count, batch_dims = problem.output, len(samples), problem.output.batch_dims
    assert batch_dims is not None
    expected = [torch.Size((*shape[:d], count, *shape[d + 1:]))
                for shape, d in zip(spec.shapes, batch_dims, strict=True)]
    if treespec != spec.treespec or [getattr(leaf, "shape", None) for leaf in out_leaves] \
            != expected:
        raise NotPerSample(f"f on {count} of the samples returns an output of another "
                           "structure than on the batch")
    return torch.cat([leaf.movedim(d, 0).reshape(count, -1).to(spec.dtype)
                      for leaf, d in zip(out_leaves, batch_dims, strict=True)], dim=1)


def check_tiles(problem: Problem, tiles: Sequence[Problem], *, eager: bool = False) -> None:
    """Raise :class:`NotPerSample` unless the tiles' outputs are the batch's rows.

    ``tiles``: calls of ``f`` on consecutive samples of ``problem``'s batch, in order (the
    kernel tiles of ``torchgram.ntk``; the two input sets of a kernel joined into one batch).
    Their outputs must equal the batch's, and so must their derivatives
    (:func:`check_tile_derivatives`; ``eager``: by plain autograd, see
    :func:`compare_pullbacks`).
    """
    full_rows, _ = batch_rows(problem, eager=eager)
    first = 0
    for tile in tiles:
        try:
            rows, _ = batch_rows(tile, eager=eager)
        except (NotPerSample, OutputChanged):
            raise
        except Exception as error:  # noqa: BLE001 -- f fails on a tile (a batch of one ...)
            raise fails_alone(error) from error
        samples = torch.arange(first, first + tile.samples, device=full_rows.device)
        check_samples(problem, rows[tile.sample_major_index], samples, full_rows)
        first += tile.samples
    check_tile_derivatives(problem, tiles, eager=eager)


def check_tile_derivatives(problem: Problem, tiles: Sequence[Problem], *,
                           eager: bool = False) -> None:
    """Raise :class:`NotPerSample` unless the tiles' rows have the batch's derivatives.

    Equal outputs do not prove that the samples do not interact: samples that are the same
    where they meet (one token each, the same id) give the same ``x - x.mean(0)`` alone and in
    the batch, where its derivative in the parameters differs (kernel hunt 2). The batch's
    vector-Jacobian product with random positive weights must equal the sum of the tiles'
    with the same weights on the same rows (:func:`compare_pullbacks`).
    """
    index = problem.sample_major_index
    weights = positive_weights((index.numel(),), index.device, problem.output.dtype)
    parts = []
    first = 0
    for tile in tiles:
        samples = torch.arange(first, first + tile.samples, device=index.device)
        tile_weights = torch.zeros(tile.sample_major_index.numel(), dtype=weights.dtype,
                                   device=weights.device)
        tile_weights[tile.sample_major_index.reshape(-1)] = \
            weights[index[samples].reshape(-1)]
        parts.append((lambda *values, tile=tile: tile.rows(values)[0], tile_weights))
        first += tile.samples
    compare_pullbacks(problem, weights, parts, "the tiles' outputs", eager=eager)


def fails_alone(error: Exception) -> NotPerSample:
    """The :class:`NotPerSample` for ``f`` raising ``error`` on a batch of one (the batch ran)."""
    return NotPerSample(f"f fails on a batch of one ({type(error).__name__}: "
                        f"{str(error)[:100]})")


def check_samples(problem: Problem, sample_rows: Tensor, samples: Tensor,
                  full_rows: Tensor) -> None:
    """Raise :class:`NotPerSample` unless samples run alone match the batch's outputs.

    Args:
        problem: The call (with ``batch_dim``).
        sample_rows: ``[count, K]``: the rows of the samples ``samples``, each run alone.
        samples: ``[count]`` the indices of those samples in the batch.
        full_rows: ``[m]`` the outputs of the whole batch, in output order.
    """
    full = full_rows.detach()
    expected = full[problem.sample_major_index[samples]]
    actual = sample_rows.detach().reshape(expected.shape).to(expected.dtype)
    rtol = working_tolerance(problem)
    bound = expected.abs().add_(_largest(full)).mul_(rtol)  # rtol (scale + |e|)
    if not bool((actual - expected).abs_().le(bound).all()):  # NaN: never within
        worst = int(((actual - expected).abs().amax(dim=1)).argmax())
        raise NotPerSample(
            f"sample {int(samples[worst])} run alone gives other outputs than in the batch: the "
            "samples interact (e.g. batch-norm in training mode, x - x.mean(0))")
