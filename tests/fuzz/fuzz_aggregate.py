"""Fuzzed Jacobian-descent updates: ``tg.aggregated_grad`` against ``Jᵀ w(J Jᵀ)`` of the oracle.

The same generated calls as the Gramian property (``fuzz_strategies.cases``, without the
diagonal, which a weighting cannot use), through :func:`torchgram.aggregated_grad` with a
weighting that depends on the Gramian (:func:`weighting`). The property: the update is the
dense oracle's ``Jᵀ w`` with ``w`` the same weighting of the oracle's Gramian (per
differentiated floating leaf, in the arguments' leaf order), or a torchgram error, and the
call leaves its arguments, module and grad flags as they were.
"""

from __future__ import annotations

import dataclasses
import math

import optree
import torch
from torch import Tensor

import torchgram as tg
from fuzz_arch import FuzzCase, build
from fuzz_check import TOLERANCE, Snapshot, oracle


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
    torch.manual_seed(case.seed)  # random ops: the oracle and the call see the same draw
    snapshot = Snapshot.take(built.args, built.kwargs, built.module)
    try:
        with torch.set_grad_enabled(case.grad_mode != "no_grad"):
            update, _ = tg.aggregated_grad(built.f, weighting, backend=backend, **options)(
                *built.args, **built.kwargs)
    except Exception as error:  # noqa: BLE001 -- the property is about which errors escape
        snapshot.assert_unchanged(built.module)
        if not str(error).startswith("torchgram."):
            raise AssertionError(f"{backend}: a raw error escaped: {type(error).__name__}: "
                                 f"{error}") from error
        return f"refused ({type(error).__name__}: {str(error)[:60]}...)"
    snapshot.assert_unchanged(built.module)
    assert expected is not None, "answered a call without any leaf to differentiate"
    weights = weighting(expected.gramian)
    want = expected.jacobian.T @ weights.to(expected.jacobian.dtype)
    leaves = [leaf for leaf in optree.tree_leaves(update) if isinstance(leaf, Tensor)]
    got = (torch.cat([leaf.detach().reshape(-1).double() for leaf in leaves]) if leaves
           else want.new_zeros(0))
    assert got.shape == want.shape, f"update of {got.numel()} entries, expected {want.numel()}"
    scale = max(want.abs().max().item() if want.numel() else 0.0, 1e-2)
    error = (got - want).abs().max().item() / scale if want.numel() else 0.0
    precision = torch.float32 if case.dtype == "float32" or case.mixed_dtypes else torch.float64
    tolerance = TOLERANCE[precision]
    assert math.isfinite(error) and error <= tolerance, \
        f"update: relative error {error:.3g} > {tolerance:g}"
    return "answered"
