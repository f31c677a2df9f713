"""Leaf grouping under a memory budget, and that the jacobian backend honours it."""

from __future__ import annotations

import pytest
import torch

import torchgram as tg
from reference import dense_gramian
from torchgram.backends._grouping import group_leaves, rows_per_chunk
from zoo import build


@pytest.mark.parametrize(("numels", "budget", "widths"), [
    ([4, 4, 4], None, [12]),
    ([4, 4, 4], 8 * 8, [8, 4]),
    ([4, 4, 4], 8 * 4, [4, 4, 4]),
    ([2, 9, 2], 8 * 4, [2, 4, 4, 1, 2]),
    ([3, 0, 3], 8 * 6, [6]),
    ([5], 1, [1, 1, 1, 1, 1]),
], ids=["no-budget", "two-per-group", "one-per-group", "split-big-leaf", "empty-leaf",
        "tiny-budget"])
def test_groups_cover_every_column_once_within_budget(numels, budget, widths) -> None:
    groups = group_leaves(numels, num_rows=2, itemsize=4, memory_budget=budget)
    assert [g.width for g in groups] == widths
    covered = sorted((s.leaf, c) for g in groups for s in g.slices for c in range(s.start, s.stop))
    assert covered == [(leaf, c) for leaf, n in enumerate(numels) for c in range(n)]


def test_rows_per_chunk() -> None:
    assert rows_per_chunk(3, 10, 100, 4, None) == 3
    assert rows_per_chunk(None, 10, 100, 4, None) == 10
    assert rows_per_chunk(None, 10, 100, 4, 4 * 100 * 4) == 4
    assert rows_per_chunk(None, 10, 100, 4, 1) == 1


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "per_sample"])
@pytest.mark.parametrize("budget_floats", [40, 150, 600], ids=lambda b: f"budget{b}floats")
def test_memory_budget_bounds_the_assembled_jacobian(batch_dim, budget_floats):
    case = build("mlp_logits")  # m = 15 rows, leaves of 24, 6, 18, 3 parameters
    itemsize = 8
    budget = budget_floats * itemsize
    explanation = tg.explain(case.f, backend="jacobian", memory_budget=budget,
                             batch_dim=batch_dim, run=True)(*case.args)
    torch.testing.assert_close(explanation.gramian, dense_gramian(case.f, case.args).shaped())
    ran = explanation.ran
    blocks = [rows * columns * itemsize for rows, columns in ran.jacobian_blocks]
    assert blocks and max(blocks) <= budget
    assert sum(blocks) == 15 * 51 * itemsize  # every column assembled exactly once
    if budget_floats < 15 * 24:  # the biggest leaf does not fit: it was split
        assert len(blocks) > 4
    # the transient row chunk of gradients fits the budget too (or is a single sample's)
    assert ran.row_chunks
    assert all(num_bytes <= budget or rows <= 3 for rows, num_bytes in ran.row_chunks)


def test_without_budget_one_block_holds_the_whole_jacobian() -> None:
    case = build("mlp_logits")
    explanation = tg.explain(case.f, backend="jacobian", run=True)(*case.args)
    assert explanation.ran.jacobian_blocks == [(15, 51)]
