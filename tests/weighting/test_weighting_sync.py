"""Tests of the synchronous CG rounds (``weighting/_sync_cg.py``), UPGrad's first pass from 128.

Every answer they give is certified (the KKT residual, computed here independently, is at most
``KKT_TOL``); what they hand back is finished by the other solvers, to the same answers.
"""

from __future__ import annotations

import functools

import pytest
import torch
from test_weighting_qp import brute_force_nonneg_qp, random_psd
from test_weighting_scale import force_solver, gramian
from torch.testing import assert_close

import torchgram.weighting as weighting
from torchgram.weighting import _nonneg, _sync_cg
from torchgram.weighting._dual_cone import normalize_and_regularize
from torchgram.weighting._kkt import KKT_TOL, kkt_residual, violations
from torchgram.weighting._qp import solve_nonneg_qp
from torchgram.weighting._sync_cg import solve_nonneg_qp_sync


@pytest.mark.parametrize("work_dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("m", [1, 3, 7], ids=lambda m: f"m={m}")
@pytest.mark.parametrize("rank", ["full", "1"], ids=lambda r: f"rank={r}")
def test_sync_solver_certifies_brute_force_answers(m: int, rank: str,
                                                   work_dtype: torch.dtype) -> None:
    H = random_psd(m, m if rank == "full" else 1, seed=m, ridge=1e-4, spread=2.0)
    generator = torch.Generator().manual_seed(200 + m)
    q = torch.cat([H, torch.randn(4, m, generator=generator, dtype=torch.float64)])
    expected = torch.stack([brute_force_nonneg_qp(H, row) for row in q])
    x, certified, _ = solve_nonneg_qp_sync(H, q, work_dtype=work_dtype)
    assert (x >= 0).all()
    # What it certifies is the solution; what it hands back is left to the other solvers.
    assert certified.any()
    assert_close(x[certified], expected[certified], rtol=1e-9, atol=1e-10)
    assert kkt_residual(H, q[certified], x[certified]).max() <= KKT_TOL
    # A warm start at the solution is certified before any iteration.
    x, certified, iterations = solve_nonneg_qp_sync(H, q, x0=expected, work_dtype=work_dtype)
    assert certified.all() and iterations == 0
    assert_close(x, expected, rtol=1e-9, atol=1e-10)


def test_sync_solver_on_empty_batches() -> None:
    H = torch.eye(3, dtype=torch.float64)
    x, certified, iterations = solve_nonneg_qp_sync(H, H[:0])
    assert x.shape == (0, 3) and certified.shape == (0,) and iterations == 0
    x, certified, _ = solve_nonneg_qp_sync(H[:0, :0], torch.zeros(2, 0, dtype=torch.float64))
    assert x.shape == (2, 0) and certified.all()


SYNC_CASES = [(128, structure) for structure in
              ("full-rank", "rank-1", "half-rank", "ill-conditioned", "duplicate-rows",
               "conflicting")] + [(300, "full-rank"), (300, "half-rank")]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize(("m", "structure"), SYNC_CASES,
                         ids=[f"m={m}-{structure}" for m, structure in SYNC_CASES])
def test_upgrad_through_the_sync_rounds_is_certified(monkeypatch: pytest.MonkeyPatch, m: int,
                                                      structure: str, dtype: torch.dtype) -> None:
    # Forced: by default only Gramians of a high effective rank go through them.
    force_solver(monkeypatch, "sync")
    G = gramian(m, structure, seed=m + 17).to(dtype)
    H = normalize_and_regularize(G, 1e-4, 1e-4)
    solution = _nonneg.solve_nonneg(H, H)
    assert solution.solver == "cg"
    assert (solution.x >= 0).all()
    assert kkt_residual(H, H, solution.x).max() <= KKT_TOL
    # The same projections as the direct solver's (exact face solves).
    assert_close(solution.x, solve_nonneg_qp(H, H), rtol=1e-9, atol=1e-11)


def test_sync_rounds_answer_what_they_certify() -> None:
    # Without the fallbacks, on a random Gramian (where they certify every problem).
    G = gramian(160, "full-rank", seed=5)
    H = normalize_and_regularize(G, 1e-4, 1e-4)
    x, certified, iterations = solve_nonneg_qp_sync(H, H)
    assert certified.all() and 0 < iterations <= 64
    assert kkt_residual(H, H, x).max() <= KKT_TOL


def test_sync_rounds_hand_back_what_they_do_not_certify(monkeypatch: pytest.MonkeyPatch) -> None:
    H = random_psd(150, 150, seed=6, ridge=1e-4)
    x, certified, iterations = solve_nonneg_qp_sync(H, H, max_iterations=6)
    assert iterations == 6 and not certified.all()
    assert (x >= 0).all()
    # solve_nonneg finishes them by the other solvers: the direct solver's answer.
    monkeypatch.setattr(_nonneg, "solve_nonneg_qp_sync",
                        functools.partial(_sync_cg.solve_nonneg_qp_sync, max_iterations=6))
    force_solver(monkeypatch, "sync")
    for cg_from in (1, 10**9):  # The CG solver, then the direct one; or the direct one at once.
        monkeypatch.setattr(_nonneg, "_CG_FROM", cg_from)
        solution = _nonneg.solve_nonneg(H, H)
        assert solution.solver == "cg"
        assert_close(solution.x, solve_nonneg_qp(H, H), rtol=1e-10, atol=1e-12)


def test_warm_started_sync_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    G = gramian(140, "full-rank", seed=10)
    state = weighting.WarmStart()
    cold = weighting.upgrad(G, state=state)
    again = weighting.upgrad(G, state=state)  # The same Gramian: certified at once.
    assert state.iterations == 0
    assert_close(again, cold, rtol=0, atol=1e-15)
    nearby = G + 1e-3 * gramian(140, "full-rank", seed=11)
    warm = weighting.upgrad(nearby, state=state)
    assert_close(warm, weighting.upgrad(nearby), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("structure", "expected"), [
    ("full-rank", True), ("rank-1", False), ("half-rank", False), ("ill-conditioned", False)])
def test_only_spread_out_gramians_go_through_the_sync_rounds(structure: str,
                                                            expected: bool) -> None:
    G = gramian(100, structure, seed=13)
    H = normalize_and_regularize(G, 1e-4, 1e-4)
    assert _nonneg._spread_out(H) is expected
    assert _nonneg._spread_out(torch.eye(5, dtype=torch.float64))
    state = weighting.WarmStart()
    weighting.upgrad(G, state=state)
    assert state.solver == ("cg" if expected else "direct")


def test_violations_match_their_definition() -> None:
    generator = torch.Generator().manual_seed(12)
    x = torch.randn(5, 40, generator=generator, dtype=torch.float64).clamp(min=0.0)
    s = torch.randn(5, 40, generator=generator, dtype=torch.float64)
    expected = torch.where(x > 0, s.abs(), (-s).clamp(min=0.0))
    assert torch.equal(violations(x, s), expected)


@pytest.mark.parametrize("reg_eps", [0.0, 1e-4], ids=["reg=0", "reg=1e-4"])
@pytest.mark.parametrize("m", [100, 130], ids=lambda m: f"m={m}")
def test_sync_rounds_with_a_zero_row_and_duplicates(m: int, reg_eps: float) -> None:
    # Rank-deficient by two, still of high effective rank: the rounds run (not forced), with a
    # singular H when reg_eps = 0; every projection is certified all the same.
    generator = torch.Generator().manual_seed(m)
    A = torch.randn(m, 3 * m, generator=generator, dtype=torch.float64)
    A[5] = 0.0
    A[7] = A[9]
    G = A @ A.T
    H = normalize_and_regularize(G, 1e-4, reg_eps)
    assert _nonneg._spread_out(H)
    state = weighting.WarmStart()
    w = weighting.upgrad(G, reg_eps=reg_eps, state=state)
    assert state.solver == "cg" and state._solution is not None
    assert torch.isfinite(w).all()
    assert kkt_residual(H, H, state._solution).max() <= KKT_TOL
    if reg_eps > 0:  # Unique: the direct solver's answer.
        assert_close(state._solution, solve_nonneg_qp(H, H), rtol=1e-9, atol=1e-11)
