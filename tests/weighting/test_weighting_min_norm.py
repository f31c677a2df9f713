"""Tests of Wolfe's support and its certified face solution (``weighting/_min_norm.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_weighting_qp import (
    _forbid_interior_point,
    _simplex_kkt,
    brute_force_simplex_qp,
    random_psd,
)
from torch import Tensor
from torch.testing import assert_close

from torchgram.weighting import _qp as qp
from torchgram.weighting._min_norm import WolfeRun, certified_face_solution
from torchgram.weighting._qp import solve_simplex_qp


def _support_of(H: Tensor, cycles: int = 10_000) -> Tensor:
    wolfe = WolfeRun(H)
    assert wolfe.run(cycles) == "converged"
    return wolfe.support()


@pytest.mark.parametrize("m", [1, 2, 3, 5, 7], ids=lambda m: f"m={m}")
@pytest.mark.parametrize("spread", [1.0, 4.0], ids=lambda s: f"row-norm-spread=1e{s:g}")
def test_wolfe_support_and_face_solution_match_brute_force(m: int, spread: float) -> None:
    H = random_psd(m, m, seed=m, spread=spread)
    expected = brute_force_simplex_qp(H)
    support = _support_of(H)
    assert torch.equal(support, expected > 1e-12)
    w = certified_face_solution(H, support)
    assert w is not None
    assert_close(w, expected, rtol=1e-7, atol=1e-8)


def test_certified_face_solution_rejects_wrong_faces() -> None:
    H = random_psd(7, 7, seed=7, spread=4.0)
    support = brute_force_simplex_qp(H) > 1e-12
    assert 1 < int(support.sum()) < 7  # a strict, non-trivial support: both tests bite
    missing = support.clone()
    missing[support.nonzero()[0]] = False  # s < 0 at the missing point
    assert certified_face_solution(H, missing) is None
    extra = support.clone()
    extra[(~support).nonzero()[0]] = True  # a negative weight at the extra point
    assert certified_face_solution(H, extra) is None


@pytest.mark.parametrize("m", [6, 600], ids=lambda m: f"m={m}")
def test_origin_in_the_hull_has_a_two_point_support(m: int) -> None:
    # Rows on a line through the origin, of both signs: the min-norm point is 0, the face
    # systems H_SS are singular, and the bordered system still solves the face exactly.
    generator = torch.Generator().manual_seed(m)
    J = torch.randn(m, 1, generator=generator, dtype=torch.float64) @ torch.randn(
        1, 5, generator=generator, dtype=torch.float64)
    H = J @ J.T / (J @ J.T).trace()
    support = _support_of(H)
    assert int(support.sum()) == 2
    w = certified_face_solution(H, support)
    assert w is not None
    assert float(w @ H @ w) < 1e-28
    assert _simplex_kkt(H, w) < 1e-15


def test_a_run_out_of_cycles_resumes_where_it_stopped() -> None:
    H = random_psd(64, 64, seed=0)
    wolfe = WolfeRun(H)
    assert wolfe.run(3) == "running"
    assert wolfe.run(10_000) == "converged"
    assert torch.equal(wolfe.support(), _support_of(H))
    assert wolfe.cycles > 3


def _spy_on(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Counts the calls of ``qp.<name>`` (one entry per call)."""
    calls: list[int] = []
    original = getattr(qp, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(qp, name, spy)
    return calls


def _active_set_answer(monkeypatch: pytest.MonkeyPatch, H: Tensor) -> Tensor:
    with monkeypatch.context() as patch:
        patch.setattr(qp, "_WOLFE_FROM", 10**9)
        return solve_simplex_qp(H)


def test_gramians_of_a_few_directions_start_with_wolfe(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [choosing the min-norm start]: an effective rank of at most 4 (here about 2).
    H = random_psd(512, 2, seed=1, spread=2.0)
    expected = _active_set_answer(monkeypatch, H)
    active_sets = _spy_on(monkeypatch, "_active_set")
    w = solve_simplex_qp(H)
    assert not active_sets
    assert _simplex_kkt(H, w) < 1e-13
    assert abs(float(w @ H @ w - expected @ H @ expected)) < 1e-16


@pytest.mark.parametrize("rank", [16, 512], ids=lambda r: f"rank={r}")
def test_other_gramians_skip_wolfe(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    # Rank 16 (effective rank ~12, as per-sample training Gramians): a support of dozens of
    # points, where Wolfe's cycles cost more than the active set (NOTE [choosing the
    # min-norm start]).
    H = random_psd(512, rank, seed=2)
    runs = _spy_on(monkeypatch, "WolfeRun")
    w = solve_simplex_qp(H)
    assert not runs
    assert _simplex_kkt(H, w) < 1e-13


def test_wolfe_answers_before_the_interior_point(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank m / 2: the origin may be in the hull, where the active set cycles (NOTE [exchange
    # while it progresses]); Wolfe's run answers before the interior-point method.
    H = random_psd(512, 256, seed=0)
    runs = _spy_on(monkeypatch, "WolfeRun")
    active_sets = _spy_on(monkeypatch, "_active_set")
    _forbid_interior_point(monkeypatch)
    w = solve_simplex_qp(H)
    assert runs and active_sets  # the active set ran first (not concentrated), then Wolfe's
    assert _simplex_kkt(H, w) < 1e-13
