"""The real models run as eager code: ``tg.autograd.gramian`` on the graph of a plain call.

Same contract as :mod:`models.case` (the oracle's matrix or a torchgram error, nothing
changed), for the imperative API: the case's function is called eagerly on leaves that
require grad (the parameters), with and without ``tg.autograd.record()`` around the call,
and the Gramian of its outputs is taken with ``batch_dim=0`` and ``None``. For coupled cases
(batch statistics) ``batch_dim=0`` must give the coupled Gramian; random cases see the same
seeded draw as the oracle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from torch import Tensor

import torchgram as tg
from models import recurrent, torchjd_ports, transformers_models, vision
from models.case import (
    ModelCase,
    build,
    check_unchanged,
    compare,
    oracle,
    snapshot,
    torchgram_message,
)

ERRORS: list[str] = []
"""The torchgram errors met (allowed by the contract; printed by ``-s`` runs for inspection)."""

SUITES: dict[str, dict[str, Callable[[], ModelCase]]] = {
    "transformers": transformers_models.BUILDERS, "vision": vision.BUILDERS,
    "recurrent": recurrent.BUILDERS, "torchjd": torchjd_ports.BUILDERS,
}


def eager_leaves(case: ModelCase) -> tuple[Any, list[Tensor]]:
    """The case's parameters as fresh leaves that require grad (pytree, and in a list)."""
    flat, spec = optree.tree_flatten(case.params)
    leaves = []
    for i, leaf in enumerate(flat):
        if isinstance(leaf, Tensor) and leaf.is_floating_point():
            flat[i] = leaf.detach().clone().requires_grad_()
            leaves.append(flat[i])
    return optree.tree_unflatten(spec, flat), leaves


def eager_gramian(case: ModelCase, recorded: bool, batch_dim: int | None) -> Any:
    """The case's function called eagerly on leaves that require grad, then its Gramian."""
    params, leaves = eager_leaves(case)
    if case.seed is not None:
        torch.manual_seed(case.seed)
    if recorded:
        with tg.autograd.record():
            out = case.f(params, *case.inputs, **case.kw_inputs)
    else:
        out = case.f(params, *case.inputs, **case.kw_inputs)
    rows = optree.tree_leaves(out)
    G = tg.autograd.gramian(rows[0] if isinstance(out, Tensor) else rows, leaves,
                            batch_dim=batch_dim)
    assert all(leaf.grad is None for leaf in leaves)
    return G


def _grid() -> list[Any]:
    return [pytest.param(suite, name, recorded, batch_dim,
                         id=f"{name}-{'record' if recorded else 'walk'}-batch{batch_dim}")
            for suite, builders in SUITES.items() for name in builders
            for recorded in (True, False) for batch_dim in (0, None)]


@pytest.mark.parametrize(("suite", "name", "recorded", "batch_dim"), _grid())
def test_eager_model(suite: str, name: str, recorded: bool, batch_dim: int | None) -> None:
    builders = SUITES[suite]
    expected, _ = oracle(builders, name)
    case = build(builders, name)
    before = snapshot(case)
    try:
        G = eager_gramian(case, recorded, batch_dim)
    except Exception as error:
        if torchgram_message(error) is None:
            raise
        check_unchanged(case, before)
        ERRORS.append(f"{name}: {torchgram_message(error)}")
        return
    compare(G, expected, case.rtol)
    check_unchanged(case, before)
