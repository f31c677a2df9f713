"""Tests of torchgram.weighting: reference agreement, hand-derived answers, optimality, errors."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypedDict

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

import torchgram.weighting as weighting

Weighting = Callable[..., Tensor]


class Tolerance(TypedDict):
    rtol: float
    atol: float


ALL: dict[str, Weighting] = {
    "mean": weighting.mean,
    "sum": weighting.sum,
    "mgda": weighting.mgda,
    "upgrad": weighting.upgrad,
    "dualproj": weighting.dualproj,
    "imtl_g": weighting.imtl_g,
    "pcgrad": weighting.pcgrad,
    "aligned_mtl": weighting.aligned_mtl,
}

# Agreement with torchjd: the contract is 1e-5 in both dtypes (measured: ~1e-12 in float64,
# ~5e-7 in float32 for upgrad/dualproj).
REFERENCE_TOL: dict[torch.dtype, Tolerance] = {
    torch.float64: {"rtol": 1e-5, "atol": 1e-5},
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
}
# Hand-derived answers and properties that hold exactly in exact arithmetic.
EXACT_TOL: dict[torch.dtype, Tolerance] = {
    torch.float64: {"rtol": 1e-9, "atol": 1e-9},
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
}
DTYPES = [torch.float64, torch.float32]
DTYPE_IDS = ["float64", "float32"]


def make_gramian(
    m: int, structure: str, dtype: torch.dtype = torch.float64, seed: int = 0
) -> Tensor:
    """A random Gramian J Jᵀ (computed in float64, exactly symmetric) with a given structure.

    ``structure`` is ``"full-rank"``, ``"rank-1"``, ``"half-rank"``, ``"rank-<r>"``,
    ``"duplicate-rows"`` (about m / 3 distinct rows) or ``"conflicting"`` (rows sharing a large
    common component, every other one flipped: many pairwise conflicts).
    """
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    n = 2 * m + 3
    if structure == "full-rank":
        J = randn(m, n)
    elif structure == "half-rank":
        J = randn(m, max(m // 2, 1)) @ randn(max(m // 2, 1), n)
    elif structure.startswith("rank-"):
        rank = int(structure.removeprefix("rank-"))
        J = randn(m, rank) @ randn(rank, n)
    elif structure == "duplicate-rows":
        base = randn(max(m // 3, 1), n)
        J = base[torch.randint(0, base.shape[0], (m,), generator=generator)]
    elif structure == "conflicting":
        J = randn(m, n) + 3.0 * randn(1, n)
        J[::2] *= -1.0
    else:
        raise AssertionError(structure)
    G = J @ J.T
    return ((G + G.T) / 2).to(dtype)


STRUCTURES = ("full-rank", "half-rank", "rank-1", "duplicate-rows", "conflicting")
CASES = (
    [(1, "full-rank")]
    + [(m, structure) for m in (2, 5, 16) for structure in STRUCTURES]
    + [(64, structure) for structure in ("full-rank", "half-rank", "duplicate-rows")]
)


def _random_cases(count: int, seed: int) -> list[tuple[int, str]]:
    """Seeded draws of m in [1, 64] and a rank in [1, m]."""
    generator = torch.Generator().manual_seed(seed)
    cases = []
    for _ in range(count):
        m = int(torch.randint(1, 65, (), generator=generator))
        cases.append((m, f"rank-{int(torch.randint(1, m + 1, (), generator=generator))}"))
    return cases


CASES += _random_cases(6, seed=2024)
CASE_IDS = [f"m={m}-{structure}" for m, structure in CASES]
# For property tests, where the m = 64 cases would add time but no coverage.
SMALL_CASES = [(m, structure) for m, structure in CASES if m <= 16] + [(64, "half-rank")]
SMALL_CASE_IDS = [f"m={m}-{structure}" for m, structure in SMALL_CASES]


def torchjd_weighting(name: str) -> Callable[[Tensor], Tensor]:
    """The torchjd weighting that ours must match, or skip when torchjd (or quadprog) is absent."""
    aggregation = pytest.importorskip("torchjd.aggregation")
    if name in ("upgrad", "dualproj"):  # torchjd's default QuadprogProjector needs these.
        pytest.importorskip("qpsolvers")
        pytest.importorskip("quadprog")
    factories: dict[str, Callable[[], Any]] = {
        "upgrad": aggregation.UPGradWeighting,
        "dualproj": aggregation.DualProjWeighting,
        "imtl_g": aggregation.IMTLGWeighting,
        "mgda": aggregation.MGDAWeighting,
        "pcgrad": aggregation.PCGradWeighting,
        "aligned_mtl": aggregation.AlignedMTLWeighting,
    }
    reference: Callable[[Tensor], Tensor] = factories[name]()
    return reference


# ---------------------------------------------------------------- agreement with torchjd


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("m", "structure"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("name", ["upgrad", "dualproj"])
def test_dual_cone_weightings_match_torchjd(
    name: str, m: int, structure: str, dtype: torch.dtype
) -> None:
    G = make_gramian(m, structure, dtype, seed=m)
    expected = torchjd_weighting(name)(G)
    assert_close(ALL[name](G), expected, **REFERENCE_TOL[dtype])


@pytest.mark.parametrize(("m", "structure"), CASES, ids=CASE_IDS)
def test_imtl_g_matches_torchjd(m: int, structure: str) -> None:
    G = make_gramian(m, structure, torch.float64, seed=m)
    assert_close(
        weighting.imtl_g(G), torchjd_weighting("imtl_g")(G), **REFERENCE_TOL[torch.float64]
    )


@pytest.mark.parametrize("m", [1, 2, 5, 16, 64], ids=lambda m: f"m={m}")
def test_imtl_g_float32_matches_torchjd_in_float64(m: int) -> None:
    # torchjd inverts a float32 Gramian in float32 (errors ~ cond(G) * 6e-8); we invert in
    # float64, so our float32 answer is compared with torchjd's on the same values in float64.
    G = make_gramian(m, "full-rank", torch.float32, seed=m)
    expected = torchjd_weighting("imtl_g")(G.double()).float()
    assert_close(weighting.imtl_g(G), expected, **REFERENCE_TOL[torch.float32])


@pytest.mark.parametrize("scale_mode", ["min", "median", "rmse"])
@pytest.mark.parametrize(("m", "structure"), CASES, ids=CASE_IDS)
def test_aligned_mtl_matches_torchjd(m: int, structure: str, scale_mode: Any) -> None:
    aggregation = pytest.importorskip("torchjd.aggregation")
    G = make_gramian(m, structure, torch.float64, seed=m)
    expected = aggregation.AlignedMTLWeighting(scale_mode=scale_mode)(G)
    actual = weighting.aligned_mtl(G, scale_mode=scale_mode)
    assert_close(actual, expected, **REFERENCE_TOL[torch.float64])


@pytest.mark.parametrize("seed", range(4))
def test_pcgrad_matches_torchjd_when_order_is_irrelevant(seed: int) -> None:
    # With two rows each row has a single other row to visit, so the random order is moot.
    G = make_gramian(2, "conflicting", seed=seed)
    assert_close(weighting.pcgrad(G), torchjd_weighting("pcgrad")(G), **EXACT_TOL[torch.float64])


@pytest.mark.parametrize(("m", "structure"), CASES, ids=CASE_IDS)
def test_mgda_is_never_worse_than_torchjd_frank_wolfe(m: int, structure: str) -> None:
    G = make_gramian(m, structure, seed=m)
    ours = weighting.mgda(G)
    frank_wolfe = torchjd_weighting("mgda")(G)
    scale = G.diagonal().sum()
    assert ours @ G @ ours <= frank_wolfe @ G @ frank_wolfe + 1e-10 * scale


# ---------------------------------------------------------------- MGDA optimality


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("m", "structure"), CASES, ids=CASE_IDS)
def test_mgda_satisfies_kkt_conditions(m: int, structure: str, dtype: torch.dtype) -> None:
    G = make_gramian(m, structure, dtype, seed=100 + m)
    w = weighting.mgda(G)
    assert w.dtype == dtype
    tol = {torch.float64: 1e-9, torch.float32: 1e-5}[dtype]
    G, w = G.double(), w.double()
    scale = float(G.diagonal().sum())
    gw = G @ w
    norm2 = w @ gw
    assert (w >= 0).all()
    assert_close(w.sum(), torch.tensor(1.0, dtype=torch.float64), rtol=0, atol=tol)
    # (G w)_i ≥ wᵀGw for all i, with equality on the support of w.
    assert (gw >= norm2 - tol * scale).all()
    support = w > tol
    assert_close(gw[support], norm2.expand(int(support.sum())), rtol=0, atol=tol * scale)


def test_mgda_rows_of_norms_spread_over_ten_decades_give_the_closed_form() -> None:
    """NOTE [jitter in each row's units]: three tasks' gradients of norms 1e-5, 1 and 1e5; the
    min-norm point lies on the segment of the first two (closed form). Before session 57 a
    jitter relative to the trace swamped the small rows: Jᵀw was 290 times too long."""
    J = torch.randn(3, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    J = J * torch.tensor([1e-5, 1.0, 1e5], dtype=torch.float64)[:, None]
    g0, g1 = J[0], J[1]
    t = float((g0 - g1) @ g0 / ((g0 - g1) @ (g0 - g1)))
    expected = torch.tensor([1 - t, t, 0.0], dtype=torch.float64)
    assert 0 < t < 1 and float((J @ (J.T @ expected))[2] - expected @ J @ J.T @ expected) > 0
    w = weighting.mgda(J @ J.T)
    assert_close(J.T @ w, J.T @ expected, rtol=1e-9, atol=0)


@pytest.mark.parametrize("m", [8, 64, 200, 600])
def test_mgda_on_graded_rows_is_never_worse_than_a_vertex(m: int) -> None:
    """The optimum is at most ``min_i G_ii`` (the vertex of the shortest row), whatever the
    spread of the rows' norms (here 1e-6 to 1e6): 1e7 to 1e9 times above it before session 57."""
    J = torch.randn(m, 3 * m, dtype=torch.float64, generator=torch.Generator().manual_seed(m))
    J = J * torch.logspace(-6, 6, m, dtype=torch.float64)[:, None]
    G = J @ J.T
    w = weighting.mgda(G)
    assert float(w @ G @ w) <= float(G.diagonal().min())


@pytest.mark.parametrize("m", [64, 256])
def test_mgda_on_a_graded_rank_deficient_float32_gramian(m: int) -> None:
    """Indefinite by float32 round-off: the retry's shift, in each row's units now, left the
    short rows alone (up to 9e5 times the shortest row's vertex before; a review's find)."""
    J = torch.randn(m, m // 4, dtype=torch.float64, generator=torch.Generator().manual_seed(m))
    J = J * torch.logspace(-5, 5, m, dtype=torch.float64)[:, None]
    G = (J @ J.T).float()
    w = weighting.mgda(G).double()
    G = G.double()
    assert float(w @ G @ w) <= float(G.diagonal().min())


def test_mgda_with_a_zero_row_returns_its_vertex() -> None:
    G = torch.diag(torch.tensor([1.0, 0.0, 2.0, 0.0], dtype=torch.float64))
    assert_close(weighting.mgda(G), torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64),
                 rtol=0, atol=0)


def _pinv_weights_in_fifty_digits(G: torch.Tensor) -> torch.Tensor:
    """IMTL-G's weights through the pseudo-inverse with torch's cut-off, in 50 digits."""
    import mpmath

    mpmath.mp.dps = 50
    m = G.shape[0]
    eigenvalues, vectors = mpmath.eigsy(mpmath.matrix(G.tolist()))
    cut = m * torch.finfo(torch.float64).eps * max(abs(e) for e in eigenvalues)
    norms = mpmath.matrix([mpmath.sqrt(G[i, i].item()) for i in range(m)])
    v = mpmath.matrix(m, 1)
    for j in range(m):
        if abs(eigenvalues[j]) > cut:
            v += vectors[:, j] * ((vectors[:, j].T * norms)[0] / eigenvalues[j])
    total = sum(v)
    return torch.tensor([float(v[i] / total) for i in range(m)], dtype=torch.float64)


@pytest.mark.parametrize("m", [16, 33])
def test_imtl_g_on_graded_rows_near_the_cut_off(m: int) -> None:
    """Rows of norms 1e-6 to 1e6: eigenvalues near the pseudo-inverse's cut-off, where the
    eigendecomposition lost the small ones' vectors (1e-4 to 2e-2 off before session 57; the
    SVD, as torchjd's, 1e-10 to 2e-7)."""
    J = torch.randn(m, 2 * m, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    G = J * torch.logspace(-6, 6, m, dtype=torch.float64)[:, None]
    G = G @ G.T
    exact = _pinv_weights_in_fifty_digits(G)
    assert float((weighting.imtl_g(G) - exact).abs().max() / exact.abs().max()) < 1e-6


def test_mgda_hand_derived() -> None:
    # Orthogonal rows of norms 1 and 2: w ∝ 1 / |g_i|².
    assert_close(
        weighting.mgda(torch.diag(torch.tensor([1.0, 4.0], dtype=torch.float64))),
        torch.tensor([0.8, 0.2], dtype=torch.float64),
        **EXACT_TOL[torch.float64],
    )
    # Opposite rows g, -g: the hull contains 0, reached at (1/2, 1/2).
    G = torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=torch.float64)
    assert_close(
        weighting.mgda(G), torch.tensor([0.5, 0.5], dtype=torch.float64), **EXACT_TOL[torch.float64]
    )
    # g2 = 2 g1: the min-norm point is g1 itself.
    G = torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=torch.float64)
    assert_close(
        weighting.mgda(G), torch.tensor([1.0, 0.0], dtype=torch.float64), **EXACT_TOL[torch.float64]
    )
    # An acute triangle whose min-norm point is interior: rows e1, e2, e3 of R³ → 1/3 each.
    assert_close(
        weighting.mgda(torch.eye(3, dtype=torch.float64)),
        torch.full((3,), 1 / 3, dtype=torch.float64),
        **EXACT_TOL[torch.float64],
    )


# ---------------------------------------------------------------- UPGrad / DualProj by hand


@pytest.mark.parametrize("name", ["upgrad", "dualproj"])
@pytest.mark.parametrize(
    "G",
    [
        torch.diag(torch.tensor([1.0, 4.0, 0.25], dtype=torch.float64)),
        torch.full((4, 4), 2.0, dtype=torch.float64),
        torch.tensor([[1.0, 0.5], [0.5, 1.0]], dtype=torch.float64),
    ],
    ids=["orthogonal-rows", "identical-rows", "acute-rows"],
)
def test_dual_cone_weightings_without_conflict_are_uniform(name: str, G: Tensor) -> None:
    # No row conflicts with another: every projection is the identity and w = 1/m exactly,
    # whatever the regularisation (the constraints v ≥ u are active).
    m = G.shape[0]
    assert_close(ALL[name](G), torch.full((m,), 1 / m, dtype=G.dtype), **EXACT_TOL[G.dtype])


def test_upgrad_two_conflicting_rows() -> None:
    # g1 = (1, 0), g2 = (-1, 1). Projecting g1: v = (1, x) minimising |g1 + x g2|² gives x = 1/2;
    # projecting g2: v = (y, 1) minimising |y g1 + g2|² gives y = 1. Mean: (1, 3/4).
    J = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
    w = weighting.upgrad(J @ J.T, reg_eps=0.0)
    assert_close(w, torch.tensor([1.0, 0.75], dtype=torch.float64), **EXACT_TOL[torch.float64])
    assert (J @ (J.T @ w) >= -1e-12).all()


@pytest.mark.parametrize("reg_eps", [1e-4, 0.1], ids=lambda r: f"reg_eps={r}")
def test_upgrad_opposite_rows_closed_form(reg_eps: float) -> None:
    # G = [[1, -1], [-1, 1]] is normalised to G / 2. Projecting g1: v = (1, t) minimises
    # (1 - t)² / 2 + reg (1 + t²), so t = 1 / (1 + 2 reg); by symmetry w_1 = w_2 = (1 + t) / 2.
    # (With reg_eps = 0 every v = (t, t), t ≥ 1, is a minimiser: the ridge makes it unique.)
    G = torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=torch.float64)
    t = 1.0 / (1.0 + 2.0 * reg_eps)
    expected = torch.full((2,), (1.0 + t) / 2.0, dtype=torch.float64)
    assert_close(weighting.upgrad(G, reg_eps=reg_eps), expected, **EXACT_TOL[torch.float64])


def test_dualproj_two_conflicting_rows() -> None:
    # The mean of g1 = (1, 0) and g2 = (-2, 1) is (-1/2, 1/2); it conflicts with g1 only, and its
    # projection (0, 1/2) = 1 * g1 + 1/2 * g2.
    J = torch.tensor([[1.0, 0.0], [-2.0, 1.0]], dtype=torch.float64)
    assert_close(
        weighting.dualproj(J @ J.T, reg_eps=0.0),
        torch.tensor([1.0, 0.5], dtype=torch.float64),
        **EXACT_TOL[torch.float64],
    )


@pytest.mark.parametrize("name", ["upgrad", "dualproj"])
@pytest.mark.parametrize(("m", "structure"), SMALL_CASES, ids=SMALL_CASE_IDS)
def test_dual_cone_weightings_do_not_conflict(name: str, m: int, structure: str) -> None:
    # Jᵀw is in the dual cone of the rows of J: (G w)_i ≥ 0, up to the ridge reg_eps, which
    # shifts the constraints by reg_eps * trace(G) * w_i.
    G = make_gramian(m, structure, seed=7 * m)
    w = ALL[name](G)
    assert (w >= 1 / m - 1e-12).all()
    slack = 1e-4 * G.diagonal().sum() * w + 1e-10 * G.diagonal().sum()
    assert (G @ w >= -slack).all()
    w_exact = ALL[name](G, reg_eps=0.0) if structure == "full-rank" else None
    if w_exact is not None:
        assert (G @ w_exact >= -1e-9 * G.diagonal().sum()).all()


def test_upgrad_treats_a_tiny_trace_as_zero() -> None:
    G = torch.diag(torch.tensor([1e-5, 2e-5, 3e-5], dtype=torch.float64)) - 1e-6
    assert_close(weighting.upgrad(G), torch.full((3,), 1 / 3, dtype=torch.float64))
    assert not torch.allclose(weighting.upgrad(G, norm_eps=0.0), weighting.upgrad(G))


# ---------------------------------------------------------------- IMTL-G by hand


def test_imtl_g_hand_derived() -> None:
    # Orthogonal rows of norms 1 and 2: G w ∝ (1, 2) gives w ∝ (1, 1/2).
    G = torch.diag(torch.tensor([1.0, 4.0], dtype=torch.float64))
    assert_close(
        weighting.imtl_g(G),
        torch.tensor([2 / 3, 1 / 3], dtype=torch.float64),
        **EXACT_TOL[torch.float64],
    )
    # Identical rows (rank one): uniform.
    G = torch.full((3, 3), 4.0, dtype=torch.float64)
    assert_close(
        weighting.imtl_g(G),
        torch.full((3,), 1 / 3, dtype=torch.float64),
        **EXACT_TOL[torch.float64],
    )


@pytest.mark.parametrize("G", [torch.zeros(3, 3, dtype=torch.float64),
                               torch.tensor([[5.0, -5.0], [-5.0, 5.0]], dtype=torch.float64)],
                         ids=["zero", "opposite-rows"])
def test_imtl_g_without_eps_gives_zeros_where_the_sum_vanishes(G: Tensor) -> None:
    """``eps=0``: an exactly zero ``Σ v`` gave NaN or infinite weights (session 58's hunt)."""
    assert_close(weighting.imtl_g(G, eps=0.0), torch.zeros(G.shape[0], dtype=torch.float64),
                 **EXACT_TOL[torch.float64])


@pytest.mark.parametrize("m", [2, 5, 16], ids=lambda m: f"m={m}")
def test_imtl_g_equalises_projections(m: int) -> None:
    G = make_gramian(m, "full-rank", seed=m)
    w = weighting.imtl_g(G)
    projections = (G @ w) / G.diagonal().sqrt()  # ⟨Jᵀw, g_i / |g_i|⟩
    assert_close(projections, projections[:1].expand(m), **EXACT_TOL[torch.float64])
    assert_close(w.sum(), torch.tensor(1.0, dtype=torch.float64))


# ---------------------------------------------------------------- PCGrad


def pcgrad_on_vectors(J: Tensor, orders: Tensor) -> Tensor:
    """Algorithm 1 of Yu et al. (2020) on the gradients themselves, as in torchjd."""
    projected = []
    for i in range(J.shape[0]):
        g = J[i].clone()
        for j in orders[i].tolist():
            if j != i and g @ J[j] < 0:
                g = g - (g @ J[j]) / (J[j] @ J[j]) * J[j]
        projected.append(g)
    return torch.stack(projected).sum(dim=0)


@pytest.mark.parametrize("structure", ["full-rank", "conflicting", "duplicate-rows"])
@pytest.mark.parametrize("m", [3, 8], ids=lambda m: f"m={m}")
def test_pcgrad_matches_the_vector_algorithm(m: int, structure: str) -> None:
    from torchgram.weighting._pcgrad import _pcgrad_with_orders

    generator = torch.Generator().manual_seed(m)
    J = torch.randn(m, 7, generator=generator, dtype=torch.float64)
    if structure == "conflicting":
        J[::2] = -J[::2] + 0.1
    elif structure == "duplicate-rows":
        J[m // 2 :] = J[: m - m // 2].clone()
    orders = torch.stack([torch.randperm(m, generator=generator) for _ in range(m)])
    w = _pcgrad_with_orders(J @ J.T, orders)
    assert_close(J.T @ w, pcgrad_on_vectors(J, orders), **EXACT_TOL[torch.float64])


def test_pcgrad_hand_derived_and_reproducible() -> None:
    J = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
    # g1 - (g1·g2 / |g2|²) g2 = g1 + g2/2 and g2 - (g2·g1 / |g1|²) g1 = g1 + g2.
    expected = torch.tensor([2.0, 1.5], dtype=torch.float64)
    assert_close(weighting.pcgrad(J @ J.T), expected, **EXACT_TOL[torch.float64])
    G = make_gramian(12, "conflicting", seed=3)
    first = weighting.pcgrad(G, generator=torch.Generator().manual_seed(5))
    again = weighting.pcgrad(G, generator=torch.Generator().manual_seed(5))
    assert torch.equal(first, again)
    # No conflict at all (G ≥ 0 entrywise): every row is kept as is.
    G = make_gramian(6, "rank-1", seed=1).abs()
    assert_close(weighting.pcgrad(G), torch.ones(6, dtype=torch.float64))


# ---------------------------------------------------------------- Aligned-MTL by hand


@pytest.mark.parametrize(
    ("scale_mode", "expected"),
    [
        ("min", [0.5, 0.25]),
        ("median", [0.5, 0.25]),
        ("rmse", [math.sqrt(2.5) / 2, math.sqrt(2.5) / 4]),
    ],
)
def test_aligned_mtl_hand_derived(scale_mode: Any, expected: list[float]) -> None:
    # Orthogonal rows of norms 1 and 2, eigenvalues 1 and 4: B = sqrt(λ_s) diag(1, 1/2).
    # The lower median of {1, 4} is 1, the mean 2.5.
    G = torch.diag(torch.tensor([1.0, 4.0], dtype=torch.float64))
    actual = weighting.aligned_mtl(G, scale_mode=scale_mode)
    assert_close(actual, torch.tensor(expected, dtype=torch.float64), **EXACT_TOL[torch.float64])


# ---------------------------------------------------------------- common contract


ZERO_GRAMIAN_WEIGHTS = {
    "mean": 1 / 3,
    "sum": 1.0,
    "mgda": 1 / 3,
    "upgrad": 1 / 3,
    "dualproj": 1 / 3,
    "imtl_g": 0.0,
    "pcgrad": 1.0,
    "aligned_mtl": 1 / 3,
}


@pytest.mark.parametrize("name", ALL)
def test_zero_gramian(name: str) -> None:
    G = torch.zeros(3, 3)
    assert_close(ALL[name](G), torch.full((3,), ZERO_GRAMIAN_WEIGHTS[name]))


@pytest.mark.parametrize("name", ["upgrad", "dualproj"])
def test_zero_gramian_without_norm_eps(name: str) -> None:
    # trace(G) = 0 is never divided by, even when norm_eps = 0 (and with no ridge either).
    expected = torch.full((3,), 1 / 3, dtype=torch.float64)
    assert_close(ALL[name](torch.zeros(3, 3, dtype=torch.float64), norm_eps=0.0), expected)
    zero = torch.zeros(3, 3, dtype=torch.float64)
    assert_close(ALL[name](zero, norm_eps=0.0, reg_eps=0.0), expected)


@pytest.mark.parametrize(
    "G",
    [
        torch.diag(torch.tensor([3e38, 1e38], dtype=torch.float32)),
        torch.diag(torch.tensor([1e-300, 3e-300], dtype=torch.float64)),
    ],
    ids=["near-float32-max", "near-float64-min"],
)
@pytest.mark.parametrize("name", ALL)
def test_extreme_scales_give_finite_weights(name: str, G: Tensor) -> None:
    assert torch.isfinite(ALL[name](G)).all()


@pytest.mark.parametrize("name", ALL)
def test_single_loss(name: str) -> None:
    # One loss: every method returns the gradient itself.
    w = ALL[name](torch.tensor([[2.5]], dtype=torch.float64))
    assert_close(w, torch.tensor([1.0], dtype=torch.float64))


@pytest.mark.parametrize("name", ALL)
def test_no_losses(name: str) -> None:
    w = ALL[name](torch.zeros(0, 0))
    assert w.shape == (0,)
    assert w.dtype == torch.float32


@pytest.mark.parametrize(
    "dtype",
    [torch.float64, torch.float32, torch.float16, torch.bfloat16],
    ids=["float64", "float32", "float16", "bfloat16"],
)
@pytest.mark.parametrize("name", ALL)
def test_dtype_shape_and_device_follow_the_gramian(name: str, dtype: torch.dtype) -> None:
    G = make_gramian(5, "conflicting", seed=2)
    w = ALL[name](G.to(dtype))
    assert w.shape == (5,)
    assert w.dtype == dtype
    assert w.device == G.device
    assert torch.isfinite(w).all()
    # Low precision only rounds the Gramian: the answer is that of the rounded Gramian in float64,
    # except for pcgrad (random) and for the rank cut-offs of imtl_g and aligned_mtl, which are
    # relative to eps(G.dtype) on purpose (m * eps(bfloat16) = 4%).
    if name != "pcgrad" and not (name in ("imtl_g", "aligned_mtl") and dtype == torch.bfloat16):
        reference = ALL[name](G.to(dtype).double())
        assert_close(w.double(), reference, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name", ALL)
def test_input_is_not_modified(name: str) -> None:
    # A G that requires grad gives weights whose derivative through G raises (but mean's and
    # sum's): test_weighting_derivatives.py.
    G = make_gramian(4, "conflicting", seed=9).requires_grad_()
    before = G.detach().clone()
    torch.manual_seed(0)  # pcgrad's order
    w = ALL[name](G)
    assert torch.equal(G.detach(), before)
    torch.manual_seed(0)
    assert torch.equal(w.detach(), ALL[name](before))


@pytest.mark.parametrize("name", ["mgda", "upgrad", "dualproj", "imtl_g", "aligned_mtl"])
def test_scale_invariance(name: str) -> None:
    # UPGrad and DualProj normalise by the trace (above norm_eps); MGDA's minimiser and IMTL-G's
    # normalised weights do not depend on the scale; Aligned-MTL's B is homogeneous of degree 0.
    G = make_gramian(6, "conflicting", seed=4)
    assert_close(ALL[name](1e3 * G), ALL[name](G), rtol=1e-7, atol=1e-9)


# ---------------------------------------------------------------- errors


BAD_GRAMIANS = [
    pytest.param(
        torch.ones(3, 4), r"square symmetric \[m, m\] Gramian, got shape \(3, 4\)", id="non-square"
    ),
    pytest.param(torch.ones(3), r"square symmetric \[m, m\] Gramian, got shape \(3,\)", id="1-D"),
    pytest.param(torch.ones(2, 2, 2), r"got shape \(2, 2, 2\)", id="3-D"),
    pytest.param(
        torch.tensor([[1.0, 0.5], [0.0, 1.0]]), r"got max \|G - G.T\| = 0.5", id="asymmetric"
    ),
    pytest.param(torch.tensor([[1.0, float("nan")], [float("nan"), 1.0]]),
                 "finite entries, got NaN values", id="nan"),
    pytest.param(torch.tensor([[float("inf"), 0.0], [0.0, 1.0]]),  # G's float32 overflowed
                 "finite entries, got infinite values.* overflow of G's torch.float32", id="inf"),
    pytest.param(
        torch.tensor([[1.0, 0.0], [0.0, -1.0]]), "negative diagonal", id="negative-diagonal"
    ),
    pytest.param(  # eigenvalues 3 and -1: no J has it as J Jᵀ (was weighted without a word)
        torch.tensor([[1.0, 2.0], [2.0, 1.0]]), r"\|G\[0, 1\]\| = 2 above sqrt", id="indefinite"
    ),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rank_deficient_gramians_in_float32_are_accepted(dtype: torch.dtype) -> None:
    """Duplicated and opposite rows meet ``|G[i, j]| = sqrt(G[i, i] G[j, j])`` exactly, up to
    round-off: the Cauchy-Schwarz check leaves them (and their round-off) alone."""
    torch.manual_seed(0)
    J = torch.randn(6, 50, dtype=dtype) * torch.logspace(-3, 3, 6, dtype=dtype)[:, None]
    J[1], J[2], J[4] = J[0], -3 * J[0], 1e-4 * J[3]
    for name in ALL:
        assert ALL[name](J @ J.T).isfinite().all()


@pytest.mark.parametrize(("G", "message"), BAD_GRAMIANS)
@pytest.mark.parametrize("name", ALL)
def test_invalid_gramian_raises_value_error(name: str, G: Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=rf"^torchgram\.weighting\.{name}: expected .*{message}"):
        ALL[name](G)


def test_error_message_explains_what_to_pass() -> None:
    with pytest.raises(ValueError, match=r"Pass G = J @ J\.T"):
        weighting.upgrad(torch.ones(3, 4))


def test_small_asymmetry_is_tolerated() -> None:
    G = make_gramian(4, "full-rank", torch.float32, seed=0)
    G = G + 1e-6 * G.abs().amax() * torch.triu(torch.ones(4, 4), diagonal=1)
    assert weighting.upgrad(G).shape == (4,)


@pytest.mark.parametrize(
    "G", [[[1.0, 0.0], [0.0, 1.0]], torch.eye(2, dtype=torch.int64)], ids=["list", "int64"]
)
@pytest.mark.parametrize("name", ALL)
def test_non_float_tensor_raises_type_error(name: str, G: Any) -> None:
    with pytest.raises(TypeError, match=rf"^torchgram\.weighting\.{name}: expected"):
        ALL[name](G)


@pytest.mark.parametrize(
    ("layout", "to_layout"),
    [(torch.sparse_coo, torch.Tensor.to_sparse), (torch.sparse_csr, torch.Tensor.to_sparse_csr)],
    ids=["coo", "csr"],
)
@pytest.mark.parametrize("name", ALL)
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_gramian_raises_type_error(name: str, layout: torch.layout,
                                          to_layout: Any) -> None:
    """A sparse Gramian: a torchgram error saying to densify (was torch's raw NotImplementedError
    from ``amax`` on the sparse backend)."""
    G = to_layout(make_gramian(3, "full-rank", torch.float64, seed=0))
    with pytest.raises(TypeError, match=rf"^torchgram\.weighting\.{name}: expected a dense "
                                        rf"Gramian .*got layout {layout}.*to_dense"):
        ALL[name](G)


@pytest.mark.parametrize("name", ALL)
def test_meta_gramian_raises_value_error(name: str) -> None:
    """A Gramian on the meta device has no values: a torchgram error (was torch's raw
    ``Cannot copy out of meta tensor``)."""
    with pytest.raises(ValueError, match=rf"^torchgram\.weighting\.{name}: expected a Gramian "
                                         r"with values, .* meta device"):
        ALL[name](torch.eye(3, device="meta"))


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("upgrad", {"norm_eps": -1.0}, r"a finite norm_eps >= 0, got -1\.0"),
        ("upgrad", {"reg_eps": -1e-4}, r"a finite reg_eps >= 0, got -0\.0001"),
        ("dualproj", {"reg_eps": float("nan")}, r"a finite reg_eps >= 0, got nan"),
        ("imtl_g", {"eps": -1.0}, r"a finite eps >= 0, got -1\.0"),
        ("aligned_mtl", {"scale_mode": "max"}, r"scale_mode to be one of .*got 'max'"),
    ],
    ids=["upgrad-norm_eps", "upgrad-reg_eps", "dualproj-reg_eps-nan", "imtl_g-eps", "scale_mode"],
)
def test_invalid_options_raise_value_error(
    name: str, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=rf"^torchgram\.weighting\.{name}: expected {message}"):
        ALL[name](torch.eye(2), **options)


def test_invalid_generator_raises_type_error() -> None:
    with pytest.raises(TypeError, match=r"^torchgram\.weighting\.pcgrad: expected generator"):
        weighting.pcgrad(torch.eye(2), generator=42)  # type: ignore[arg-type]


# Public names of torchgram.weighting that are not weightings.
NOT_WEIGHTINGS = ["WarmStart"]


def test_public_names() -> None:
    assert sorted(set(weighting.__all__) - set(NOT_WEIGHTINGS)) == sorted(ALL)
    assert set(NOT_WEIGHTINGS) <= set(weighting.__all__)
    for name in weighting.__all__:
        assert getattr(weighting, name).__doc__


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", ["upgrad", "dualproj", "mgda", "aligned_mtl"])
def test_scale_invariant_weightings_near_the_largest_float(name: str, dtype: torch.dtype) -> None:
    # A finite G whose trace (or m · λ_max) overflows: the answer of G scaled down, not the
    # uniform weights of a zero G (session 54: [0.5, 0.5] for [0.99985, 0.74996])
    J = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
    G = (J @ J.T).to(dtype)
    huge = G * (torch.finfo(dtype).max / 2.5)
    assert torch.isfinite(huge).all() and not torch.isfinite(huge.diagonal().sum())
    weighting_fn = getattr(weighting, name)
    assert_close(weighting_fn(huge), weighting_fn(G), rtol=1e-6 if dtype == torch.float32
                 else 1e-12, atol=0)


@pytest.mark.parametrize("option", ["norm_eps", "reg_eps"])
def test_an_infinite_eps_is_refused(option: str) -> None:
    # reg_eps = inf gave NaN weights or a raw LinAlgError, depending on m
    with pytest.raises(ValueError, match=rf"weighting.upgrad: expected a finite {option}"):
        weighting.upgrad(torch.eye(3), **{option: float("inf")})
