"""Tests of the ADMM face identification (``weighting/_admm.py``) in front of the direct solver.

The guess only chooses where the direct solver's active-set method starts: the answers are the
direct solver's (exact face solves, sign-checked), certified here by an independent KKT check,
equal to those of the direct solver started from its default faces, and torchjd's; a bad or
failed guess costs rounds, never accuracy.
"""

from __future__ import annotations

import pytest
import torch
from test_weighting import make_gramian, torchjd_weighting
from test_weighting_qp import brute_force_nonneg_qp, random_psd
from test_weighting_scale import gramian
from torch import Tensor
from torch.testing import assert_close

import torchgram.weighting as weighting
from torchgram.weighting import _admm, _nonneg, _qp
from torchgram.weighting._admm import admm_faces
from torchgram.weighting._dual_cone import normalize_and_regularize
from torchgram.weighting._kkt import KKT_TOL, kkt_residual
from torchgram.weighting._qp import solve_nonneg_qp


def training_like(m: int, seed: int) -> Tensor:
    """Rows of low rank plus noise, with norms over two orders of magnitude (late training)."""
    generator = torch.Generator().manual_seed(seed)
    rank = max(m // 4, 1)
    J = (torch.randn(m, rank, generator=generator, dtype=torch.float64)
         @ torch.randn(rank, 3 * m, generator=generator, dtype=torch.float64)
         + 0.1 * torch.randn(m, 3 * m, generator=generator, dtype=torch.float64))
    norms = torch.logspace(0, -2, m, dtype=torch.float64)[torch.randperm(m, generator=generator)]
    J = J * norms.unsqueeze(-1)
    G = J @ J.T
    return (G + G.T) / 2


def family(m: int, name: str, seed: int) -> Tensor:
    if name == "training-like":
        return training_like(m, seed)
    return gramian(m, name, seed=seed)


FAMILIES = ["full-rank", "rank-1", "half-rank", "ill-conditioned", "training-like"]


@pytest.mark.parametrize("m", [3, 7], ids=lambda m: f"m={m}")
@pytest.mark.parametrize("rank", ["full", "1"], ids=lambda r: f"rank={r}")
def test_guessed_faces_lead_to_the_brute_force_answers(m: int, rank: str) -> None:
    H = random_psd(m, m if rank == "full" else 1, seed=m, ridge=1e-4, spread=2.0)
    generator = torch.Generator().manual_seed(300 + m)
    q = torch.cat([H, torch.randn(4, m, generator=generator, dtype=torch.float64)])
    expected = torch.stack([brute_force_nonneg_qp(H, row) for row in q])
    free = admm_faces(H, q)
    assert free.shape == q.shape and free.dtype == torch.bool
    assert_close(solve_nonneg_qp(H, q, free), expected, rtol=1e-9, atol=1e-10)
    # On these small well-separated problems the guess is the solution's support.
    assert torch.equal(free[:m], expected[:m] > 0) or rank == "1"


@pytest.mark.parametrize("m", [32, 40, 64, 128], ids=lambda m: f"m={m}")
@pytest.mark.parametrize("name", FAMILIES)
def test_upgrad_through_guessed_faces_is_exact(monkeypatch: pytest.MonkeyPatch, m: int,
                                               name: str) -> None:
    G = family(m, name, seed=m + 3)
    H = normalize_and_regularize(G, 1e-4, 1e-4)
    if name == "full-rank" and m >= _nonneg._SYNC_FROM:  # Else the synchronous rounds run.
        monkeypatch.setattr(_nonneg, "_SYNC_FROM", 10**9)
    # Else rank-1 Gramians start from x = 0 (NOTE [cold start probe], test_weighting_qp.py)
    monkeypatch.setattr(_nonneg, "_COLD_PROBE_FROM", 10**9)
    calls: list[int] = []

    def counted(H: Tensor, q: Tensor, x0: Tensor | None = None) -> Tensor:
        calls.append(q.shape[0])
        return _admm.admm_faces(H, q, x0)

    monkeypatch.setattr(_nonneg, "admm_faces", counted)
    solution = _nonneg.solve_nonneg(H, H)
    assert calls == [m] and solution.solver == "direct"
    assert (solution.x >= 0).all()
    # The direct solver's exact face solves: round-off, far below the certificate.
    assert kkt_residual(H, H, solution.x).max() <= 1e-14 < KKT_TOL
    # The same answers as the direct solver from its default faces (x = 0).
    assert_close(solution.x, solve_nonneg_qp(H, H), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", FAMILIES)
def test_upgrad_through_guessed_faces_matches_torchjd(name: str) -> None:
    G = family(48, name, seed=7)
    reference = torchjd_weighting("upgrad")
    state = weighting.WarmStart()
    assert_close(weighting.upgrad(G, state=state), reference(G), rtol=1e-9, atol=1e-10)
    assert state.solver == "direct"


@pytest.mark.parametrize("guess", ["none-free", "all-free", "complement", "random"])
def test_bad_guesses_cost_rounds_not_accuracy(monkeypatch: pytest.MonkeyPatch,
                                              guess: str) -> None:
    G = make_gramian(50, "half-rank", seed=8)
    H = normalize_and_regularize(G, 1e-4, 1e-4)
    expected = solve_nonneg_qp(H, H)
    generator = torch.Generator().manual_seed(9)

    def bad(H: Tensor, q: Tensor, x0: Tensor | None = None) -> Tensor:
        if guess == "none-free":
            return torch.zeros_like(q, dtype=torch.bool)
        if guess == "all-free":
            return torch.ones_like(q, dtype=torch.bool)
        if guess == "complement":
            return expected <= 0
        return torch.rand(q.shape, generator=generator, dtype=q.dtype) < 0.5

    monkeypatch.setattr(_nonneg, "admm_faces", bad)
    solution = _nonneg.solve_nonneg(H, H)
    assert_close(solution.x, expected, rtol=1e-10, atol=1e-12)
    assert kkt_residual(H, H, solution.x).max() <= KKT_TOL


def test_a_failed_factorisation_guesses_nothing() -> None:
    # Indefinite (not a Gramian), or zero: the shared inverse does not exist, no free set.
    H = torch.tensor([[1.0, 0.0], [0.0, -1.0]], dtype=torch.float64)
    free = admm_faces(H, torch.tensor([[-1.0, 1.0]], dtype=torch.float64))
    assert free.shape == (1, 2) and not free.any()
    assert not admm_faces(torch.zeros(3, 3, dtype=torch.float64),
                          torch.zeros(2, 3, dtype=torch.float64)).any()


@pytest.mark.parametrize("m", [40, 200], ids=lambda m: f"m={m}")
def test_zero_gramians_through_guessed_faces(m: int) -> None:
    # H = 0 (reg_eps = 0) or a multiple of the identity: uniform weights, as without the guess.
    G = torch.zeros(m, m, dtype=torch.float64)
    for kwargs in ({}, {"reg_eps": 0.0}, {"reg_eps": 0.0, "norm_eps": 0.0}):
        assert_close(weighting.upgrad(G, **kwargs), torch.full((m,), 1.0 / m,
                                                               dtype=torch.float64))


@pytest.mark.parametrize("reg_eps", [0.0, 1e-4], ids=["reg=0", "reg=1e-4"])
def test_singular_gramians_through_guessed_faces(monkeypatch: pytest.MonkeyPatch,
                                                 reg_eps: float) -> None:
    # A zero row and duplicates: H singular for reg_eps = 0 (ρ stays positive).
    G = make_gramian(40, "half-rank", seed=10)
    G[3] = 0.0
    G[:, 3] = 0.0
    state = weighting.WarmStart()
    w = weighting.upgrad(G, reg_eps=reg_eps, state=state)
    assert state.solver == "direct" and state._solution is not None
    assert torch.isfinite(w).all() and (w >= 1 / 40 - 1e-15).all()
    H = normalize_and_regularize(G, 1e-4, reg_eps)
    # With reg_eps = 0 the singular faces are solved shifted by the jitter (NOTE [batched QP
    # solver]): about 6e-13 here, with or without the guess.
    assert kkt_residual(H, H, state._solution).max() <= (KKT_TOL if reg_eps else 1e-11)
    # The same as without the guess; for reg_eps = 0, where the minimiser need not be unique,
    # the same G w (J Jᵀ w, the update's conflicts with the rows, is).
    monkeypatch.setattr(_nonneg, "_ADMM_FROM", 10**9)
    plain = weighting.upgrad(G, reg_eps=reg_eps)
    if reg_eps:
        assert_close(plain, w, rtol=1e-9, atol=1e-11)
    else:
        assert_close(G @ plain, G @ w, rtol=1e-9, atol=1e-11 * float(G.diagonal().sum()))


def test_warm_started_guesses(monkeypatch: pytest.MonkeyPatch) -> None:
    G = family(64, "training-like", seed=11)
    state = weighting.WarmStart()
    cold = weighting.upgrad(G, state=state)
    starts: list[Tensor | None] = []

    def recorded(H: Tensor, q: Tensor, x0: Tensor | None = None) -> Tensor:
        starts.append(x0)
        return _admm.admm_faces(H, q, x0)

    monkeypatch.setattr(_nonneg, "admm_faces", recorded)
    rounds: list[int] = []
    solve_face = _qp._NonnegQP.solve_face

    def counted(self: _qp._NonnegQP, free: Tensor) -> tuple[Tensor, ...]:
        rounds.append(free.shape[0])
        return solve_face(self, free)

    monkeypatch.setattr(_qp._NonnegQP, "solve_face", counted)
    again = weighting.upgrad(G, state=state)  # The same Gramian: one round, from the solution.
    assert starts[-1] is not None and len(rounds) == 1
    assert_close(again, cold, rtol=0, atol=1e-15)
    nearby = G + 1e-3 * family(64, "training-like", seed=12)
    warm = weighting.upgrad(nearby, state=state)
    assert_close(warm, weighting.upgrad(nearby), rtol=1e-10, atol=1e-12)
