"""What every step API accepts as a weighting, checked before ``f`` runs (``_api/weights.py``).

torchjd's *aggregators* map a Jacobian to an update; given the square Gramian they returned
``m`` numbers that are not weights, and the update was 2.5 to 17 times off without a word; a
weighting class without ``()`` met torch's ``TypeError`` after four evaluations of ``f``
(session 59's hunt).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import torchgram as tg

torchjd_aggregation = pytest.importorskip("torchjd.aggregation")


def _counted() -> tuple[Callable[[Tensor, Tensor], Tensor], list[int]]:
    calls = [0]

    def f(w: Tensor, x: Tensor) -> Tensor:
        calls[0] += 1
        return torch.tanh(x @ w).sum(1)

    return f, calls


def _step_apis() -> dict[str, Callable[[Callable[..., Tensor], Any], Any]]:
    w, x = torch.randn(3, 2), torch.randn(4, 3)

    def eager(f: Callable[..., Tensor], weighting: Any) -> Any:
        leaf = w.clone().requires_grad_()
        return tg.autograd.backward(f(leaf, x), [leaf], weighting, batch_dim=0)

    return {"aggregated_grad": lambda f, weighting: tg.aggregated_grad(
                f, weighting, batch_dim=0)(w, x),
            "autograd.backward": eager}


WRONG = {
    "upgrad_aggregator": (lambda: torchjd_aggregation.UPGrad(), "UPGradWeighting()"),
    "mean_aggregator": (lambda: torchjd_aggregation.Mean(), "MeanWeighting()"),
    "mgda_aggregator": (lambda: torchjd_aggregation.MGDA(), "MGDAWeighting()"),
    "class_not_instance": (lambda: tg.weighting.WarmStart, "WarmStart()"),
}


@pytest.mark.parametrize("api", list(_step_apis()))
@pytest.mark.parametrize("wrong", list(WRONG))
def test_what_is_no_weighting_is_refused_before_f_runs(wrong: str, api: str) -> None:
    make, fix = WRONG[wrong]
    f, calls = _counted()
    step = _step_apis()[api]
    with pytest.raises(TypeError, match=fix.replace("(", r"\(").replace(")", r"\)")):
        step(f, make())
    assert calls[0] == (1 if api == "autograd.backward" else 0)  # eager: the caller's forward


BAD_WEIGHTS: dict[str, tuple[Callable[[Tensor], Tensor], type[Exception], str]] = {
    "sparse": (lambda G: torch.ones(G.shape[0], dtype=G.dtype).to_sparse(), TypeError,
               r"dense real tensor .* layout torch.sparse_coo\. Return real weights"),
    "complex": (lambda G: torch.ones(G.shape[0], dtype=torch.complex128) * 1j, TypeError,
                r"dense real tensor .* dtype torch.complex128"),
    "other-device": (lambda G: torch.ones(G.shape[0], dtype=G.dtype, device="meta"),
                     ValueError, r"on the Gramian's device \(cpu\), but got weights on meta"),
}


@pytest.mark.parametrize("api", list(_step_apis()))
@pytest.mark.parametrize("weights", list(BAD_WEIGHTS))
def test_weights_that_are_no_dense_real_tensor_on_the_gramians_device(weights: str,
                                                                     api: str) -> None:
    """Sparse or meta weights met torch's raw errors in ``Jᵀw``; complex ones lost their
    imaginary part without a word (an all-zero update for ``1j``; session 67's hunt)."""
    make, error, match = BAD_WEIGHTS[weights]
    f, _ = _counted()
    with pytest.raises(error, match=match):
        _step_apis()[api](f, make)


def test_torchjds_weightings_are_weightings() -> None:
    """``UPGradWeighting()`` maps the Gramian to weights: the same update as ``upgrad``."""
    f, _ = _counted()
    w, x = torch.randn(3, 2, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    ours, _ = tg.aggregated_grad(f, tg.weighting.upgrad, batch_dim=0)(w, x)
    theirs, _ = tg.aggregated_grad(f, torchjd_aggregation.UPGradWeighting(), batch_dim=0)(w, x)
    torch.testing.assert_close(theirs, ours, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("option", ["norm_eps", "reg_eps"])
@pytest.mark.parametrize("value", ["1e-4", None, [1e-4]], ids=["str", "none", "list"])
def test_weighting_options_that_are_no_numbers(option: str, value: Any) -> None:
    G = torch.eye(3, dtype=torch.float64)
    with pytest.raises(TypeError, match=f"expected {option} to be a number"):
        tg.weighting.upgrad(G, **{option: value})


def test_a_0d_tensor_option_reads_as_its_number() -> None:
    G = torch.eye(3, dtype=torch.float64)
    torch.testing.assert_close(tg.weighting.upgrad(G, norm_eps=torch.tensor(1e-4)),
                               tg.weighting.upgrad(G, norm_eps=1e-4))


@pytest.mark.parametrize("api", ["gramian", "aggregated_grad", "ntk"])
def test_a_module_passed_as_f_names_functionalize(api: str) -> None:
    """``tg.gramian(model)`` called ``model(params, x)``: torch's "forward() takes 2
    positional arguments but 3 were given" (session 59's hunt)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    params = {name: value.detach() for name, value in model.named_parameters()}
    x = torch.randn(4, 3)
    calls = {"gramian": lambda: tg.gramian(model, batch_dim=0)(params, x),
             "aggregated_grad": lambda: tg.aggregated_grad(model, tg.weighting.upgrad)(params, x),
             "ntk": lambda: tg.ntk.empirical_ntk_fn(model)(x, None, params)}
    with pytest.raises(TypeError, match="tg.functionalize"):
        calls[api]()


def test_a_stateless_module_with_the_wrong_arity_names_functionalize() -> None:
    with pytest.raises(TypeError, match="tg.functionalize"):
        tg.gramian(torch.nn.ReLU())(torch.randn(3), torch.randn(4, 3))


def test_a_functional_modules_own_bug_comes_back_as_raised() -> None:
    class Functional(torch.nn.Module):
        def forward(self, params: dict[str, Tensor], x: Tensor) -> Tensor:
            return x @ params["missing"]

    with pytest.raises(KeyError, match="missing"):
        tg.gramian(Functional())({"w": torch.randn(3)}, torch.randn(4, 3))
