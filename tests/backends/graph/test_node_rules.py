"""The walk's node rules (NOTE [node rules]) against per-row autograd, complex layers included.

torch's backward conjugates a complex operand (``grad · other̄``, ``grad @ W̄ᵀ``); the rules
did not: the eager Gramian with ``batch_dim`` was 0.28 to 1.01 off on a complex ``x @ W`` or
``x * w`` (session 59's hunt), with or without ``record()``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import torchgram as tg

B, K = 3, 5
CDOUBLE = torch.complex128


def _mixed(z: Tensor) -> Tensor:
    """A real loss per sample that reads both parts of ``z`` (a sign or a swap shows)."""
    return (z.real ** 2 + 3 * z.imag).sum(-1)


def _spectral(w: Tensor, x: Tensor) -> Tensor:
    """An FNO-style layer: modes of ``x`` scaled by complex weights stored as real pairs."""
    modes = torch.fft.rfft(x.real, dim=-1)[..., :3]
    mixed = modes * torch.view_as_complex(w[:3].reshape(3, 2).contiguous())
    return torch.tanh(torch.fft.irfft(mixed, n=K, dim=-1)).pow(2).sum(-1)


CASES: dict[str, tuple[Callable[[Tensor, Tensor], Tensor], tuple[int, ...], torch.dtype]] = {
    "mm_real_weight": (lambda w, x: _mixed(x @ w.to(x.dtype)), (K, 4), torch.float64),
    "addmm_real_weight": (lambda w, x: _mixed(torch.addmm(torch.zeros(4, dtype=x.dtype), x,
                                                          w.to(x.dtype))), (K, 4),
                          torch.float64),
    "linear_real_weight": (lambda w, x: _mixed(F.linear(x, w.T.to(x.dtype))), (K, 4),
                           torch.float64),
    "mul_real_weight": (lambda w, x: _mixed(x * w), (K,), torch.float64),
    "complex_weight_mm": (lambda w, x: _mixed(x @ w), (K, 4), CDOUBLE),
    "complex_weight_mul": (lambda w, x: _mixed(x * w[:, 0]), (K, 4), CDOUBLE),
    "spectral": (_spectral, (K, 2), torch.float64),
}


def _expected(rows: Tensor, w: Tensor) -> Tensor:
    grads = [torch.autograd.grad(rows[i], w, retain_graph=True)[0] for i in range(B)]
    flat = torch.stack([torch.view_as_real(g).reshape(-1) if g.is_complex() else g.reshape(-1)
                        for g in grads])
    return flat @ flat.T


@pytest.mark.parametrize("recorded", [False, True], ids=["walked", "recorded"])
@pytest.mark.parametrize("case", list(CASES))
def test_complex_layers_give_the_gramian_of_torchs_backward(case: str, recorded: bool) -> None:
    f, shape, dtype = CASES[case]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(B, K, generator=generator, dtype=CDOUBLE)
    w = torch.randn(shape, generator=generator, dtype=dtype).requires_grad_()
    if recorded:
        with tg.autograd.record():
            rows = f(w, x)
    else:
        rows = f(w, x)
    expected = _expected(rows, w)
    G = tg.autograd.gramian(rows, [w], batch_dim=0, retain_graph=True)
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)
    weights = torch.tensor([0.3, 1.0, 0.7], dtype=torch.float64)
    expected_grad = torch.autograd.grad(rows, w, weights, retain_graph=True)[0]
    tg.autograd.backward(rows, [w], lambda gramian: weights, batch_dim=0)
    assert w.grad is not None
    torch.testing.assert_close(w.grad, expected_grad, rtol=1e-10, atol=1e-12)
