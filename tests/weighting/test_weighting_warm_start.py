"""Tests of WarmStart: the answer never depends on it; it is used only when it fits the call."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_weighting import make_gramian
from torch import Tensor
from torch.testing import assert_close

import torchgram.weighting as weighting

WARM: dict[str, Callable[..., Tensor]] = {
    "upgrad": weighting.upgrad,
    "dualproj": weighting.dualproj,
    "mgda": weighting.mgda,
}


def training_loop_gramians(m: int, steps: int, seed: int = 0) -> list[Tensor]:
    """Gramians of a slowly moving Jacobian, as consecutive steps of a training loop give."""
    generator = torch.Generator().manual_seed(seed)
    J = torch.randn(m, 2 * m + 3, generator=generator, dtype=torch.float64)
    J[::2] *= -0.5  # Conflicts.
    gramians = []
    for _ in range(steps):
        gramians.append(J @ J.T)
        J = J + 0.02 * torch.randn(J.shape, generator=generator, dtype=torch.float64)
    return [(G + G.T) / 2 for G in gramians]


@pytest.mark.parametrize("m", [12, 150], ids=["m=12-direct", "m=150-cg"])
@pytest.mark.parametrize("name", WARM)
def test_warm_start_gives_the_cold_answer(name: str, m: int) -> None:
    state = weighting.WarmStart()
    gramians = training_loop_gramians(m, 4)
    for G in gramians:
        assert_close(WARM[name](G, state=state), WARM[name](G), rtol=1e-10, atol=1e-12)
    assert (state.calls, state.warm_calls) == (4, 3)
    expected_solver = "cg" if m >= 128 and name == "upgrad" else "direct"
    assert state.solver == expected_solver


@pytest.mark.parametrize("structure", ["full-rank", "half-rank"])
@pytest.mark.parametrize("name", WARM)
def test_warm_start_from_an_unrelated_solution(name: str, structure: str) -> None:
    # A stored solution of the right shape but for another Gramian: a poor start, same answer.
    state = weighting.WarmStart()
    WARM[name](make_gramian(16, "conflicting", seed=1), state=state)
    G = make_gramian(16, structure, seed=2)
    warm, cold = WARM[name](G, state=state), WARM[name](G)
    assert state.warm_calls == 1
    if name == "mgda" and structure == "half-rank":
        # Rank-deficient: the minimiser Jᵀw is unique, w is not (either may come out).
        difference = warm - cold
        assert difference @ G @ difference <= 1e-12 * G.diagonal().sum()
        assert_close(warm @ G @ warm, cold @ G @ cold, rtol=1e-10, atol=1e-14)
    else:
        assert_close(warm, cold, rtol=1e-10, atol=1e-12)


def test_warm_start_ignores_what_does_not_fit() -> None:
    state = weighting.WarmStart()
    weighting.upgrad(make_gramian(8, "conflicting"), state=state)
    weighting.upgrad(make_gramian(5, "conflicting"), state=state)  # Another m (a last batch).
    assert state.warm_calls == 0
    weighting.dualproj(make_gramian(5, "conflicting"), state=state)  # Another weighting.
    assert state.warm_calls == 0
    weighting.dualproj(make_gramian(5, "full-rank"), state=state)
    assert (state.calls, state.warm_calls) == (4, 1)


def test_warm_start_reset_and_repr() -> None:
    state = weighting.WarmStart()
    assert repr(state) == "WarmStart(empty, calls=0, warm_calls=0, solver=None, iterations=0)"
    weighting.upgrad(make_gramian(4, "conflicting"), state=state)
    assert repr(state).startswith("WarmStart(upgrad [4, 4], calls=1")
    state.reset()
    assert repr(state) == "WarmStart(empty, calls=0, warm_calls=0, solver=None, iterations=0)"
    weighting.upgrad(make_gramian(4, "conflicting"), state=state)
    assert state.warm_calls == 0


def test_warm_start_with_an_empty_gramian() -> None:
    state = weighting.WarmStart()
    for name in WARM:
        assert WARM[name](torch.zeros(0, 0), state=state).shape == (0,)


@pytest.mark.parametrize("name", WARM)
def test_state_must_be_a_warm_start(name: str) -> None:
    with pytest.raises(TypeError, match=rf"^torchgram\.weighting\.{name}: expected state to be "
                                        r"a torchgram\.weighting\.WarmStart or None, got dict"):
        WARM[name](torch.eye(2), state={})


def test_warm_start_keeps_no_autograd_graph() -> None:
    state = weighting.WarmStart()
    G = make_gramian(6, "conflicting").requires_grad_()
    weighting.upgrad(G, state=state)
    assert state._solution is not None and not state._solution.requires_grad


def test_a_poor_warm_start_is_not_used() -> None:
    # Per problem, the stored solution is the start only where it is closer to the new solution
    # than zero is (smaller KKT violations, NOTE [KKT certificate]).
    from torchgram.weighting._dual_cone import normalize_and_regularize
    from torchgram.weighting._nonneg import _better_start, solve_nonneg

    H = normalize_and_regularize(make_gramian(10, "conflicting", seed=6), 1e-4, 1e-4)
    solution = solve_nonneg(H, H).x
    far = torch.full_like(solution, 100.0)
    x0 = torch.cat([solution[:5], far[5:]])
    start, free = _better_start(H, H, x0)
    assert torch.equal(start[:5], solution[:5]) and torch.equal(free[:5], solution[:5] > 0)
    assert (start[5:] == 0).all() and torch.equal(free[5:], H[5:] < 0)
