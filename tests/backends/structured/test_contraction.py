"""Gram blocks of materialized uses by column chunks (NOTE [Gram by column chunks])."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from helpers import flat_gramian, make_problem
from reference import dense_gramian
from torchgram.backends.structured import backend, run_structured
from torchgram.backends.structured.contraction import (
    Contraction,
    Factor,
    UseFactors,
    chunked_gram,
    gram_of_rows,
    materialize_use,
)
from torchgram.backends.structured.rules.base import UseShape
from torchgram.backends.structured.workspace import Workspace
from zoo import NAMES, build

DOUBLE = torch.float64


def _dense_use(rows, samples, positions, groups, i, j, act_first, *, interleaved=False):
    act = torch.randn(samples, positions, groups, j, dtype=DOUBLE)
    cot = torch.randn(rows, samples, positions, groups, i, dtype=DOUBLE)
    if interleaved:  # position-major storage, as a recurrent net's taps
        cot = cot.transpose(1, 2).contiguous().transpose(1, 2)
        act = act.transpose(0, 1).contiguous().transpose(0, 1)
    use = SimpleNamespace(role="weight", shape=UseShape(positions, groups, j, i),
                          layout=SimpleNamespace())
    factors = (UseFactors(Factor(act, "act"), Factor(cot, "cot")) if act_first
               else UseFactors(Factor(cot, "cot"), Factor(act, "act")))
    return use, factors, groups * i * j


def _lookup_use(rows, samples, positions, classes, dim, index_first):
    index = torch.randint(0, classes, (samples, positions))
    cot = torch.randn(rows, samples, positions, 1, dim, dtype=DOUBLE)
    use = SimpleNamespace(role="weight", shape=UseShape(positions, 1, classes, dim,
                                                        act_is_index=True),
                          layout=SimpleNamespace())
    factors = (UseFactors(Factor(index, "index"), Factor(cot, "cot")) if index_first
               else UseFactors(Factor(cot, "cot"), Factor(index, "index")))
    return use, factors, classes * dim


CASES = {
    "one-group": lambda: _dense_use(1, 4, 6, 1, 5, 7, act_first=False),
    "one-group-act-first": lambda: _dense_use(1, 4, 6, 1, 5, 7, act_first=True),
    "rows-and-groups": lambda: _dense_use(2, 3, 2, 2, 5, 3, act_first=False),
    "interleaved": lambda: _dense_use(1, 3, 5, 1, 9, 6, act_first=False, interleaved=True),
    "lookup": lambda: _lookup_use(2, 3, 4, 7, 5, index_first=True),
    "lookup-transposed": lambda: _lookup_use(1, 3, 4, 7, 5, index_first=False),
}


@pytest.mark.parametrize("workspace", [False, True])
@pytest.mark.parametrize("diagonal", [False, True])
@pytest.mark.parametrize("max_bytes", [1, 8 * 3 * 7, 8 * 41, None, 2**30])
@pytest.mark.parametrize("case", list(CASES))
def test_chunked_gram_is_the_gram_of_the_whole_jacobian(case, max_bytes, diagonal, workspace):
    """Chunks of one column up to all of them, non-divisors included: the same block."""
    torch.manual_seed(0)
    use, factors, numel = CASES[case]()
    whole = gram_of_rows(materialize_use(use, factors, numel), diagonal)
    chunked = chunked_gram(factors, use.shape.act_width, diagonal, max_bytes,
                           Workspace() if workspace else None)
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_chunks_stay_within_their_bound(case):
    """The workspace holds one chunk of the Jacobian at a time, never the whole of it."""
    use, factors, numel = CASES[case]()
    whole = materialize_use(use, factors, numel)
    bound = 48 * 8  # a few columns of every case
    assert whole.numel() * whole.element_size() > 2 * bound
    workspace = Workspace()
    chunked_gram(factors, use.shape.act_width, False, bound, workspace)
    assert workspace._buffer is not None and 0 < workspace._buffer.numel() <= bound


def test_chunked_gram_is_differentiable_without_the_workspace():
    use, factors, numel = _dense_use(1, 3, 4, 1, 5, 6, act_first=False)
    leaves = [factors.first.tensor.requires_grad_(), factors.second.tensor.requires_grad_()]
    chunked = chunked_gram(factors, use.shape.act_width, False, 8 * 3 * 6, Workspace())
    whole = gram_of_rows(materialize_use(use, factors, numel), False)
    for got, want in zip(torch.autograd.grad(chunked.square().sum(), leaves),
                         torch.autograd.grad(whole.square().sum(), leaves), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", [name for name in NAMES if build(name).batch_dim is not None])
def test_tiny_chunks_match_oracle_on_zoo(name, monkeypatch):
    """Every materialized leaf of the zoo contracted a few columns at a time."""
    monkeypatch.setattr(backend, "Contraction",
                        functools.partial(Contraction, max_jacobian_bytes=64))
    case = build(name)
    expected = dense_gramian(case.f, case.args).gramian
    for diagonal in (False, True):
        problem = make_problem(case.f, case.args, batch_dim=case.batch_dim,
                               in_dims=case.in_dims, diagonal=diagonal)
        actual = flat_gramian(problem, run_structured(problem, force="materialize"))
        want = expected.diagonal() if diagonal else expected
        scale = want.abs().max().clamp_min(1.0)
        torch.testing.assert_close(actual / scale, want / scale, rtol=1e-10, atol=1e-10)


def _offset_positions(batch: int, steps: int, width: int, dtype: torch.dtype,
                      offset: float) -> tuple[dict[str, torch.Tensor], torch.Tensor,
                                              torch.Tensor]:
    """Inputs sharing an offset over positions, cotangents summing to zero over them."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(width, width, generator=generator, dtype=dtype) / width ** 0.5
    x = offset + 0.01 * torch.randn(batch, steps, width, generator=generator, dtype=dtype)
    g = torch.randn(batch, steps, width, generator=generator, dtype=dtype)
    return {"W": weight}, x, g - g.mean(1, keepdim=True)


def _weighted_outputs(p: dict[str, torch.Tensor], x: torch.Tensor,
                      g: torch.Tensor) -> torch.Tensor:
    return ((x @ p["W"].T) * g).sum((1, 2))  # per sample: Σ_t ⟨g_t, W x_t⟩


@pytest.mark.parametrize("diagonal", [True, False], ids=["diagonal", "full"])
def test_ghost_forms_of_offset_inputs_keep_float32_accuracy(diagonal: bool) -> None:
    """NOTE [centered positions]: per-sample squared norms 8.8e-2 off (relative) in float32
    where float32 jacrev is 2.2e-6 off (session 67's hunt); full blocks 0.27 off at an offset
    of 1000 spreads."""
    steps, width, offset = (8, 64, 10.0) if diagonal else (2, 256, 10.0)
    params, x, g = _offset_positions(16, steps, width, torch.float32, offset)
    exact = dense_gramian(_weighted_outputs, ({"W": params["W"].double()}, x.double(),
                                              g.double())).gramian
    problem = make_problem(_weighted_outputs, (params, x, g), batch_dim=0, diagonal=diagonal)
    got = flat_gramian(problem, run_structured(problem, force="ghost"))
    if diagonal:
        exact = exact.diagonal()
        error = ((got.double() - exact).abs() / exact.abs()).max()
    else:
        error = (got.double() - exact).abs().max() / exact.abs().max()
    assert error < 2e-5, error


def test_centered_positions_are_exact() -> None:
    """NOTE [centered positions]: the identity holds in any arithmetic (float64 here)."""
    params, x, g = _offset_positions(6, 5, 8, torch.float64, 10.0)
    exact = dense_gramian(_weighted_outputs, (params, x, g)).gramian
    for diagonal in (True, False):
        problem = make_problem(_weighted_outputs, (params, x, g), batch_dim=0,
                               diagonal=diagonal)
        got = flat_gramian(problem, run_structured(problem, force="ghost"))
        torch.testing.assert_close(got, exact.diagonal() if diagonal else exact, rtol=1e-10,
                                   atol=1e-12)


def test_float16_ghost_forms_stay_finite() -> None:
    """Session 67's review of NOTE [centered positions]: a float16 factor's norm overflowed,
    its share read NaN and the use was centered, whose sums of the positions overflowed: inf
    where the plain ghost form is 1e-4 off. float16 is never centered."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 4096, generator=generator, dtype=torch.float64) / 64
    x = torch.randn(2, 16, 4096, generator=generator, dtype=torch.float64)
    g = 0.01 * torch.randn(16, 256, generator=generator, dtype=torch.float64)

    def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.linear(x, p["W"]) * g.to(x.dtype)).sum((1, 2))

    exact = dense_gramian(f, ({"W": weight}, x)).gramian
    problem = make_problem(f, ({"W": weight.half()}, x.half()), batch_dim=0)
    got = flat_gramian(problem, run_structured(problem, force="ghost")).double()
    assert bool(got.isfinite().all())
    assert (got - exact).abs().max() / exact.abs().max() < 1e-3
