"""NOTE [singular determinants]: determinants of exactly singular matrices are refused.

The first test checks torch 2.13's behaviour (it fails once torch fixes it, when the refusal
may go); the others check that every API and backend refuses those calls with a torchgram
error, and computes the oracle's matrix everywhere else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch.func import jacfwd, jacrev
from torch.testing import assert_close

import torchgram as tg
from reference import dense_gramian

# torch's first forward-mode derivative in a process loads decompositions that warn
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning")

DTYPE = torch.float64
BACKENDS = ["auto", "jacobian", "ntvp", "graph", "structured"]
SINGULAR = torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=DTYPE)  # rank 1, det exactly 0 in LU
ADJUGATE_T = torch.tensor([[4.0, -2.0], [-2.0, 1.0]], dtype=DTYPE)  # d det / d X there


def test_torch_still_differentiates_det_wrongly_at_a_singular_matrix() -> None:
    """Plain backward and forward mode give 0; only the batched backward is right."""
    X = SINGULAR.clone().requires_grad_()
    (plain,) = torch.autograd.grad(torch.linalg.det(X), X)
    assert torch.equal(plain, torch.zeros_like(X)), "torch fixed det's backward"
    assert torch.equal(jacfwd(torch.linalg.det)(SINGULAR), torch.zeros_like(X))
    assert_close(jacrev(torch.linalg.det)(SINGULAR), ADJUGATE_T)


def _det(p: Tensor, x: Tensor) -> Tensor:
    return torch.linalg.det(torch.diag_embed(p * x) + p[0] * SINGULAR[0, 1])


def _tensor_det(p: Tensor, x: Tensor) -> Tensor:
    return (torch.diag_embed(p * x)).det()


def _slogdet(p: Tensor, x: Tensor) -> Tensor:
    return torch.linalg.slogdet(torch.diag_embed(p * x))[1]


def _logdet(p: Tensor, x: Tensor) -> Tensor:
    return torch.logdet(torch.diag_embed(p * x))


DETERMINANTS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "linalg.det": _det, "Tensor.det": _tensor_det, "slogdet": _slogdet, "logdet": _logdet}


def _inputs(singular: bool) -> tuple[Tensor, Tensor]:
    p = torch.tensor([0.0 if singular else 0.5, 1.0, 1.5], dtype=DTYPE)
    x = torch.linspace(0.5, 2.0, 12, dtype=DTYPE).reshape(4, 3)
    return p, x


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "per-sample"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", DETERMINANTS)
def test_a_determinant_of_a_singular_matrix_is_refused(name: str, backend: str,
                                                        batch_dim: int | None) -> None:
    # diag(0, ...): rank n - 1, where torch's plain backward (the oracle's, structured's and
    # the graph walk's) and forward mode (ntvp's) gave 0 without a word
    gramian = tg.gramian(DETERMINANTS[name], backend=backend, batch_dim=batch_dim)
    with pytest.raises(ValueError, match=r"torchgram.gramian: .*singular determinants"):
        gramian(*_inputs(singular=True))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", DETERMINANTS)
def test_determinants_elsewhere_are_the_oracle_s(name: str, backend: str) -> None:
    f = DETERMINANTS[name]
    args = _inputs(singular=False)
    expected = dense_gramian(f, args).gramian
    assert_close(tg.gramian(f, backend=backend, batch_dim=0)(*args), expected,
                 rtol=1e-10, atol=1e-12)


def test_a_later_call_with_a_singular_matrix_is_refused() -> None:
    # The probe (cached for the signature) saw a determinant of a regular matrix: later
    # evaluations still check theirs
    gramian = tg.gramian(_det, batch_dim=0)
    gramian(*_inputs(singular=False))
    with pytest.raises(ValueError, match="singular determinants"):
        gramian(*_inputs(singular=True))


def test_a_determinant_its_cached_probe_did_not_see_is_checked() -> None:
    use_det = [False]

    def f(p: Tensor, x: Tensor) -> Tensor:
        return _det(p, x) if use_det[0] else (p * x).sum(-1)

    gramian = tg.gramian(f, batch_dim=0)
    gramian(*_inputs(singular=True))
    use_det[0] = True  # NOTE [stale probes]: probed afresh, then checked
    with pytest.raises(ValueError, match="singular determinants"):
        gramian(*_inputs(singular=True))


def test_kernels_and_updates_refuse_singular_determinants() -> None:
    p, x = _inputs(singular=True)
    ntk = tg.ntk.empirical_ntk_fn(lambda params, xs: _det(params, xs), trace_axes=())
    with pytest.raises(ValueError, match="singular determinants"):
        ntk(x, None, p)
    step = tg.aggregated_grad(_det, tg.weighting.mean, batch_dim=0)
    with pytest.raises(ValueError, match="singular determinants"):
        step(p, x)


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "per-sample"])
@pytest.mark.parametrize("recorded", [False, True], ids=["walk", "record"])
@pytest.mark.parametrize("name", DETERMINANTS)
def test_eager_calls_refuse_a_singular_determinant(name: str, recorded: bool,
                                                   batch_dim: int | None) -> None:
    # tg.autograd on a graph built by the caller: the determinant's node says it
    p, x = _inputs(singular=True)
    p.requires_grad_()
    with tg.autograd.record() if recorded else contextlib.nullcontext():
        losses = DETERMINANTS[name](p, x)
    with pytest.raises(ValueError, match=r"torchgram.autograd.gramian: .*singular"):
        tg.autograd.gramian(losses, [p], batch_dim=batch_dim, retain_graph=True)
    with pytest.raises(ValueError, match=r"torchgram.autograd.backward: .*singular"):
        tg.autograd.backward(losses, [p], tg.weighting.mean, batch_dim=batch_dim)
    assert p.grad is None


@pytest.mark.parametrize("recorded", [False, True], ids=["walk", "record"])
def test_eager_determinants_elsewhere_are_the_oracle_s(recorded: bool) -> None:
    p, x = _inputs(singular=False)
    expected = dense_gramian(_det, (p, x)).gramian
    p.requires_grad_()
    with tg.autograd.record() if recorded else contextlib.nullcontext():
        losses = _det(p, x)
    assert_close(tg.autograd.gramian(losses, [p], batch_dim=0), expected, rtol=1e-10,
                 atol=1e-12)
