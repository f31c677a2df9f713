"""Per-sample passes that torch's storage or batching gets wrong, against the oracle.

* ``as_strided`` of a parameter on the structured fallback: its per-sample carriers were an
  expanded view, one storage for every sample, and ``as_strided``'s backward (which works on
  the storage) summed the samples' gradients (0.86-0.97 off, a Toeplitz parametrisation among
  them; ``graph_leaf(copies=)`` now gives each sample memory of its own).
* ``torch.select_scatter`` of a batched ``src`` into an unbatched tensor under ``vmap``
  records a wrong backward for ``src`` (a weight row replaced by another: 3.3× off; a row
  scattered into zeros: 15×; NOTE [wrong batching rules]: one sample at a time instead).

Both session 60's hunt; every backend, and ``tg.aggregated_grad``'s update.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import torchgram as tg
from reference import dense_gramian
from torchgram._core.signature import clear_caches

DOUBLE = torch.float64
BACKENDS = ["auto", "structured", "graph", "jacobian", "ntvp"]

CASES: dict[str, tuple[tuple[int, ...], Callable[[Tensor], Tensor]]] = {
    "as-strided-view": ((12,), lambda w: w.as_strided((4, 3), (3, 1))),
    "as-strided-offset": ((60,), lambda w: w.as_strided((4, 3), (3, 1), 7)),
    "as-strided-toeplitz": ((6,), lambda w: w.as_strided((4, 3), (1, 1))),
    "as-strided-copy": ((12,), lambda w: torch.as_strided_copy(w, (4, 3), (3, 1))),
    "select-scatter-row": ((5, 3), lambda w: torch.select_scatter(w[:4], w[4], 0, 0)),
    "select-scatter-zeros": ((2, 3), lambda w: torch.zeros(4, 3, dtype=w.dtype).select_scatter(
        w[1], 0, 2)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_a_weight_built_from_a_parameter(case: str, backend: str) -> None:
    clear_caches()
    shape, weight_of = CASES[case]
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=generator, dtype=DOUBLE)
    x = torch.randn(6, 4, generator=generator, dtype=DOUBLE)

    def f(w: Tensor, x: Tensor) -> Tensor:
        return (x @ weight_of(w)).tanh().sum(1)

    wanted = dense_gramian(f, (w, x)).gramian
    torch.testing.assert_close(tg.gramian(f, backend=backend, batch_dim=0)(w, x), wanted,
                               rtol=1e-10, atol=1e-12)
    update, _ = tg.aggregated_grad(f, tg.weighting.upgrad, batch_dim=0, backend=backend)(w, x)
    J = torch.func.jacrev(f)(w, x).reshape(6, -1)
    torch.testing.assert_close(update.reshape(-1), J.T @ tg.weighting.upgrad(wanted),
                               rtol=1e-10, atol=1e-12)


def test_an_activation_scattered_into_zeros_under_the_per_sample_pass() -> None:
    """The wrong backward reaches the weight before the scatter too (its taps' cotangents)."""
    clear_caches()
    generator = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(4, 3, generator=generator, dtype=DOUBLE),
              "v": torch.randn(3, generator=generator, dtype=DOUBLE)}
    x = torch.randn(6, 4, generator=generator, dtype=DOUBLE)

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        h = torch.tanh(x @ p["w"])  # [B, 3]
        rows = torch.stack([torch.select_scatter(torch.zeros(2, 3, dtype=x.dtype), hb, 0, 0)
                            for hb in h.unbind(0)])
        return (rows.sin() @ p["v"]).sum(1)

    wanted = dense_gramian(f, (params, x)).gramian
    for backend in ("auto", "structured"):
        torch.testing.assert_close(tg.gramian(f, backend=backend, batch_dim=0)(params, x),
                                   wanted, rtol=1e-10, atol=1e-12)
