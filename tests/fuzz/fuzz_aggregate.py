"""Fuzzed Jacobian-descent updates: ``tg.aggregated_grad`` against ``Jᵀ w(J Jᵀ)`` of the oracle.

The same generated calls as the Gramian property (``fuzz_strategies.cases``, without the
diagonal, which a weighting cannot use), through :func:`torchgram.aggregated_grad` with a
weighting that depends on the Gramian (:func:`weighting`), and eagerly through
:func:`torchgram.autograd.backward` (the forward recorded or not). The property: the update
is the dense oracle's ``Jᵀ w`` with ``w`` the same weighting of the oracle's Gramian (per
differentiated floating leaf, in the arguments' leaf order), or a torchgram error, and the
call leaves its arguments, module and grad flags as they were (eagerly: only the leaves'
``.grad`` is written).
"""

from __future__ import annotations

import dataclasses
import math

import optree
import torch
from torch import Tensor

import torchgram as tg
from fuzz_arch import Built, FuzzCase, build, seed_draws
from fuzz_check import (
    OWN_ROUND_OFF,
    TOLERANCE,
    Snapshot,
    eager_rows,
    fresh_leaves,
    oracle,
    plain_update,
)
from reference import Dense


def weighting(gramian: Tensor) -> Tensor:
    """Smooth weights that read the Gramian: ``1 + tanh(diag / max |diag|) / 2`` plus a ramp."""
    diagonal = gramian.diagonal()
    ramp = torch.arange(diagonal.numel(), dtype=gramian.dtype, device=gramian.device)
    return (1 + 0.5 * torch.tanh(diagonal / (diagonal.abs().max() + 1e-30))
            + 0.1 * ramp / max(1, diagonal.numel()))


def check_aggregated(case: FuzzCase, backend: str) -> str:
    """The property on one call; say whether it answered or refused."""
    case = dataclasses.replace(case, diagonal=False, repeat="none")
    built = build(case)
    expected = oracle(case)
    options = {name: value for name, value in built.options.items() if name != "diagonal"}
    seed_draws(case.seed)  # random ops: the oracle and the call see the same draw
    snapshot = Snapshot.take(built.args, built.kwargs, built.module)
    try:
        with torch.set_grad_enabled(case.grad_mode != "no_grad"):
            update, _ = tg.aggregated_grad(built.f, weighting, backend=backend, **options)(
                *built.args, **built.kwargs)
    except Exception as error:  # noqa: BLE001 -- the property is about which errors escape
        return _refused(error, snapshot, built, backend)
    snapshot.assert_unchanged(built.module)
    assert expected is not None, "answered a call without any leaf to differentiate"
    leaves = [leaf for leaf in optree.tree_leaves(update) if isinstance(leaf, Tensor)]
    _assert_update(case, leaves, expected)
    return "answered"


def _refused(error: Exception, snapshot: Snapshot, built: Built, what: str) -> str:
    """The outcome of a call that raised: a torchgram error, with everything as it was."""
    snapshot.assert_unchanged(built.module)
    if not str(error).startswith("torchgram."):
        raise AssertionError(f"{what}: a raw error escaped: {type(error).__name__}: "
                             f"{error}") from error
    return f"refused ({type(error).__name__}: {str(error)[:60]}...)"


def _assert_update(case: FuzzCase, leaves: list[Tensor], expected: Dense) -> None:
    """``leaves`` (the update per differentiated leaf, in order) against the oracle's ``Jᵀw``.

    A float32 update may be as far off as the oracle's own float32 update (``jacrev`` in the
    case's dtype) or as one plain float32 backward of the weighted rows
    (:func:`fuzz_check.plain_update`): where ``J`` is zero or nearly so analytically and
    round-off is all a float32 evaluation gives (batch-norm in training mode over three
    values, update hunt 3; over two samples that look up the same row, seed 5001), no backend
    can do better, and the Gramian's squared entries hide it.
    """
    weights = weighting(expected.gramian)
    want = expected.jacobian.T @ weights.to(expected.jacobian.dtype)
    got = (torch.cat([leaf.detach().reshape(-1).double() for leaf in leaves]) if leaves
           else want.new_zeros(0))
    assert got.shape == want.shape, f"update of {got.numel()} entries, expected {want.numel()}"
    if not want.numel():
        return
    scale = max(want.abs().max().item(), 1e-2)
    error = (got - want).abs().max().item()
    precision = torch.float32 if case.dtype == "float32" or case.mixed_dtypes else torch.float64
    allowed = TOLERANCE[precision] * scale
    if error > allowed and precision == torch.float32:
        in_case_dtype = oracle(case, in_case_dtype=True)
        assert in_case_dtype is not None
        own = in_case_dtype.jacobian.double().T @ weighting(in_case_dtype.gramian.double())
        plain = plain_update(case, weights)
        allowed = max(allowed, OWN_ROUND_OFF * max((own - want).abs().max().item(),
                                                   (plain - want).abs().max().item()))
    assert math.isfinite(error) and error <= allowed, \
        f"update: relative error {error / scale:.3g} > {allowed / scale:.3g}"


def check_eager_update(case: FuzzCase, recorded: bool) -> str:
    """The property for ``tg.autograd.backward``: the case called eagerly on fresh leaves that
    require grad (inside ``tg.autograd.record()`` when ``recorded``), then one step with the
    case's ``batch_dim``; the leaves' ``.grad`` is the oracle's ``Jᵀ w``.

    As for ``check_eager``, aliased leaves and calls under ``no_grad`` do not apply.
    """
    case = dataclasses.replace(case, diagonal=False, repeat="none")
    expected = oracle(case, eager=True)
    if case.alias_tied or case.grad_mode == "no_grad" or expected is None:
        return "not applicable"
    built = build(case)
    args, leaves = fresh_leaves(built)
    snapshot = Snapshot.take(built.args, built.kwargs, built.module)
    try:
        rows = eager_rows(case, built, args, recorded)
        tg.autograd.backward(rows, leaves, weighting, batch_dim=case.batch_dim,
                             chunk_size=case.chunk_size)
    except Exception as error:  # noqa: BLE001 -- the property is about which errors escape
        return _refused(error, snapshot, built, "eager update")
    snapshot.assert_unchanged(built.module)
    _assert_update(case, [torch.zeros_like(leaf) if leaf.grad is None else
                          leaf.grad.to_dense() if leaf.grad.is_sparse else leaf.grad
                          for leaf in leaves], expected)
    return "answered"
