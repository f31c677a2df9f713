"""The sink: the one place that puts rows in order, symmetrises, casts and shapes."""

from __future__ import annotations

import pytest
import torch

from helpers import make_problem
from torchgram._core.result import BackendResult, RunReport
from torchgram._core.sink import (
    LeafBlocks,
    assemble,
    backend_index,
    shape_block,
    to_backend_order,
    to_output_order,
)


def _problem_with_two_output_leaves():
    """Rows per sample K = 3 from two output leaves: sample-major is not the output order."""
    w = torch.randn(2, dtype=torch.float64)

    def f(w, x):
        return {"a": (x * w).sum(-1, keepdim=True), "b": (x @ w.flip(0))[:, None].expand(-1, 2)}

    x = torch.randn(4, 2, dtype=torch.float64)
    return make_problem(f, (w, x), batch_dim=0), f, (w, x)


def test_index_maps_each_backend_order_to_output_rows() -> None:
    problem, _, _ = _problem_with_two_output_leaves()
    index = problem.sample_major_index  # [B=4, K=3]
    assert index.shape == (4, 3)
    assert sorted(index.reshape(-1).tolist()) == list(range(12))
    assert torch.equal(backend_index(problem, "sample_major"), index.reshape(-1))
    assert torch.equal(backend_index(problem, "row_major"), index.T.reshape(-1))
    assert backend_index(problem, "output") is None


@pytest.mark.parametrize("order", ["output", "sample_major", "row_major"])
def test_reordering_round_trips(order) -> None:
    problem, _, _ = _problem_with_two_output_leaves()
    m = problem.num_rows
    rows = torch.randn(m, 5, dtype=torch.float64)
    G = rows @ rows.T  # in output order
    index = backend_index(problem, order)
    backend = G if index is None else G[index][:, index]
    torch.testing.assert_close(to_output_order(problem, order, backend, diagonal=False), G)
    torch.testing.assert_close(to_output_order(problem, order, backend.diagonal(),
                                               diagonal=True), G.diagonal())
    weights = torch.randn(m, dtype=torch.float64)
    in_backend = to_backend_order(problem, order, weights)
    torch.testing.assert_close(to_output_order(problem, order, in_backend, diagonal=True),
                               weights)


def test_assemble_symmetrises_casts_and_fills_zeros() -> None:
    w = torch.randn(3, dtype=torch.float32)
    problem = make_problem(lambda w, x: x @ w, (w, torch.randn(4, 3)), per_leaf=True)
    raw = torch.arange(16, dtype=torch.float64).reshape(4, 4)
    result = BackendResult((raw,), RunReport("test"), symmetric=False)
    (block,) = assemble(problem, result)
    assert block.dtype == torch.float32
    torch.testing.assert_close(block, ((raw + raw.T) / 2).float())
    (zeros,) = assemble(problem, BackendResult((None,), RunReport("test")))
    assert torch.equal(zeros, torch.zeros(4, 4))
    assert shape_block(problem, block, diagonal=False).shape == (4, 4)


def test_leaf_blocks_never_write_into_a_block_they_were_given() -> None:
    given = torch.ones(2, 2)
    blocks = LeafBlocks(2, per_leaf=False, diagonal=False)
    blocks.add(0, given)
    blocks.add(1, torch.ones(2, 2))
    blocks.add(1, torch.ones(2, 2))
    assert torch.equal(given, torch.ones(2, 2))
    assert torch.equal(blocks.blocks()[0], 3 * torch.ones(2, 2))
