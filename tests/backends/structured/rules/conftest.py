"""Shared helper for the rule tests: the structured backend with a forced way, vs the oracle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from helpers import flat_gramian, make_problem
from reference import dense_gramian
from torchgram.backends.structured import plan_problem, run_structured

WAYS = ["ghost", "materialize", None]


def structured_gramian(f: Callable[..., Any], args: tuple[Any, ...], *,
                       force: str | None = None, **options: Any) -> torch.Tensor:
    """The structured backend's flat Gramian ``[m, m]`` (``[m]`` diagonal)."""
    problem = make_problem(f, args, **options)
    return flat_gramian(problem, run_structured(problem, force=force))


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
