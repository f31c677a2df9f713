"""The caller's function modes reach ``f`` only; calls inside ``torch.autocast`` run there.

NOTE [the caller's function modes] and NOTE [autocast] in ``torchgram/_core/caller_context.py``:
a mode rewriting ``F.linear``'s output was 0.75 off on structured, one rewriting matmul 0.5
to 2.4 off everywhere (torchgram's own products); the weightings and predictions ran in
bfloat16 inside autocast (session 59's hunts and reviews).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

import torchgram as tg
from reference import dense_gramian

BACKENDS = ["auto", "structured", "graph", "jacobian", "ntvp"]


def _data() -> tuple[dict[str, Tensor], Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=generator)
    params = {"w": torch.randn(64, generator=generator)}
    exact = (x.double() @ x.double().T).float()  # row i's gradient is x_i
    return params, x, exact


def _rows(p: dict[str, Tensor], x: Tensor) -> Tensor:
    return (x * p["w"]).sum(1)  # no op on autocast's lists: every row's gradient is exact


def _relative(value: Tensor, exact: Tensor) -> float:
    return float((value.double() - exact.double()).abs().max() / exact.double().abs().max())


@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch0", "nobatch"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gramian_inside_autocast(backend: str, batch_dim: int | None) -> None:
    """NOTE [autocast]: the call runs in the caller's region, G in f's output dtype, with the
    region's round-off (bfloat16's 2**-8, summed over a few products)."""
    params, x, exact = _data()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        G = tg.gramian(_rows, backend=backend, batch_dim=batch_dim)(params, x)
        kernel = tg.ntk.empirical_ntk_fn(lambda p, x: _rows(p, x)[:, None], trace_axes=(),
                                         backend=backend)(x, None, params)
    assert G.dtype == torch.float32
    assert _relative(G, exact) < 2e-2
    assert _relative(kernel.reshape(6, 6), exact) < 2e-2


@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch0", "nobatch"])
@pytest.mark.parametrize("backend", ["auto", "structured", "graph", "jacobian"])
def test_attention_with_a_float_mask_inside_autocast(backend: str, batch_dim: int | None) -> None:
    """A float32 learned bias as ``scaled_dot_product_attention``'s mask (HF Swin): its
    backward must run in the region; lifting autocast for torchgram's passes met torch's raw
    "expected scalar type BFloat16 but found Float" (session 59's review)."""
    generator = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(8, 8, generator=generator),
              "bias": torch.randn(4, 4, generator=generator)}
    x = torch.randn(3, 4, 8, generator=generator)

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        h = F.linear(x, p["w"])
        out = F.scaled_dot_product_attention(h, h, h, attn_mask=p["bias"])
        return out.float().pow(2).sum((1, 2))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        G = tg.gramian(f, backend=backend, batch_dim=batch_dim)(params, x)
        reference = tg.gramian(f, backend="graph", batch_dim=batch_dim)(params, x)
    torch.testing.assert_close(G, reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item())


def test_f_still_runs_under_the_callers_autocast() -> None:
    """``f``'s own matmuls keep the caller's bfloat16: its output (``G``'s dtype) too."""
    params = {"w": torch.randn(8, 3)}
    seen = []

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        out = x @ p["w"]
        seen.append(out.dtype)
        return out

    with torch.autocast("cpu", dtype=torch.bfloat16):
        G = tg.gramian(f, batch_dim=0)(params, torch.randn(4, 8))
    assert G.dtype == torch.bfloat16
    assert set(seen) == {torch.bfloat16}
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("backend", ["structured", "jacobian"])
def test_cross_kernel_of_f_with_its_own_autocast_region(backend: str) -> None:
    """A bfloat16 region inside ``f`` leaves activations and cotangents of two dtypes: the
    structured cross kernel met torch's raw "Expected out tensor to have dtype float"."""
    generator = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(5, 8, generator=generator),
              "w2": torch.randn(8, 1, generator=generator)}
    x = torch.randn(4, 3, 5, generator=generator)

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.tanh(x @ p["w1"])
        return (h.float() @ p["w2"]).sum(1)

    kernel = tg.ntk.empirical_ntk_fn(f, trace_axes=(), vmap_axes=None, backend=backend)(
        x, None, params)
    reference = tg.ntk.empirical_ntk_fn(f, trace_axes=(), vmap_axes=None, backend="graph")(
        x, None, params)
    assert kernel.dtype == torch.float32
    torch.testing.assert_close(kernel, reference, rtol=2e-2, atol=2e-2)


class _PassThrough(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        return func(*args, **(kwargs or {}))


class _DoubledLinear(TorchFunctionMode):
    """A caller's mode that rewrites what ``F.linear`` returns (a scale, fake quantisation)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        self.seen.add(getattr(func, "__name__", repr(func)))
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is F.linear else out


def _layers(p: dict[str, Tensor], x: Tensor) -> Tensor:
    h = torch.tanh(F.linear(x, p["w1"], p["b1"]))
    return F.linear(h, p["w2"]).pow(2).sum(1)


def _layers_doubled(p: dict[str, Tensor], x: Tensor) -> Tensor:
    """``_layers`` with the mode's rewrite written out: the oracle's function."""
    h = torch.tanh(2 * F.linear(x, p["w1"], p["b1"]))
    return (2 * F.linear(h, p["w2"])).pow(2).sum(1)


def _layer_data() -> tuple[dict[str, Tensor], Tensor]:
    generator = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(6, 4, generator=generator, dtype=torch.float64),
              "b1": torch.randn(6, generator=generator, dtype=torch.float64),
              "w2": torch.randn(3, 6, generator=generator, dtype=torch.float64)}
    return params, torch.randn(5, 4, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch0", "nobatch"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_callers_function_mode_sees_f_first(backend: str,
                                                         batch_dim: int | None) -> None:
    """NOTE [the caller's function modes]: the tapping mode sat beneath the caller's mode and
    tapped its rewritten output (G 0.75 off on structured and auto; session 59's hunt)."""
    params, x = _layer_data()
    expected = dense_gramian(_layers_doubled, (params, x)).gramian
    plain = _DoubledLinear()
    with plain:
        _layers(params, x)[:, None]  # the kernel's f
    mode = _DoubledLinear()
    with mode:
        G = tg.gramian(_layers, backend=backend, batch_dim=batch_dim)(params, x)
        kernel = tg.ntk.empirical_ntk_fn(lambda p, x: _layers(p, x)[:, None], trace_axes=(),
                                         backend=backend)(x, None, params)
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(kernel.reshape(5, 5), expected, rtol=1e-10, atol=1e-12)
    assert mode.seen <= plain.seen, mode.seen - plain.seen  # none of torchgram's own calls


def test_record_inside_a_callers_function_mode() -> None:
    params, x = _layer_data()
    expected = dense_gramian(_layers_doubled, (params, x)).gramian
    leaves = {name: value.clone().requires_grad_() for name, value in params.items()}
    with _DoubledLinear(), tg.autograd.record():
        rows = _layers(leaves, x)
    G = tg.autograd.gramian(rows, list(leaves.values()), batch_dim=0)
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)


def test_weightings_and_predictions_inside_autocast_keep_full_precision() -> None:
    """They are public entry points too (the predictions were 0.2-1.2% off in bfloat16;
    session 59's review; the weightings compute in float64 anyway)."""
    generator = torch.Generator().manual_seed(0)
    jacobian = torch.randn(6, 40, generator=generator)
    G = jacobian @ jacobian.T
    kernel = G + torch.eye(6)
    y = torch.randn(6, 2, generator=generator)

    def compute() -> list[Tensor]:
        predict = tg.ntk.gradient_descent_mse(kernel, y)
        return [tg.weighting.pcgrad(G, generator=torch.Generator().manual_seed(1)),
                tg.weighting.upgrad(G), tg.weighting.aligned_mtl(G),
                tg.ntk.kernel_regression(kernel, kernel[:3], y),
                predict(t=2.0, fx_train_0=0.0)]  # type: ignore[list-item]

    outside = compute()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = compute()
    for got, wanted in zip(inside, outside, strict=True):
        torch.testing.assert_close(got, wanted, rtol=0, atol=0)


@pytest.mark.parametrize("caller_mode", [False, True], ids=["alone", "in_a_mode"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mode_f_leaves_entered_does_not_strand_torchgrams(backend: str,
                                                            caller_mode: bool) -> None:
    """torchgram's own exits popped f's mode instead of theirs, leaving a tapping mode or a
    census on the caller's stack for good (session 59's review)."""
    params, x = _layer_data()
    entered = []

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        mode = _PassThrough()
        mode.__enter__()  # never exited
        entered.append(mode)
        return _layers(p, x)

    outer = _DoubledLinear()
    with contextlib.ExitStack() as stack:
        if caller_mode:
            stack.enter_context(outer)
        tg.gramian(f, backend=backend, batch_dim=0)(params, x)
        assert torch.overrides._get_current_function_mode_stack() == ([outer] if caller_mode
                                                                      else [])
    assert entered


def test_weightings_and_predictions_are_not_seen_by_a_callers_mode() -> None:
    generator = torch.Generator().manual_seed(0)
    jacobian = torch.randn(5, 9, generator=generator, dtype=torch.float64)
    G = jacobian @ jacobian.T
    kernel, test_kernel = G + torch.eye(5), G[:2].clone()
    outside = [tg.weighting.upgrad(G), tg.ntk.kernel_regression(kernel, test_kernel, G)]
    mode = _DoubledLinear()
    with mode:
        inside = [tg.weighting.upgrad(G), tg.ntk.kernel_regression(kernel, test_kernel, G)]
    assert mode.seen <= {"__get__"}, mode.seen  # metadata reads of the results at most
    for got, wanted in zip(inside, outside, strict=True):
        torch.testing.assert_close(got, wanted, rtol=0, atol=0)
