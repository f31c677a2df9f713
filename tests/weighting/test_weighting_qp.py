"""Tests of the batched QP solvers behind upgrad, dualproj and mgda (``weighting/_qp.py``)."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

import torchgram.weighting as weighting
from torchgram.weighting import _nonneg
from torchgram.weighting import _qp as qp
from torchgram.weighting._dual_cone import normalize_and_regularize
from torchgram.weighting._kkt import kkt_residual
from torchgram.weighting._qp import solve_nonneg_qp, solve_simplex_qp


def random_psd(m: int, rank: int, seed: int, ridge: float = 0.0, spread: float = 1.0) -> Tensor:
    """Trace-normalised J Jᵀ (+ ridge I) with row norms of J spread over 10^±spread."""
    generator = torch.Generator().manual_seed(seed)
    A = torch.randn(m, rank, generator=generator, dtype=torch.float64)
    B = torch.randn(rank, m + 3, generator=generator, dtype=torch.float64)
    J = A @ B
    J = J * torch.logspace(-spread, spread, m, dtype=torch.float64).unsqueeze(1)
    H = J @ J.T
    H = (H + H.T) / 2 / H.diagonal().sum()
    return H + ridge * torch.eye(m, dtype=torch.float64)


def brute_force_nonneg_qp(H: Tensor, q: Tensor) -> Tensor:
    """Exact answer: of the 2^m active sets, the one whose solution violates x, s ≥ 0 least."""
    m = H.shape[0]
    best, best_violation = None, float("inf")
    for free in itertools.product([False, True], repeat=m):
        mask = torch.tensor(free)
        x = torch.zeros(m, dtype=torch.float64)
        if mask.any():
            block = H[mask][:, mask]
            x[mask] = torch.linalg.solve(block, -q[mask])
            # One step of iterative refinement: the oracle's own round-off, not the solver's.
            x[mask] += torch.linalg.solve(block, -q[mask] - block @ x[mask])
        s = H @ x + q
        violation = float(torch.cat([-x, -s]).clamp(min=0).max())
        if violation < best_violation:
            best, best_violation = x, violation
    assert best is not None and best_violation < 1e-12
    return best


def brute_force_simplex_qp(H: Tensor) -> Tensor:
    """Exact minimum of wᵀHw over the simplex by enumerating supports (H positive-definite)."""
    m = H.shape[0]
    best, best_value = None, float("inf")
    for free in itertools.product([False, True], repeat=m):
        mask = torch.tensor(free)
        if not mask.any():
            continue
        a = torch.linalg.solve(H[mask][:, mask], torch.ones(int(mask.sum()), dtype=H.dtype))
        w = torch.zeros(m, dtype=H.dtype)
        w[mask] = a / a.sum()
        value = float(w @ H @ w)
        if (w >= -1e-12).all() and value < best_value:
            best, best_value = w, value
    assert best is not None
    return best


@pytest.mark.parametrize("spread", [1.0, 4.0], ids=lambda s: f"row-norm-spread=1e{s:g}")
@pytest.mark.parametrize("m", [1, 2, 3, 5, 7], ids=lambda m: f"m={m}")
@pytest.mark.parametrize("rank", ["full", "1"], ids=lambda r: f"rank={r}")
def test_nonneg_qp_matches_brute_force(m: int, rank: str, spread: float) -> None:
    H = random_psd(m, m if rank == "full" else 1, seed=m, ridge=1e-4, spread=spread)
    # UPGrad's right-hand sides q = H e_i, plus random ones of both signs.
    generator = torch.Generator().manual_seed(100 + m)
    q = torch.cat([H, torch.randn(4, m, generator=generator, dtype=torch.float64)])
    x = solve_nonneg_qp(H, q)
    expected = torch.stack([brute_force_nonneg_qp(H, row) for row in q])
    assert_close(x, expected, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("m", [2, 3, 5, 7], ids=lambda m: f"m={m}")
def test_simplex_qp_matches_brute_force(m: int) -> None:
    H = random_psd(m, m, seed=m)
    w = solve_simplex_qp(H)
    expected = brute_force_simplex_qp(H)
    assert_close(w @ H @ w, expected @ H @ expected, rtol=1e-10, atol=1e-14)
    assert_close(w, expected, rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize(
    ("m", "rank"),
    [(16, 1), (16, 4), (16, "full"), (64, 4)],
    ids=["m=16-rank=1", "m=16-rank=4", "m=16-rank=full", "m=64-rank=4"],
)
def test_nonneg_qp_kkt_at_scale(m: int, rank: int | str) -> None:
    H = random_psd(m, m if rank == "full" else int(rank), seed=m, ridge=1e-4)
    x = solve_nonneg_qp(H, H)
    s = x @ H + H
    assert (x >= 0).all()
    assert (s >= -1e-12).all()
    assert (x * s).abs().max() < 1e-12


@pytest.mark.parametrize("m", [16, 64], ids=lambda m: f"m={m}")
@pytest.mark.parametrize("rank", [1, 4, "full"], ids=lambda r: f"rank={r}")
def test_simplex_qp_kkt_at_scale(m: int, rank: int | str) -> None:
    H = random_psd(m, m if rank == "full" else int(rank), seed=m)
    w = solve_simplex_qp(H)
    hw = H @ w
    value = w @ hw
    assert (w >= 0).all()
    assert_close(w.sum(), torch.tensor(1.0, dtype=torch.float64), rtol=0, atol=1e-12)
    assert (hw >= value - 1e-10).all()
    support = w > 1e-9
    assert (hw[support] - value).abs().max() < 1e-10


def test_nonneg_qp_chunks_large_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    H = random_psd(12, 6, seed=0, ridge=1e-4)
    whole = solve_nonneg_qp(H, H)
    monkeypatch.setattr(qp, "_MAX_BATCH_ENTRIES", 5 * 12 * 12)  # Chunks of 5, 5 and 2.
    assert_close(solve_nonneg_qp(H, H), whole, rtol=0, atol=1e-14)


def _count_factored_blocks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, the number of blocks each ``_Factors`` factorises (one entry per call)."""
    blocks: list[int] = []
    factors = qp._Factors

    class CountedFactors(factors):  # type: ignore[misc, valid-type]
        def __init__(self, systems: Any, side: str, order: Tensor, valid: Tensor,
                     groups: Any = None) -> None:
            blocks.append(order.shape[0])
            super().__init__(systems, side, order, valid, groups)

    monkeypatch.setattr(qp, "_Factors", CountedFactors)
    return blocks


def test_shared_faces_are_factorised_once_across_the_whole_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [one batch, its faces shared]: from _GATHER_FROM variables on, a bound that would cut
    # the batch into chunks of 16 leaves it whole; a rank-1 Gramian's 64 problems then share
    # their faces in one round (before session 55: 4 chunks, each factorising the same faces).
    m = 64
    H = random_psd(m, 1, seed=3, ridge=1e-4)
    whole = solve_nonneg_qp(H, H)
    rounds = _count_factored_blocks(monkeypatch)
    monkeypatch.setattr(qp, "_MAX_BATCH_ENTRIES", 16 * m * m)
    assert_close(solve_nonneg_qp(H, H), whole, rtol=0, atol=1e-14)
    assert len(rounds) == 1 and rounds[0] <= 2, rounds


@pytest.mark.parametrize("side", ["free", "complement"])
def test_a_round_with_many_faces_runs_in_pieces(monkeypatch: pytest.MonkeyPatch,
                                                side: str) -> None:
    # NOTE [one batch, its faces shared]: a round whose distinct faces exceed _batch_chunk(m)
    # factorises _batch_chunk(m) problems' blocks at a time (the memory bound), with the answers
    # of one batch, on either side of the face systems (a piece through K⁻¹ refines at once).
    monkeypatch.setattr(qp, "_MAX_COMPLEMENT_COND", 1e300 if side == "complement" else 0)
    m = 64
    H = random_psd(m, 32, seed=5, ridge=1e-4)
    whole = solve_nonneg_qp(H, H)
    blocks = _count_factored_blocks(monkeypatch)
    monkeypatch.setattr(qp, "_MAX_BATCH_ENTRIES", 10 * m * m)
    pieces = solve_nonneg_qp(H, H)
    assert blocks and max(blocks) <= 10 and len(blocks) >= 7, blocks
    assert_close(pieces, whole, rtol=0, atol=1e-13 * float(whole.abs().max()))


def test_face_keys_tell_apart_sets_with_equal_index_sums() -> None:
    # Until session 55 the weights were j · c mod 2^40: {0, 3} and {1, 2} had the same key.
    m = 1024
    weights = qp._hash_weights(m, torch.device("cpu"))
    free = torch.zeros(4, m, dtype=torch.bool)
    free[0, [0, 3]] = free[1, [1, 2]] = True
    free[2, [10, 40, 70]] = free[3, [20, 30, 70]] = True
    keys = (free * weights).sum(dim=-1)
    assert keys[0] != keys[1] and keys[2] != keys[3]


def test_colliding_face_keys_run_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [one batch, its faces shared]: a batch is taken whole only where its distinct faces
    # are known exactly; equal keys of unequal sets (forced here) mean pieces, the memory bound.
    m = 64
    monkeypatch.setattr(qp, "_MAX_BATCH_ENTRIES", 10 * m * m)
    free = torch.zeros(40, m, dtype=torch.bool)
    for row in range(40):
        free[row, row:row + 2] = True  # 39 distinct sets, each of two variables
    assert qp._piece_of(free) == 10
    monkeypatch.setattr(qp, "_hash_weights", lambda m, device: torch.ones(m, dtype=torch.long))
    assert qp._piece_of(free) == 10  # one key for all, not one face
    assert qp._piece_of(free[:1].expand(40, m)) == 40  # one face indeed


def test_interior_point_fallback_runs_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fallback's iterations hold [batch, m, m] systems: it runs _batch_chunk(m) problems at
    # a time, with the answers of one batch.
    m = 64
    H = random_psd(m, 32, seed=4, ridge=1e-4)
    for name, value in SOLVER_PATHS["interior-point-only"].items():
        monkeypatch.setattr(qp, name, value)
    whole = solve_nonneg_qp(H, H)
    batches: list[int] = []
    fallback = qp._interior_point_nonneg

    def counted(H: Tensor, q: Tensor) -> Tensor:
        batches.append(q.shape[0])
        return fallback(H, q)

    monkeypatch.setattr(qp, "_interior_point_nonneg", counted)
    monkeypatch.setattr(qp, "_MAX_BATCH_ENTRIES", 20 * m * m)
    chunked = solve_nonneg_qp(H, H)
    assert batches and max(batches) <= 20 and len(batches) >= 2, batches
    assert_close(chunked, whole, rtol=0, atol=1e-12 * float(whole.abs().max()))


@pytest.mark.parametrize("side", ["free", "complement"])
@pytest.mark.parametrize("entries", [1, 3000], ids=["chunks-of-one", "chunks-of-few"])
def test_face_blocks_in_chunks_match_one_batch(monkeypatch: pytest.MonkeyPatch, side: str,
                                               entries: int) -> None:
    # NOTE [face blocks in chunks]: the same solutions (to round-off) as one batched round, on
    # either side of the face systems, at an m where the blocks are gathered.
    monkeypatch.setattr(qp, "_MAX_COMPLEMENT_COND", 1e300 if side == "complement" else 0)
    H = random_psd(64, 32, seed=1, ridge=1e-4)
    whole = solve_nonneg_qp(H, H)
    monkeypatch.setattr(qp, "_MAX_BLOCK_ENTRIES", entries)
    chunked = solve_nonneg_qp(H, H)
    assert_close(chunked, whole, rtol=0, atol=1e-13 * float(whole.abs().max()))


def test_face_blocks_are_padded_by_the_round_not_the_chunk() -> None:
    # A round of many problems gathers its chunks from K padded with the identity, however small
    # each chunk (at m = 256, chunks of 13-16 problems took the masks' way, 1.6 times slower);
    # a round of few problems masks. The blocks are the same either way.
    H = random_psd(16, 16, seed=2, ridge=1e-4)
    order = torch.stack([torch.randperm(16, generator=torch.Generator().manual_seed(i))[:8]
                         for i in range(16)])
    valid = torch.arange(8) < torch.arange(16).remainder(9).unsqueeze(-1)
    masked = qp._FaceSystems(H).blocks("K", order[:2], valid[:2], problems=2)  # 2·8² < 4·16²
    systems = qp._FaceSystems(H)
    padded = systems.blocks("K", order[:2], valid[:2], problems=16)
    assert "K" in systems._padded
    assert torch.equal(padded, masked)
    expected = torch.where(valid[:2].unsqueeze(-1) & valid[:2].unsqueeze(-2),
                           H[order[:2].unsqueeze(-1), order[:2].unsqueeze(-2)],
                           torch.eye(8, dtype=H.dtype))
    assert torch.equal(padded, expected)


def _conflicting_psd(m: int, seed: int) -> Tensor:
    """Rows that pairwise conflict (negative off-diagonal), as per-sample gradients often do at
    initialisation; ``I - 11ᵀ / 2m`` plus a small random Gramian."""
    generator = torch.Generator().manual_seed(seed)
    noise = 0.1 / m**0.5 * torch.randn(m, m, generator=generator, dtype=torch.float64)
    H = torch.eye(m, dtype=torch.float64) - 0.5 / m + noise @ noise.T
    return (H + H.T) / 2 / H.diagonal().sum() + 1e-4 * torch.eye(m, dtype=torch.float64)


@pytest.mark.parametrize("name", ["rank-1", "conflicting", "full-rank", "half-rank"])
def test_cold_start_probe_says_whether_the_default_faces_are_right(name: str) -> None:
    # NOTE [cold start probe]: True iff the probed problems' solutions have the default supports
    # (q_j < 0), checked against the brute-force answers.
    m = 7
    H = {"rank-1": random_psd(m, 1, seed=3, ridge=1e-4), "conflicting": _conflicting_psd(m, 4),
         "full-rank": random_psd(m, m, seed=5, ridge=1e-4),
         "half-rank": random_psd(m, 3, seed=6, ridge=1e-4)}[name]
    probed = torch.linspace(0, m - 1, qp._COLD_PROBES).round().long()
    supports = torch.stack([brute_force_nonneg_qp(H, H[row]) > 0 for row in probed])
    expected = bool(torch.equal(supports, H[probed] < 0))
    assert qp.cold_start_holds(H, H) is expected
    assert expected is (name in ("rank-1", "conflicting"))  # the cases are what they claim


def _forbid_guess_and_cg(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cold start holds: no guess, no CG")

    for skipped in ("admm_faces", "solve_nonneg_qp_sync", "solve_nonneg_qp_cg"):
        monkeypatch.setattr(_nonneg, skipped, forbidden)


@pytest.mark.parametrize("name", ["rank-1", "conflicting"])
def test_upgrad_from_a_cold_start_that_holds(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    # From _COLD_PROBE_FROM variables on, a batch whose probes hold is solved by the direct
    # solver from x = 0, with no guess and no CG rounds; the answers are the same as by the paths
    # it skips, certified by an independent KKT check.
    m = _nonneg._COLD_PROBE_FROM
    H = random_psd(m, 1, seed=7, ridge=1e-4) if name == "rank-1" else _conflicting_psd(m, 8)
    assert qp.cold_start_holds(H, H)
    _forbid_guess_and_cg(monkeypatch)
    solution = _nonneg.solve_nonneg(H, H)
    assert solution.solver == "direct" and (solution.x >= 0).all()
    assert kkt_residual(H, H, solution.x).max() <= 1e-14
    monkeypatch.undo()
    monkeypatch.setattr(_nonneg, "_COLD_PROBE_FROM", 10**9)
    assert_close(solution.x, _nonneg.solve_nonneg(H, H).x, rtol=1e-10, atol=1e-12)


def test_a_cold_start_that_holds_comes_before_the_warm_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # With a WarmStart, a batch whose default faces are right still takes the direct solver from
    # x = 0 (the warm start would send it to the guess: slower there); the state is stored.
    m = _nonneg._COLD_PROBE_FROM
    H = _conflicting_psd(m, 10)
    G = H * 3.0  # upgrad normalises by the trace
    state = weighting.WarmStart()
    first = weighting.upgrad(G, state=state)
    _forbid_guess_and_cg(monkeypatch)
    again = weighting.upgrad(G * 1.01, state=state)
    assert state.solver == "direct" and state.warm_calls == 1
    assert_close(again, first, rtol=1e-12, atol=1e-14)  # the same projections (scale-free)


def test_flat_indices_are_int32_where_they_fit() -> None:
    order = torch.tensor([[0, 2]])
    assert qp._flat_index(order, 46340).dtype == torch.int32  # 46340² < 2³¹
    assert qp._flat_index(order, 46341).dtype == torch.int64


def test_simplex_qp_zero_rows_and_duplicates() -> None:
    # A zero gradient is the min-norm point by itself; duplicated rows make H singular.
    J = torch.tensor([[1.0, 2.0], [0.0, 0.0], [1.0, 2.0], [-1.0, 0.5]], dtype=torch.float64)
    H = J @ J.T / (J @ J.T).trace()
    w = solve_simplex_qp(H)
    assert_close(w @ H @ w, torch.tensor(0.0, dtype=torch.float64), rtol=0, atol=1e-12)
    assert_close(w.sum(), torch.tensor(1.0, dtype=torch.float64))
    J = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    H = J @ J.T / 3
    w = solve_simplex_qp(H)
    assert_close(J.T @ w, torch.tensor([0.5, 0.5], dtype=torch.float64))


# ---------------------------------------------------------------- the solver's paths

# Each path of NOTE [batched QP solver], forced by its module constants: phase 1 alone (no phase
# 2, in the retry either: what phase 1 leaves goes to the interior-point fallback), phase 2
# alone, one exchange step then phase 2, the interior-point fallback alone, the gathered face
# systems at any m, with or without the complement side.
SOLVER_PATHS: dict[str, dict[str, float]] = {
    "default": {},
    "exchange-then-interior-point": {"_DESCENT_ITERATIONS": 0},
    "descent-only": {"_EXCHANGE_ITERATIONS": 0},
    "one-exchange-then-descent": {"_EXCHANGE_ITERATIONS": 1},
    "interior-point-only": {"_EXCHANGE_ITERATIONS": 0, "_DESCENT_ITERATIONS": 0},
    "gathered-faces": {"_GATHER_FROM": 1},
    # NOTE [complement side]: always through K⁻¹ when fewer variables are fixed than free, or
    # never.
    "complement-side": {"_GATHER_FROM": 1, "_MAX_COMPLEMENT_COND": 1e300},
    "free-side-only": {"_GATHER_FROM": 1, "_MAX_COMPLEMENT_COND": 0},
    # NOTE [face blocks in chunks]: one problem per chunk, on either side.
    "free-side-chunks-of-one": {"_GATHER_FROM": 1, "_MAX_COMPLEMENT_COND": 0,
                                "_MAX_BLOCK_ENTRIES": 1},
    "complement-side-chunks-of-one": {"_GATHER_FROM": 1, "_MAX_COMPLEMENT_COND": 1e300,
                                      "_MAX_BLOCK_ENTRIES": 1},
}


@pytest.fixture(params=list(SOLVER_PATHS), ids=list(SOLVER_PATHS))
def solver_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    for name, value in SOLVER_PATHS[request.param].items():
        monkeypatch.setattr(qp, name, value)
    return str(request.param)


@pytest.mark.parametrize("m", [1, 3, 7], ids=lambda m: f"m={m}")
@pytest.mark.parametrize("rank", ["full", "1"], ids=lambda r: f"rank={r}")
def test_every_solver_path_matches_brute_force(solver_path: str, m: int, rank: str) -> None:
    H = random_psd(m, m if rank == "full" else 1, seed=m, ridge=1e-4, spread=4.0)
    generator = torch.Generator().manual_seed(100 + m)
    q = torch.cat([H, torch.randn(4, m, generator=generator, dtype=torch.float64)])
    expected = torch.stack([brute_force_nonneg_qp(H, row) for row in q])
    assert_close(solve_nonneg_qp(H, q), expected, rtol=1e-9, atol=1e-10)
    if m > 1:
        H = random_psd(m, m, seed=m)
        w, w_expected = solve_simplex_qp(H), brute_force_simplex_qp(H)
        assert_close(w @ H @ w, w_expected @ H @ w_expected, rtol=1e-10, atol=1e-14)
        assert_close(w, w_expected, rtol=1e-7, atol=1e-8)


def _forbid_interior_point(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object) -> Tensor:
        raise AssertionError("the interior-point fallback was used")

    monkeypatch.setattr(qp, "_interior_point_nonneg", forbidden)
    monkeypatch.setattr(qp, "_interior_point_simplex", forbidden)


@pytest.mark.parametrize("m", [2, 5, 16, 64], ids=lambda m: f"m={m}")
@pytest.mark.parametrize(
    ("rank", "spread"),
    [("full", 1.0), ("half", 1.0), ("half", 4.0), ("1", 4.0)],
    ids=["rank=full", "rank=half", "rank=half-spread=1e4", "rank=1-spread=1e4"],
)
def test_active_set_method_needs_no_fallback(
    monkeypatch: pytest.MonkeyPatch, m: int, rank: str, spread: float
) -> None:
    # The fast path alone solves these problems (UPGrad's right-hand sides and MGDA's simplex):
    # the interior-point method is a safety net, not the usual route.
    _forbid_interior_point(monkeypatch)
    r = {"full": m, "half": max(m // 2, 1), "1": 1}[rank]
    H = random_psd(m, r, seed=m, ridge=1e-4, spread=spread)
    x = solve_nonneg_qp(H, H)
    s = x @ H + H
    assert (x >= 0).all()
    assert (s >= -1e-12).all()
    assert (x * s).abs().max() < 1e-12
    w = solve_simplex_qp(random_psd(m, r, seed=m, spread=spread))
    assert_close(w.sum(), torch.tensor(1.0, dtype=torch.float64), rtol=0, atol=1e-12)


def test_gathered_and_masked_face_systems_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    H = random_psd(12, 6, seed=1, ridge=1e-4)
    masked = solve_nonneg_qp(H, H)
    monkeypatch.setattr(qp, "_GATHER_FROM", 1)
    gathered = solve_nonneg_qp(H, H)
    # Both are exact to round-off (entries up to about 4, cond(H) about 6e3): the two ways of
    # ordering the factorisations differ by a few ulps of the largest entry (2e-14 measured with
    # torch 2.13's MKL, which the former `atol=1e-14` alone did not allow).
    assert_close(gathered, masked, rtol=1e-13, atol=1e-14)
    assert kkt_residual(H, H, gathered).max() < 1e-15
    assert kkt_residual(H, H, masked).max() < 1e-15


@pytest.mark.parametrize("m", [12, 48], ids=lambda m: f"m={m}")
def test_nonneg_qp_with_singular_h(monkeypatch: pytest.MonkeyPatch, m: int) -> None:
    # reg_eps = 0 with a rank-deficient J: H is singular, so are many face systems, and the
    # minimiser is not unique. The problems are retried with a jitter-shifted H: the answer is
    # finite and optimal (KKT with the exact H) up to the jitter.
    shifts: list[Tensor] = []
    regularizing_shift = qp._regularizing_shift

    def spy(H: Tensor) -> Tensor:
        shifts.append(regularizing_shift(H))
        return shifts[-1]

    monkeypatch.setattr(qp, "_regularizing_shift", spy)
    J = torch.randn(m, 2, generator=torch.Generator().manual_seed(m), dtype=torch.float64)
    J = J @ torch.randn(2, m + 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    H = J @ J.T / (J @ J.T).trace()
    q = torch.cat([H, H.mean(dim=0, keepdim=True)])
    x = solve_nonneg_qp(H, q)
    assert shifts  # The retry was needed.
    s = x @ H + q
    assert torch.isfinite(x).all()
    assert (x >= 0).all()
    assert (s >= -1e-10).all()
    assert (x * s).abs().max() < 1e-10


def _ill_conditioned_simplex(m: int = 128, seed: int = 0) -> Tensor:
    """Trace-normalised Gramian with eigenvalues 1 ... 1e-8 on which the active set runs out."""
    generator = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=generator, dtype=torch.float64))
    A = U * torch.logspace(0, -4, m, dtype=torch.float64)
    H = A @ A.T
    return (H + H.T) / 2 / H.diagonal().sum()


def _simplex_kkt(H: Tensor, w: Tensor) -> float:
    """Largest violation of ``w ≥ 0``, ``Σw = 1``, ``(Hw)_i ≥ wᵀHw`` (= on the support)."""
    hw = H @ w
    s = hw - w @ hw
    return max(float((-w).clamp(min=0).max()), float((w.sum() - 1).abs()),
               float((-s).clamp(min=0).max()), float((w * s).abs().max()))


@pytest.mark.parametrize("structure", ["ill-conditioned", "rank-m/2"])
def test_simplex_qp_goes_to_interior_point_without_a_futile_retry(
        monkeypatch: pytest.MonkeyPatch, structure: str) -> None:
    # NOTE [simplex QP fallback]: from the full face, with every face system positive-definite,
    # an active set that runs out of iterations goes straight to the interior-point method;
    # the shifted retry (and the eigenvalue it needs) would repeat the same steps.
    H = (_ill_conditioned_simplex() if structure == "ill-conditioned"
         else random_psd(128, 64, seed=0))
    # Six exchange steps, as below m = 128: the patient ones solve the ill-conditioned problem
    # (NOTE [exchange while it progresses]); the rank-deficient one runs out either way.
    monkeypatch.setattr(qp, "_PATIENT_EXCHANGE_FROM", 10**9)
    regularizing_shift, interior_point = qp._regularizing_shift, qp._interior_point_simplex
    calls = {"_regularizing_shift": 0, "_active_set": 0, "_interior_point_simplex": 0}
    for name in calls:
        def spy(*args: object, _name: str = name, _f: object = getattr(qp, name)) -> object:
            calls[_name] += 1
            return _f(*args)  # type: ignore[operator]
        monkeypatch.setattr(qp, name, spy)
    w = solve_simplex_qp(H)
    assert calls == {"_regularizing_shift": 0, "_active_set": 1, "_interior_point_simplex": 1}
    assert _simplex_kkt(H, w) < 1e-13
    # The minimiser the previous route gave (shifted systems, all interior-point iterations):
    monkeypatch.setattr(qp, "_IPM_MU_REDUCTION", 0.0)
    previous = interior_point(H, regularizing_shift(H)).squeeze(0)
    assert float((w - previous) @ H @ (w - previous)) < 1e-24  # the same Jᵀw (trace 1)
    assert abs(float(w @ H @ w - previous @ H @ previous)) < 1e-18
    if structure == "ill-conditioned":  # positive-definite: one minimiser, systems of H itself
        assert_close(w, previous, rtol=0, atol=1e-12)


@pytest.mark.parametrize("m", [128, 256], ids=lambda m: f"m={m}")
def test_simplex_qp_exchanges_while_it_progresses(monkeypatch: pytest.MonkeyPatch, m: int) -> None:
    # NOTE [exchange while it progresses]: from m = 128 the exchange steps go on while the wrong
    # signs reach new lows; on these Gramians they end at the solution, where six steps, then
    # the descent phase, ran out and left the problem to the interior-point method.
    H = _ill_conditioned_simplex(m)
    exchanges = {"count": 0}
    solve_face = qp._SimplexQP.solve_face

    def counted(self: object, free: Tensor) -> object:
        exchanges["count"] += 1
        return solve_face(self, free)  # type: ignore[arg-type]

    monkeypatch.setattr(qp._SimplexQP, "solve_face", counted)
    _forbid_interior_point(monkeypatch)
    w = solve_simplex_qp(H)
    assert qp._EXCHANGE_ITERATIONS < exchanges["count"] <= qp._PATIENT_EXCHANGE_ITERATIONS
    assert _simplex_kkt(H, w) < 1e-13
    monkeypatch.undo()
    monkeypatch.setattr(qp, "_PATIENT_EXCHANGE_FROM", 10**9)  # the previous route
    previous = solve_simplex_qp(H)
    # The same minimiser: its face solve carries the jitter (2e-10 at cond 1e8), the previous
    # route's polish solves with H itself.
    assert abs(float(w @ H @ w - previous @ H @ previous)) < 1e-18
    assert_close(w, previous, rtol=0, atol=1e-9)


def test_simplex_qp_fallback_keeps_a_shift_for_a_barely_definite_h(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [simplex QP fallback]: H itself only where H - jitter / 2 I factors (where
    # _regularizing_shift would give zero); a rank-deficient H plus a ridge of a tenth of the
    # jitter factors too, but its faces would be nearly singular: it keeps the jitter.
    H = random_psd(128, 64, seed=0)
    jitter = qp._JITTER * H.diagonal().mean()
    H = H + 0.1 * jitter * torch.eye(128, dtype=H.dtype)
    assert torch.linalg.cholesky_ex(H)[1] == 0
    shifts: list[Tensor] = []
    interior_point = qp._interior_point_simplex

    def spy(H_: Tensor, shift: Tensor) -> Tensor:
        shifts.append(shift)
        return interior_point(H_, shift)

    monkeypatch.setattr(qp, "_interior_point_simplex", spy)
    w = solve_simplex_qp(H)
    assert len(shifts) == 1 and torch.equal(shifts[0], qp._JITTER * H.diagonal())
    assert _simplex_kkt(H, w) < 1e-13


def test_simplex_qp_interior_point_stops_when_converged(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [simplex QP fallback]: the iterations stop once the duality measure is at round-off
    # and the free set is settled, with the answer of all _IPM_ITERATIONS.
    H = _ill_conditioned_simplex()
    steps = {"count": 0}
    mehrotra = qp._mehrotra_step_size

    def counted(*args: object) -> object:
        steps["count"] += 1
        return mehrotra(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(qp, "_mehrotra_step_size", counted)
    shift = qp._regularizing_shift(H)
    early = qp._interior_point_simplex(H, shift).squeeze(0)
    assert steps["count"] < qp._IPM_ITERATIONS
    monkeypatch.setattr(qp, "_IPM_MU_REDUCTION", 0.0)
    full = qp._interior_point_simplex(H, shift).squeeze(0)
    assert _simplex_kkt(H, early) < 1e-13
    assert_close(early, full, rtol=0, atol=1e-12)


def test_full_faces_are_solved_without_the_inverse(monkeypatch: pytest.MonkeyPatch) -> None:
    # Where every variable of every problem is free (MGDA's first face), K's own Cholesky
    # factor solves them: the inverse the complement side would form (twice the work) is not.
    H = random_psd(64, 1, seed=3)  # rank-1: the first face, every variable, is the solution
    monkeypatch.setattr(qp, "_GATHER_FROM", 10**9)  # full masked systems: no complement side
    masked = solve_simplex_qp(H)
    monkeypatch.undo()

    def forbidden(*args: object, **kwargs: object) -> Tensor:
        raise AssertionError("the inverse of K was formed")

    monkeypatch.setattr(torch, "cholesky_inverse", forbidden)
    w = solve_simplex_qp(H)
    assert _simplex_kkt(H, w) < 1e-15
    assert_close(w, masked, rtol=0, atol=1e-14)


def test_simplex_qp_with_indefinite_h() -> None:
    # A rank-deficient Gramian rounded to float32 is indefinite (eigenvalues ~ -1e-8): the
    # face systems fail, and are retried shifted by twice the most negative eigenvalue.
    J = torch.randn(9, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    G = (J @ J.T).float().double()
    H = G / G.trace()
    assert torch.linalg.eigvalsh(H)[0] < 0
    w = solve_simplex_qp(H)
    hw = H @ w
    assert (w >= 0).all()
    assert_close(w.sum(), torch.tensor(1.0, dtype=torch.float64), rtol=0, atol=1e-12)
    assert (hw >= w @ hw - 1e-7).all()


@pytest.mark.parametrize("structure", ["rank-1", "duplicate-rows"])
@pytest.mark.parametrize("name", ["upgrad", "dualproj"])
def test_dual_cone_weightings_without_ridge_on_singular_gramians(name: str, structure: str) -> None:
    # reg_eps = 0 and a rank-deficient Gramian: one of the (many) minimisers, finite, and in
    # the dual cone (the previous, interior-point solver gave NaN weights for upgrad here).
    generator = torch.Generator().manual_seed(3)
    J = torch.randn(12, 5, generator=generator, dtype=torch.float64)
    if structure == "rank-1":
        J = J[:, :1] * J[:1]
    else:
        J = J[torch.arange(12) % 4]
    G = J @ J.T
    w = getattr(weighting, name)(G, reg_eps=0.0)
    assert torch.isfinite(w).all()
    assert (w >= 1 / 12 - 1e-12).all()
    assert (G @ w >= -1e-10 * G.trace()).all()


@pytest.mark.parametrize("seed", range(3))
def test_complement_side_matches_brute_force(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    # Centred rows (every pair of gradients conflicts): nearly every variable is free at the
    # solution, so the face systems go through K⁻¹ and the few fixed ones (NOTE [complement
    # side]), with the default condition-number gate.
    m = 9
    generator = torch.Generator().manual_seed(seed)
    J = torch.eye(m, dtype=torch.float64) - 1.0 / m
    J = J + 0.05 * torch.randn(m, m, generator=generator, dtype=torch.float64)
    H = J @ J.T / (J @ J.T).trace() + 1e-4 * torch.eye(m, dtype=torch.float64)
    monkeypatch.setattr(qp, "_GATHER_FROM", 1)
    sizes: list[int] = []
    complement = qp._solve_by_complement

    def spy(K: Any, inverse: Tensor, faces: Any, b: Tensor, p: int, refine: bool) -> Any:
        sizes.append(p)
        return complement(K, inverse, faces, b, p, refine)

    monkeypatch.setattr(qp, "_solve_by_complement", spy)
    x = solve_nonneg_qp(H, H)
    assert sizes and min(sizes) <= 1  # The complement side ran, with |A| = 1 (or 0).
    expected = torch.stack([brute_force_nonneg_qp(H, row) for row in H])
    assert_close(x, expected, rtol=1e-12, atol=1e-13)
    assert kkt_residual(H, H, x).max() < 1e-14


def _classes_psd(m: int, classes: int, seed: int) -> Tensor:
    """Per-sample-like rows: a mean gradient per class plus a little noise (``classes`` classes,
    round robin), so that problems of one class share their face (NOTE [problems that share a
    face])."""
    generator = torch.Generator().manual_seed(seed)
    means = torch.randn(classes, m + 3, generator=generator, dtype=torch.float64)
    J = means[torch.arange(m) % classes] + 0.05 * torch.randn(m, m + 3, generator=generator,
                                                                dtype=torch.float64)
    H = J @ J.T
    return (H + H.T) / 2 / H.trace() + 1e-4 * torch.eye(m, dtype=torch.float64)


def _grouping_everywhere(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Gathered blocks and grouping from the smallest sizes; returns the (problems, faces) of
    every grouped round."""
    monkeypatch.setattr(qp, "_GATHER_FROM", 1)
    monkeypatch.setattr(qp, "_GROUP_FROM", 2)
    monkeypatch.setattr(qp, "_GROUP_FROM_COST", 0)
    grouped: list[tuple[int, int]] = []
    of = qp._Faces.of.__func__  # type: ignore[attr-defined]

    def spy(cls: type[qp._Faces], free: Tensor, p: int) -> qp._Faces:
        faces = of(cls, free, p)
        if faces.groups is not None:
            grouped.append((free.shape[0], faces.free.shape[0]))
        return faces

    monkeypatch.setattr(qp._Faces, "of", classmethod(spy))
    return grouped


@pytest.mark.parametrize("side", ["free", "complement"])
@pytest.mark.parametrize("seed", range(3))
def test_problems_that_share_a_face_match_brute_force(monkeypatch: pytest.MonkeyPatch,
                                                      side: str, seed: int) -> None:
    # NOTE [problems that share a face]: one block per distinct face, every problem of the face
    # solved with it (right-hand sides side by side): the exact solutions, on either side.
    m = 10
    H = _classes_psd(m, 3, seed)
    monkeypatch.setattr(qp, "_MAX_COMPLEMENT_COND", 1e300 if side == "complement" else 0)
    grouped = _grouping_everywhere(monkeypatch)
    x = solve_nonneg_qp(H, H)
    assert any(faces < problems for problems, faces in grouped)
    expected = torch.stack([brute_force_nonneg_qp(H, row) for row in H])
    assert_close(x, expected, rtol=1e-12, atol=1e-13)
    assert kkt_residual(H, H, x).max() < 1e-14


def test_faces_grouped_by_colliding_keys_are_not_grouped(monkeypatch: pytest.MonkeyPatch) -> None:
    # Keys that collide (all equal here) group nothing: the exact check refuses them.
    m = 10
    H = _classes_psd(m, 3, seed=0)
    expected = solve_nonneg_qp(H, H)
    grouped = _grouping_everywhere(monkeypatch)
    monkeypatch.setattr(qp, "_hash_weights",
                        lambda m, device: torch.zeros(m, dtype=torch.long, device=device))
    x = solve_nonneg_qp(H, H)
    assert not grouped
    assert_close(x, expected, rtol=0, atol=1e-14)


def test_grouped_faces_in_chunks_match_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    # Uneven groups (classes of 3 and 1 problems and more) and factors in chunks of one face.
    m = 64
    H = _classes_psd(m, 7, seed=3)
    _grouping_everywhere(monkeypatch)
    whole = solve_nonneg_qp(H, H)
    monkeypatch.setattr(qp, "_MAX_BLOCK_ENTRIES", 1)
    assert_close(solve_nonneg_qp(H, H), whole, rtol=0, atol=1e-13 * float(whole.abs().max()))
    assert kkt_residual(H, H, whole).max() < 1e-13


@pytest.mark.parametrize("m", [128, 256], ids=lambda m: f"m={m}")
def test_upgrad_on_rank_one_gramians_groups_its_faces(monkeypatch: pytest.MonkeyPatch,
                                                      m: int) -> None:
    # Rank-1 Gramians: two distinct faces for all m problems (measured 4x and 8x faster); the
    # same weights as without grouping, to the solver's accuracy.
    generator = torch.Generator().manual_seed(m)
    a = torch.randn(m, 1, generator=generator, dtype=torch.float64)
    G = a @ a.T
    grouped = torch.zeros((), dtype=torch.bool)
    of = qp._Faces.of.__func__  # type: ignore[attr-defined]

    def spy(cls: type[qp._Faces], free: Tensor, p: int) -> qp._Faces:
        nonlocal grouped
        faces = of(cls, free, p)
        grouped |= faces.groups is not None
        return faces

    monkeypatch.setattr(qp._Faces, "of", classmethod(spy))
    w = weighting.upgrad(G)
    assert grouped
    monkeypatch.setattr(qp, "_GROUP_FROM", m + 1)
    assert_close(w, weighting.upgrad(G), rtol=1e-11, atol=0)


def _counting_corrections(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Complement solves from m = 1 on; returns a list that grows by one per correction made."""
    monkeypatch.setattr(qp, "_GATHER_FROM", 1)
    corrections: list[int] = []
    complement = qp._solve_by_complement

    def spy(*args: Any) -> Any:
        z, ok, correct = complement(*args)
        if correct is None:
            return z, ok, None

        def counted(residual: Tensor) -> Tensor:
            corrections.append(1)
            return correct(residual)

        return z, ok, counted

    monkeypatch.setattr(qp, "_solve_by_complement", spy)
    return corrections


@pytest.mark.parametrize("ridge", [1e-1, 1e-7], ids=["well-conditioned", "ill-conditioned"])
def test_refinement_on_demand_gives_exact_face_solutions(monkeypatch: pytest.MonkeyPatch,
                                                         ridge: float) -> None:
    # NOTE [refinement on demand]: through K⁻¹, the refinement step runs where the residual s_F
    # is above round-off -- not on a well-conditioned H, on an ill-conditioned one -- and the
    # solutions are exact either way.
    m = 9
    generator = torch.Generator().manual_seed(7)
    J = torch.eye(m, dtype=torch.float64) - 1.0 / m  # centred rows: the complement side
    J = J + 0.05 * torch.randn(m, m, generator=generator, dtype=torch.float64)
    J[:, 0] *= 1e3 if ridge < 1e-3 else 1.0  # a direction of much larger curvature
    H = J @ J.T / (J @ J.T).trace() + ridge * torch.eye(m, dtype=torch.float64)
    corrections = _counting_corrections(monkeypatch)
    x = solve_nonneg_qp(H, H)
    assert bool(corrections) == (ridge < 1e-3)
    expected = torch.stack([brute_force_nonneg_qp(H, row) for row in H])
    # The forward error of any solver is up to cond(H) · eps: 1e-9 at cond(H) = 1e7
    assert_close(x, expected, rtol=0, atol=1e-12 if ridge > 1e-3 else 1e-9)
    assert kkt_residual(H, H, x).max() < 1e-15


@pytest.mark.parametrize(("m", "tiny", "scale"), [(8, 1, 1e-20), (16, 1, 1e-15), (96, 4, 1e-20)],
                         ids=["m=8-1e-20", "m=16-1e-15", "m=96-cg-1e-20"])
def test_tiny_rows_without_ridge_are_certified(m: int, tiny: int, scale: float) -> None:
    # NOTE [direct solves in Jacobi units]: a full-rank Gramian (unique answers) with rows of J
    # scaled by 1e-20 and reg_eps = 0. The sign tolerance, relative to a problem's largest |z|
    # (the tiny row's variable: ~1e19), let a free variable of 0.1 end at -6.9e-4; the answers
    # were returned with relative KKT residuals of 1e-3 to 4e-2.
    generator = torch.Generator().manual_seed(0)
    J = torch.randn(m, 2 * m + 2, generator=generator, dtype=torch.float64)
    J[:tiny] *= scale
    H = normalize_and_regularize(J @ J.T, 1e-4, 0.0)
    x = _nonneg.solve_nonneg(H, H.clone()).x  # UPGrad's problems
    assert kkt_residual(H, H, x).max() <= 1e-13
    q = H.mean(dim=0, keepdim=True)  # DualProj's
    assert kkt_residual(H, q, _nonneg.solve_nonneg(H, q).x).max() <= 1e-13


def test_a_zero_row_keeps_its_unit_in_jacobi_units() -> None:
    # A zero row of J (its variable changes nothing) in a rank-deficient Gramian, reg_eps = 0:
    # in Jacobi units, scaled by 1 / sqrt(tiny), its weight came out 1.6e146 (inf, and NaN
    # updates, in float32). The 41st Gramian of a differential fuzz of session 54
    # (m = 106, rank 40, one zero row).
    rng, generator = random.Random(2), torch.Generator().manual_seed(2)
    for _ in range(41):
        m = rng.randint(10, 120)
        n, r = m + rng.randint(0, 2 * m), rng.randint(1, max(1, m // 2))
        J = torch.randn(m, r, generator=generator, dtype=torch.float64) @ torch.randn(
            r, n, generator=generator, dtype=torch.float64)
        J[rng.randrange(m)] = 0.0
    for dtype in (torch.float64, torch.float32):
        w = weighting.upgrad((J @ J.T).to(dtype), reg_eps=0.0)
        assert torch.isfinite(w).all() and w.abs().max() < 1e6
