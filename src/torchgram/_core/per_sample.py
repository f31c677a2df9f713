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
  of samples run alone are compared with the batch's (:func:`check_samples` again).

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
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchgram._core.census import OpCensus
from torchgram._core.errors import NotPerSample
from torchgram._core.problem import Problem


def tolerance(dtype: torch.dtype) -> float:
    """Relative difference allowed between a sample run alone and the same sample in a batch.

    Example:
        >>> tolerance(torch.float32), tolerance(torch.float64)
        (1e-05, 1e-09)
    """
    bits = torch.finfo(dtype).bits
    return 1e-9 if bits > 32 else 1e-5 if bits == 32 else 1e-4  # 16 bits: as before


def batch_rows(problem: Problem) -> tuple[Tensor, Any]:
    """``f``'s output rows ``[m]`` on the whole batch (output order) and aux.

    Without gradients, unless ``G`` is differentiable (its aux then is too).

    Raises :class:`NotPerSample` if that evaluation drew random numbers or called an op that
    makes samples interact, and inside ``torch.func.vmap``, where the comparison with samples
    run alone (:func:`check_samples`) is data-dependent control flow, which ``vmap`` refuses
    (NOTE [composition]).
    """
    if "vmap" in problem.composition.transforms:
        raise NotPerSample("inside torch.func.vmap, samples run alone cannot be compared with "
                           "the batch (data-dependent)")
    census = OpCensus()
    keep_graph = problem.composition.differentiable and torch.is_grad_enabled()  # for aux
    with torch.set_grad_enabled(keep_graph), census:
        rows, aux = problem.rows(problem.leaves)
    if problem.draw.random:
        raise NotPerSample("f draws random numbers (dropout, ...): one sample at a time it "
                           "would see other draws than the batch's", random=True)
    if census.coupling:
        raise NotPerSample(f"f calls {census.coupling[0]}: its samples interact")
    return rows, aux


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
    expected = full_rows[problem.sample_major_index[samples]]
    actual = sample_rows.detach().reshape(expected.shape).to(expected.dtype)
    scale = full_rows.detach().abs().max()
    rtol = tolerance(problem.output.dtype)
    if not bool(((actual - expected).abs() <= rtol * (scale + expected.abs())).all()):
        worst = int(((actual - expected).abs().amax(dim=1)).argmax())
        raise NotPerSample(
            f"sample {int(samples[worst])} run alone gives other outputs than in the batch: the "
            "samples interact (e.g. batch-norm in training mode, x - x.mean(0))")
