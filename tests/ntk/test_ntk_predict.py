"""``torchgram.ntk.gradient_descent_mse`` and ``kernel_regression`` against neural-tangents.

Every prediction stored in tests/data/nt_reference (float64): both trace settings, three
settings of learning rate and regularization, finite times (a scalar, a vector), infinite
time, train-only and zero initial outputs; kernel regression against NT's ``gp_inference``
mean.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

import torchgram as tg

DATA = Path(__file__).resolve().parents[1] / "data" / "nt_reference"
META = json.loads(DATA.with_suffix(".json").read_text())
with np.load(DATA.with_suffix(".npz")) as _data:
    ARRAYS = {key: torch.from_numpy(_data[key]) for key in _data.files}
GD = [e for e in META["predict"] if e["key"].startswith("predict.gd.")]
GP = [e for e in META["predict"] if e["key"].startswith("predict.gp.")]


def _value(reference: Any, like: tuple[int, ...] | None = None) -> Any:
    if reference is None or isinstance(reference, float):
        return reference
    if reference == "zeros":
        assert like is not None
        return torch.zeros(like, dtype=torch.float64)
    return ARRAYS[reference]


@pytest.mark.parametrize("entry", GD, ids=[e["key"] for e in GD])
def test_gradient_descent_mse_matches_neural_tangents(entry: dict[str, Any]) -> None:
    predict_fn = tg.ntk.gradient_descent_mse(
        ARRAYS[entry["k_train_train"]], ARRAYS[entry["y_train"]],
        learning_rate=entry["learning_rate"], diag_reg=entry["diag_reg"],
        diag_reg_absolute_scale=entry["diag_reg_absolute_scale"],
        trace_axes=tuple(entry["trace_axes"]))
    fx_test_0 = _value(entry["fx_test_0"], tuple(entry.get("test_shape", ()))[-2:] or None)
    t = entry["t"]
    out = predict_fn(t=ARRAYS[t] if isinstance(t, str) else t,
                     fx_train_0=_value(entry["fx_train_0"]), fx_test_0=fx_test_0,
                     k_test_train=None if fx_test_0 is None else ARRAYS[entry["k_test_train"]])
    names = ["train", "test"] if fx_test_0 is not None else ["train"]
    outs = out if isinstance(out, tuple) else (out,)
    assert len(outs) == len(names)
    for name, value in zip(names, outs, strict=True):
        expected = ARRAYS[f"{entry['key']}.{name}"]
        assert list(value.shape) == entry[f"{name}_shape"]
        torch.testing.assert_close(value, expected, rtol=1e-10,
                                   atol=1e-12 * max(1.0, expected.abs().max().item()))


@pytest.mark.parametrize("entry", [e for e in GP if e["diag_reg"] == 0
                                   or e["diag_reg_absolute_scale"]],
                         ids=lambda e: e["key"])
def test_kernel_regression_is_the_gp_mean(entry: dict[str, Any]) -> None:
    trace = "trace_none" if not entry["trace_axes"] else "trace_m1"
    mean = tg.ntk.kernel_regression(ARRAYS[f"mlp.ntk.{trace}.diag_none.x1x1"],
                                    ARRAYS[f"predict.k_test_train.{trace}"],
                                    ARRAYS["predict.y_train"], ridge=entry["diag_reg"])
    torch.testing.assert_close(mean, ARRAYS[entry["key"] + ".mean"], rtol=1e-10, atol=1e-12)


def test_infinite_time_is_the_limit_of_finite_times() -> None:
    k, y = ARRAYS["mlp.ntk.trace_none.diag_none.x1x1"], ARRAYS["predict.y_train"]
    kt, g0, f0 = ARRAYS["predict.k_test_train.trace_none"], ARRAYS["mlp.fx2"], ARRAYS["mlp.fx1"]
    predict_fn = tg.ntk.gradient_descent_mse(k, y, diag_reg=1e-3, trace_axes=())
    _, late = predict_fn(t=1e9, fx_train_0=f0, fx_test_0=g0, k_test_train=kt)
    train, limit = predict_fn(t=None, fx_train_0=f0, fx_test_0=g0, k_test_train=kt)
    torch.testing.assert_close(late, limit, rtol=1e-6, atol=1e-8)
    assert torch.equal(train, y)


def test_times_of_any_shape_lead_the_outputs() -> None:
    k, y = ARRAYS["mlp.ntk.trace_m1.diag_none.x1x1"], ARRAYS["predict.y_train"]
    predict_fn = tg.ntk.gradient_descent_mse(k, y)
    t = torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], dtype=torch.float64)
    out = predict_fn(t=t, fx_train_0=ARRAYS["mlp.fx1"])
    assert out.shape == (2, 3, 3, 4)
    torch.testing.assert_close(out[1, 2], predict_fn(t=5.0, fx_train_0=ARRAYS["mlp.fx1"]))
    torch.testing.assert_close(out[0, 0], ARRAYS["mlp.fx1"])


def test_bad_inputs_raise_with_the_fix() -> None:
    k, y = ARRAYS["mlp.ntk.trace_none.diag_none.x1x1"], ARRAYS["predict.y_train"]
    with pytest.raises(ValueError, match=r"trace_axes=\(\) for a full kernel"):
        tg.ntk.gradient_descent_mse(k, y)  # a full [N, N, K, K] kernel needs trace_axes=()
    predict_fn = tg.ntk.gradient_descent_mse(k, y, trace_axes=())
    with pytest.raises(ValueError, match="k_test_train with fx_test_0"):
        predict_fn(fx_test_0=ARRAYS["mlp.fx2"])
    with pytest.raises(ValueError, match="fx_train_0 or fx_test_0"):
        predict_fn(fx_train_0=None)
    with pytest.raises(ValueError, match="pairing y_train's non-traced axes"):
        predict_fn(fx_test_0=ARRAYS["mlp.fx2"], k_test_train=k[:2, :2])
    with pytest.raises(TypeError, match="y_train to be a floating tensor"):
        tg.ntk.gradient_descent_mse(k, y.long(), trace_axes=())
    with pytest.raises(TypeError, match="learning_rate to be a number"):
        tg.ntk.gradient_descent_mse(k, y, learning_rate="1", trace_axes=())
    with pytest.raises(ValueError, match="even number of dimensions"):
        tg.ntk.kernel_regression(k[0], k[0], y)


def _rank_deficient(seed: int, dtype: torch.dtype = torch.float64
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """A linear model's kernels with 6 training rows of rank 5, and random targets."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(9, 5, generator=generator, dtype=dtype)
    y = torch.randn(6, 1, generator=generator, dtype=dtype)
    train, test = features[:6], features[6:]
    return train @ train.T, test @ train.T, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_a_kernel_of_rank_below_its_rows_gives_the_limit_of_the_flow(dtype: torch.dtype) -> None:
    """Session 62: solved by LU (where Cholesky failed) or Cholesky (where round-off let it
    pass), such kernels came back up to 121 times the answer at ``t=None`` (NT: NaN). The limit
    of the gradient flow is the pseudo-inverse's: the test side ``Θ_test Θ⁺ (y - f0)``, the
    train side ``f0 + P (y - f0)``; the finite-t formula tends to it."""
    for seed in range(20):
        k_train_train, k_test_train, y = _rank_deficient(seed, dtype)
        f0 = 0.1 * torch.ones_like(y)
        predict_fn = tg.ntk.gradient_descent_mse(k_train_train, y)
        train, test = predict_fn(fx_train_0=f0, fx_test_0=0.0, k_test_train=k_test_train)
        pinv = torch.linalg.pinv(k_train_train.double(), hermitian=True, rtol=1e-6)
        wanted_test = k_test_train.double() @ pinv @ (y - f0).double()
        wanted_train = f0.double() + k_train_train.double() @ pinv @ (y - f0).double()
        # float32: its own conditioning (a kept eigenvalue of 1e-6 cost 3.5e-2 on one seed),
        # far from the blow-ups of a solve through the null space (121x)
        tolerance = dict(rtol=0.1, atol=0.1) if dtype == torch.float32 else {}
        torch.testing.assert_close(test.double(), wanted_test, **tolerance)
        torch.testing.assert_close(train.double(), wanted_train, **tolerance)
        torch.testing.assert_close(
            tg.ntk.kernel_regression(k_train_train, k_test_train, y).double(),
            k_test_train.double() @ pinv @ y.double(), **tolerance)
        if dtype == torch.float64:  # the finite-t formula at a long time
            late_train, late_test = predict_fn(t=1e6, fx_train_0=f0, fx_test_0=0.0,
                                               k_test_train=k_test_train)
            torch.testing.assert_close(late_test, test, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(late_train, train, rtol=1e-6, atol=1e-6)


def test_a_singular_kernel_that_requires_grad_is_refused() -> None:
    k_train_train, k_test_train, y = _rank_deficient(0)
    k_train_train.requires_grad_()
    predict_fn = tg.ntk.gradient_descent_mse(k_train_train, y)
    with pytest.raises(ValueError, match=r"numerically singular kernel that requires grad "
                       r".*diag_reg > 0"):
        predict_fn(fx_test_0=0.0, k_test_train=k_test_train)


def test_bad_values_raise_before_the_solve() -> None:
    """torch's raw errors before session 59: ``lu_factor``'s on a singular kernel,
    ``new(): invalid data type 'str'``, "The expanded size of the tensor", ``eigh``'s
    LinAlgError on NaN."""
    y = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    singular = torch.ones(3, 3, dtype=torch.float64)  # the flow's limit now (pseudo-inverse)
    torch.testing.assert_close(tg.ntk.kernel_regression(singular, singular[:2], y),
                               singular[:2] @ torch.linalg.pinv(singular) @ y)
    kernel = torch.eye(3, dtype=torch.float64) + 0.1
    predict_fn = tg.ntk.gradient_descent_mse(kernel, y)
    with pytest.raises(TypeError, match="expected t to be a number or a tensor"):
        predict_fn(t="1")
    with pytest.raises(TypeError, match="expected fx_train_0 to be a number or a tensor"):
        predict_fn(fx_train_0="zero")
    with pytest.raises(ValueError, match=r"fx_train_0 of shape \[3, 2\]"):
        predict_fn(fx_train_0=torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"fx_test_0 of shape \[2, 2\]"):
        predict_fn(fx_test_0=torch.zeros(2, 3), k_test_train=kernel[:2])
    with pytest.raises(ValueError, match="finite k_train_train"):
        tg.ntk.gradient_descent_mse(kernel.clone().fill_diagonal_(math.nan), y)
    torch.testing.assert_close(predict_fn(t=2.0, fx_train_0=torch.zeros(1, 2)),
                               predict_fn(t=2.0, fx_train_0=0.0))  # broadcasting still works


def test_display() -> None:
    predict_fn = tg.ntk.gradient_descent_mse(ARRAYS["mlp.ntk.trace_m1.diag_none.x1x1"],
                                             ARRAYS["predict.y_train"], diag_reg=0.1)
    text = repr(predict_fn)
    assert "GradientDescentMSE" in text and "× mean diagonal" in text
    assert "eigenvalues" not in text
    predict_fn(t=1.0)
    assert "eigenvalues" in repr(predict_fn)
    assert predict_fn._repr_html_().startswith("<table>")


@pytest.mark.parametrize("t", [1.0, None], ids=["finite-t", "infinite-t"])
def test_predictions_stay_differentiable_after_a_call_without_gradients(t: float | None) -> None:
    """NOTE [kept factorizations]: a first call under ``no_grad`` (logging a prediction) kept
    a factorization without a graph, and later gradients lost the kernel's path (25% to 7x
    off); a second backward met torch's "backward through the graph a second time"."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(5, 4, generator=generator, dtype=torch.float64)
    kernel = (a @ a.T + 0.1 * torch.eye(5, dtype=torch.float64)).requires_grad_()
    y = torch.randn(5, 2, generator=generator, dtype=torch.float64)
    k_test = torch.randn(3, 5, generator=generator, dtype=torch.float64)

    def loss(predict: Any) -> torch.Tensor:
        return predict(t=t, fx_train_0=None, fx_test_0=torch.zeros(3, 2, dtype=torch.float64),
                       k_test_train=k_test).square().sum()

    expected = torch.autograd.grad(loss(tg.ntk.gradient_descent_mse(kernel, y, diag_reg=1e-3)),
                                   kernel)[0]
    predict = tg.ntk.gradient_descent_mse(kernel, y, diag_reg=1e-3)
    with torch.no_grad():
        loss(predict)
    for _ in range(2):  # and a second backward through the same predictor
        torch.testing.assert_close(torch.autograd.grad(loss(predict), kernel)[0], expected)


def test_kernel_regression_under_vmap() -> None:
    """Cholesky's status was read on the host: torch's raw .item() error under vmap."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(3, 5, 4, generator=generator, dtype=torch.float64)
    kernels = a @ a.transpose(1, 2)
    k_test = torch.randn(3, 2, 5, generator=generator, dtype=torch.float64)
    y = torch.randn(5, dtype=torch.float64)
    batched = torch.func.vmap(lambda k, kt: tg.ntk.kernel_regression(k, kt, y, ridge=0.1))(
        kernels, k_test)
    looped = torch.stack([tg.ntk.kernel_regression(k, kt, y, ridge=0.1)
                          for k, kt in zip(kernels, k_test, strict=True)])
    torch.testing.assert_close(batched, looped)


def _spd(rows: int) -> Tensor:
    factor = torch.randn(rows, rows, dtype=torch.float64)
    return factor @ factor.T + torch.eye(rows, dtype=torch.float64)


@pytest.mark.parametrize("t", [None, 1.0, torch.ones(3, dtype=torch.float64)],
                         ids=["t=None", "t=1", "t=[3]"])
def test_empty_test_sets_and_outputs_give_empty_predictions(t: Any) -> None:
    """Session 67's hunt: torch's raw "cannot reshape tensor of 0 elements into shape [0, -1]"
    for an empty test kernel or a zero-width output; an empty training set is refused."""
    torch.manual_seed(0)
    kernel, y = _spd(6), torch.randn(6, 2, dtype=torch.float64)
    lead = () if not isinstance(t, Tensor) else (3,)
    predict = tg.ntk.gradient_descent_mse(kernel, y)
    test = predict(t=t, fx_train_0=None, fx_test_0=0.0,
                   k_test_train=torch.zeros(0, 6, dtype=torch.float64))
    assert isinstance(test, Tensor) and test.shape == (*lead, 0, 2)
    train = tg.ntk.gradient_descent_mse(kernel, torch.zeros(6, 0, dtype=torch.float64))(t=t)
    assert isinstance(train, Tensor) and train.shape == (*lead, 6, 0)
    assert tg.ntk.kernel_regression(kernel, torch.zeros(0, 6, dtype=torch.float64), y).shape \
        == (0, 2)
    with pytest.raises(ValueError, match=r"expected at least one training point, but got "
                                         r"y_train of shape \(0, 2\)"):
        tg.ntk.gradient_descent_mse(torch.zeros(0, 0, dtype=torch.float64),
                                    torch.zeros(0, 2, dtype=torch.float64))


def test_kernel_regression_takes_the_traced_axes_and_names_its_own_arguments() -> None:
    """Session 67's hunt: a bad ridge was told to pass ``diag_reg``, a kernel of other axes
    ``trace_axes``, neither of them kernel_regression's; a kernel traced over a middle axis
    could not be used at all."""
    torch.manual_seed(0)
    kernel, test_kernel = _spd(5)[:, :, None, None] * torch.eye(2, dtype=torch.float64), \
        torch.randn(2, 5, 2, 2, dtype=torch.float64)
    y = torch.randn(5, 3, 2, dtype=torch.float64)  # [N, T, K], the kernel traced over T
    mean = tg.ntk.kernel_regression(kernel, test_kernel, y, ridge=0.1, trace_axes=(1,))
    flow = tg.ntk.gradient_descent_mse(kernel, y, diag_reg=0.1, diag_reg_absolute_scale=True,
                                       trace_axes=(1,))
    torch.testing.assert_close(mean, flow(t=None, fx_train_0=None, fx_test_0=0.0,
                                          k_test_train=test_kernel), rtol=1e-12, atol=1e-12)
    assert mean.shape == (2, 3, 2)
    with pytest.raises(ValueError, match=r"pass trace_axes= as the kernels were computed with"):
        tg.ntk.kernel_regression(kernel, test_kernel, y, ridge=0.1)
    for ridge in ["a", torch.tensor(0.1)]:
        with pytest.raises(TypeError, match=r"kernel_regression: expected ridge to be a number"):
            tg.ntk.kernel_regression(kernel, test_kernel, y, ridge=ridge)  # type: ignore[arg-type]
