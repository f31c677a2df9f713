"""Tests of the weightings at large m: the CG solver, the KKT certificate, the faster algorithms.

The large cases are float64 and few (a few seconds in all): UPGrad's QPs certified by an
independent KKT check for m up to 1024 on random, rank-1, rank-m/2, ill-conditioned (cond 1e9)
and duplicate-row Gramians; the CG and direct solvers and torchjd agreeing where all can run.
"""

from __future__ import annotations

import functools

import pytest
import torch
from test_weighting import make_gramian, torchjd_weighting
from test_weighting_qp import brute_force_nonneg_qp, random_psd
from torch import Tensor
from torch.testing import assert_close

import torchgram.weighting as weighting
from torchgram.weighting import _cg_qp, _nonneg, _pcgrad
from torchgram.weighting._cg_qp import solve_nonneg_qp_cg
from torchgram.weighting._dual_cone import normalize_and_regularize
from torchgram.weighting._kkt import KKT_TOL, error_bound, kkt_residual
from torchgram.weighting._qp import solve_nonneg_qp


def gramian(m: int, structure: str, seed: int = 0) -> Tensor:
    """``make_gramian``'s structures, and ``"ill-conditioned"``: eigenvalues 1 … 1e-9."""
    if structure != "ill-conditioned":
        return make_gramian(m, structure, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=generator, dtype=torch.float64))
    A = U * torch.logspace(0, -4.5, m, dtype=torch.float64)
    G = A @ A.T
    return (G + G.T) / 2


def force_solver(monkeypatch: pytest.MonkeyPatch, solver: str) -> None:
    """Makes ``_nonneg.solve_nonneg`` use ``solver`` whatever the size.

    ``"direct"``: the direct solver alone; ``"cg"``: the CG solver of ``_cg_qp.py`` (then the
    direct one for what it leaves); ``"sync"``: the synchronous CG rounds first (batches only,
    whatever the Gramian's effective rank), with no cold-start probe in front of them (NOTE
    [cold start probe]: where it holds, the direct solver runs whatever the size).
    """
    threshold = 10**9 if solver == "direct" else 1
    if solver != "direct":
        monkeypatch.setattr(_nonneg, "_COLD_PROBE_FROM", 10**9)
    monkeypatch.setattr(_nonneg, "_CG_FROM", threshold)
    monkeypatch.setattr(_nonneg, "_CG_FROM_SINGLE", threshold)
    monkeypatch.setattr(_nonneg, "_CG_FROM_CONCENTRATED", threshold)
    monkeypatch.setattr(_nonneg, "_SYNC_FROM", 1 if solver == "sync" else 10**9)
    monkeypatch.setattr(_nonneg, "_SYNC_MIN_RANK", 0.0)


# ---------------------------------------------------------------- UPGrad at scale

SCALE_CASES = (
    [(128, structure) for structure in
     ("full-rank", "rank-1", "half-rank", "ill-conditioned", "duplicate-rows")]
    + [(512, "rank-1"), (512, "ill-conditioned"), (1024, "full-rank")]
)


@pytest.mark.parametrize(("m", "structure"), SCALE_CASES,
                         ids=[f"m={m}-{structure}" for m, structure in SCALE_CASES])
def test_upgrad_is_certified_at_scale(m: int, structure: str) -> None:
    G = gramian(m, structure, seed=m)
    state = weighting.WarmStart()
    w = weighting.upgrad(G, state=state)
    # Below 1024, Gramians of low effective rank go to the direct solver (ADMM-guessed faces).
    assert state.solver == ("cg" if structure == "full-rank" or m >= 1024 else "direct")
    # The projections v_i = e_i + x_i, as the state keeps the x_i for the next call.
    H = normalize_and_regularize(G, 1e-4, 1e-4)
    eye = torch.eye(m, dtype=torch.float64)
    assert state._solution is not None
    V = eye + state._solution
    assert_close(V.mean(dim=0), w, rtol=1e-12, atol=1e-14)
    # An independent check of the certificate: every projection's KKT residual.
    assert kkt_residual(H, H, V - eye).max() <= KKT_TOL
    assert (V >= eye).all()
    assert (w >= 1 / m).all()
    # Jᵀw is in the dual cone up to the ridge: (G w)_i >= -reg_eps tr(G) w_i.
    trace = G.diagonal().sum()
    assert (G @ w >= -(1e-4 * w + 1e-10) * trace).all()


@pytest.mark.parametrize("structure", ["full-rank", "half-rank", "ill-conditioned", "conflicting"])
@pytest.mark.parametrize("solver", ["cg", "sync"])
def test_cg_and_direct_solvers_agree(monkeypatch: pytest.MonkeyPatch, structure: str,
                                     solver: str) -> None:
    G = gramian(128, structure, seed=1)
    force_solver(monkeypatch, "direct")
    direct = weighting.upgrad(G)
    force_solver(monkeypatch, solver)
    assert_close(weighting.upgrad(G), direct, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("structure", ["full-rank", "half-rank"])
@pytest.mark.parametrize("seed", [2, 9])
def test_upgrad_matches_torchjd_at_scale(structure: str, seed: int) -> None:
    # full rank: the synchronous rounds first (NOTE [synchronous CG rounds]); half rank: the
    # direct solver from ADMM-guessed faces (NOTE [ADMM face identification])
    G = gramian(128, structure, seed=seed)
    reference = torchjd_weighting("upgrad")
    state = weighting.WarmStart()
    assert_close(weighting.upgrad(G, state=state), reference(G), rtol=1e-9, atol=1e-10)
    assert state.solver == ("cg" if structure == "full-rank" else "direct")
    G32 = G.float()
    assert_close(weighting.upgrad(G32), reference(G32), rtol=1e-5, atol=1e-5)


def test_dualproj_single_large_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    G = gramian(800, "half-rank", seed=3)
    state = weighting.WarmStart()
    w = weighting.dualproj(G, state=state)
    assert state.solver == "cg"
    force_solver(monkeypatch, "direct")
    assert_close(w, weighting.dualproj(G), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_large_float32_gramian_is_the_rounded_float64_one(dtype: torch.dtype) -> None:
    G = gramian(160, "conflicting", seed=4).to(dtype)
    w = weighting.upgrad(G)
    assert w.dtype == dtype
    assert_close(w.double(), weighting.upgrad(G.double()), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the CG solver itself


@pytest.mark.parametrize("work_dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("m", [1, 3, 7], ids=lambda m: f"m={m}")
@pytest.mark.parametrize("rank", ["full", "1"], ids=lambda r: f"rank={r}")
def test_cg_solver_matches_brute_force(m: int, rank: str, work_dtype: torch.dtype) -> None:
    H = random_psd(m, m if rank == "full" else 1, seed=m, ridge=1e-4, spread=2.0)
    generator = torch.Generator().manual_seed(100 + m)
    q = torch.cat([H, torch.randn(4, m, generator=generator, dtype=torch.float64)])
    expected = torch.stack([brute_force_nonneg_qp(H, row) for row in q])
    x, certified, _ = solve_nonneg_qp_cg(H, q, work_dtype=work_dtype)
    assert certified.all()
    assert_close(x, expected, rtol=1e-9, atol=1e-10)
    assert kkt_residual(H, q, x).max() <= KKT_TOL
    # Warm starts, good (the solution) or bad (its complement), give the same answer.
    for x0 in (expected, (expected == 0).double()):
        x, certified, _ = solve_nonneg_qp_cg(H, q, free=x0 > 0, x0=x0, work_dtype=work_dtype)
        assert certified.all()
        assert_close(x, expected, rtol=1e-9, atol=1e-10)


def test_cg_solver_hands_back_what_it_does_not_certify(monkeypatch: pytest.MonkeyPatch) -> None:
    H = random_psd(150, 150, seed=5, ridge=1e-4)
    x, certified, iterations = solve_nonneg_qp_cg(H, H, max_iterations=6)
    assert iterations == 6 and not certified.all()
    assert (x >= 0).all()  # The last iterates, to start the direct solver from.
    # solve_nonneg finishes them with the direct solver: the same answer as the direct solver's.
    monkeypatch.setattr(_nonneg, "solve_nonneg_qp_cg",
                        functools.partial(_cg_qp.solve_nonneg_qp_cg, max_iterations=6))
    force_solver(monkeypatch, "cg")
    solution = _nonneg.solve_nonneg(H, H)
    assert solution.solver == "cg"
    assert_close(solution.x, solve_nonneg_qp(H, H), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("solver", ["default", "sync"])
def test_cg_solvers_on_a_singular_matrix(solver: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # reg_eps = 0 and a rank-2 J: the minimisers are not unique; whatever CG (or the
    # synchronous rounds, forced) does not certify, solve_nonneg leaves to the other solvers,
    # and the answer is optimal.
    if solver == "sync":
        force_solver(monkeypatch, "sync")
    J = torch.randn(140, 2, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    J = J @ torch.randn(2, 150, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    H = J @ J.T / (J @ J.T).trace()
    x = _nonneg.solve_nonneg(H, H).x
    s = x @ H + H
    assert torch.isfinite(x).all() and (x >= 0).all()
    assert (s >= -1e-10).all()
    assert (x * s).abs().max() < 1e-10


# ---------------------------------------------------------------- the certificate


def test_kkt_residual_and_error_bound() -> None:
    H = random_psd(20, 20, seed=8, ridge=1e-2)
    q = torch.randn(6, 20, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    exact = torch.stack([solve_nonneg_qp(H, row.unsqueeze(0))[0] for row in q])
    assert kkt_residual(H, q, exact).max() < 1e-14
    min_eigenvalue = float(torch.linalg.eigvalsh(H)[0])
    for size in (1e-8, 1e-4, 1e-1):
        noise = torch.randn(q.shape, generator=torch.Generator().manual_seed(10),
                            dtype=torch.float64)
        perturbed = (exact + size * noise).clamp(min=0.0)
        error = torch.linalg.vector_norm(perturbed - exact, dim=-1)
        bound = error_bound(H, q, perturbed, min_eigenvalue)
        assert (error <= bound * (1 + 1e-12)).all()  # NOTE [KKT certificate]: a true bound.
        assert (kkt_residual(H, q, perturbed) > 0).all()
    assert torch.isinf(error_bound(H, q, exact, 0.0)).all()


# ---------------------------------------------------------------- the other weightings


def pcgrad_step_by_step(G: Tensor, orders: Tensor) -> Tensor:
    """The unblocked algorithm: one step per visited row, inner products recomputed in full."""
    m = G.shape[0]
    rows = torch.arange(m)
    coefficients = torch.eye(m, dtype=torch.float64)
    norms = torch.where(G.diagonal() > 0, G.diagonal(), 1.0)
    for step in range(m):
        j = orders[:, step]
        inner = (G[j] * coefficients).sum(dim=1)
        shift = torch.where((j != rows) & (inner < 0), inner / norms[j], 0.0)
        coefficients[rows, j] -= shift
    return coefficients.sum(dim=0)


@pytest.mark.parametrize("block", [1, 7, 64, 500], ids=lambda b: f"block={b}")
def test_blocked_pcgrad_matches_the_step_by_step_algorithm(
    monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    monkeypatch.setattr(_pcgrad, "_BLOCK", block)
    G = gramian(100, "conflicting", seed=11)
    generator = torch.Generator().manual_seed(12)
    orders = torch.stack([torch.randperm(100, generator=generator) for _ in range(100)])
    assert_close(_pcgrad._pcgrad_with_orders(G, orders), pcgrad_step_by_step(G, orders),
                 rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("structure", ["full-rank", "half-rank", "ill-conditioned"])
def test_imtl_g_cholesky_path_is_the_pseudo_inverse(structure: str) -> None:
    G = gramian(200, structure, seed=13)
    norms = G.diagonal().sqrt()
    v = torch.linalg.pinv(G, rtol=200 * torch.finfo(G.dtype).eps) @ norms
    # Both are exact up to about cond(G) · eps: 1e9 · 1e-16 for the ill-conditioned Gramian.
    tol = 1e-5 if structure == "ill-conditioned" else 1e-8
    assert_close(weighting.imtl_g(G), v / v.sum(), rtol=tol, atol=tol * 1e-2)


@pytest.mark.parametrize("structure", ["full-rank", "half-rank", "ill-conditioned"])
def test_mgda_kkt_at_scale(structure: str) -> None:
    G = gramian(256, structure, seed=14)
    w = weighting.mgda(G)
    H = G / G.diagonal().sum()
    hw = H @ w
    value = w @ hw
    assert (w >= 0).all()
    assert_close(w.sum(), torch.tensor(1.0, dtype=torch.float64), rtol=0, atol=1e-12)
    assert (hw >= value - 1e-10).all()
    support = w > 1e-9
    assert (hw[support] - value).abs().max() < 1e-10


@pytest.mark.parametrize("name", ["aligned_mtl", "imtl_g", "pcgrad"])
def test_other_weightings_at_scale_match_torchjd_or_the_reference(name: str) -> None:
    G = gramian(256, "half-rank", seed=15)
    if name == "pcgrad":  # Random orders: the reference algorithm on the same ones.
        generator = torch.Generator().manual_seed(16)
        orders = torch.stack([torch.randperm(256, generator=generator) for _ in range(256)])
        assert_close(_pcgrad._pcgrad_with_orders(G, orders), pcgrad_step_by_step(G, orders),
                     rtol=1e-10, atol=1e-10)
        return
    assert_close(getattr(weighting, name)(G), torchjd_weighting(name)(G), rtol=1e-6, atol=1e-8)
