"""Shared helper for the rule tests: the structured backend with a forced way, vs the oracle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from reference import dense_gramian
from torchgram._problem import GramianProblem, make_batch_spec
from torchgram._pytree import select_diff_leaves
from torchgram.backends._sink import GramSink
from torchgram.backends.structured import plan_problem, run_structured

WAYS = ["ghost", "materialize", None]


def make_problem(f: Callable[..., Any], args: tuple[Any, ...], *, batch_dim: int | None = None,
                 in_dims: Any = 0, diagonal: bool = False, per_leaf: bool = False,
                 chunk_size: int | None = None,
                 memory_budget: int | None = None) -> GramianProblem:
    diff = select_diff_leaves(args, (0,))
    batch = (None if batch_dim is None
             else make_batch_spec("test", args, (0,), batch_dim, in_dims))
    return GramianProblem(api="test", f=f, args=args, kwargs={}, diff=diff, has_aux=False,
                          batch=batch, chunk_size=chunk_size, memory_budget=memory_budget,
                          diagonal=diagonal, per_leaf=per_leaf)


def structured_gramian(f: Callable[..., Any], args: tuple[Any, ...], *,
                       force: str | None = None, **options: Any) -> torch.Tensor:
    """The structured backend's flat Gramian ``[m, m]`` (``[m]`` diagonal)."""
    problem = make_problem(f, args, **options)
    sink = GramSink(len(problem.leaves), per_leaf=False, diagonal=problem.diagonal)
    run_structured(problem, sink, force=force)
    spec = problem.output
    assert spec is not None
    return sink.result(spec.num_rows, spec.dtype, spec.device)[0]


def plan_ways(f: Callable[..., Any], args: tuple[Any, ...], **options: Any) -> list[str]:
    """The cost model's way for every leaf."""
    return [plan.way for plan in plan_problem(make_problem(f, args, **options)).leaves]


def check_against_oracle(f: Callable[..., Any], args: tuple[Any, ...], *, force: str | None,
                         batch_dim: int | None, diagonal: bool = False, **options: Any) -> None:
    expected = dense_gramian(f, args).gramian
    if diagonal:
        expected = expected.diagonal()
    actual = structured_gramian(f, args, force=force, batch_dim=batch_dim, diagonal=diagonal,
                                **options)
    scale = expected.abs().max().clamp_min(1.0)
    torch.testing.assert_close(actual / scale, expected / scale, rtol=1e-10, atol=1e-10)


@pytest.fixture
def check() -> Callable[..., None]:
    """``check(f, args, force=..., batch_dim=..., diagonal=...)`` asserts oracle agreement."""
    return check_against_oracle


@pytest.fixture
def ways() -> Callable[..., list[str]]:
    """``ways(f, args, batch_dim=...)``: the cost model's way for every leaf."""
    return plan_ways
