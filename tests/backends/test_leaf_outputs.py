"""``f`` that returns a parameter itself, or a view of it, as (part of) its output.

No call uses the leaf then, so the structured backend recorded no use and gave it a zero
block: ``G = 0`` for ``f = lambda p, x: p["b"]`` (or ``.view``, ``.flatten()``,
``.unsqueeze``, ``.contiguous()``, ``.to`` of its own dtype), a wrong matrix until session
26. Such a leaf now takes its rows from the graph (``TapMode.note_rows``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import torchgram as tg
from reference import dense_gramian

BACKENDS = ["auto", "structured", "graph", "jacobian", "ntvp"]
Params = dict[str, Tensor]

FUNCTIONS: dict[str, Callable[[Params, Tensor], Any]] = {
    "itself": lambda p, x: p["b"],
    "view": lambda p, x: p["b"].view(1, 2),
    "flatten": lambda p, x: p["w"].flatten(),
    "unsqueeze": lambda p, x: p["b"].unsqueeze(0),
    "contiguous": lambda p, x: p["b"].contiguous(),
    "to_its_dtype": lambda p, x: p["b"].to(torch.float64),
    "beside_a_use": lambda p, x: (p["b"], (x @ p["w"]).sum(0)),
    "transposed": lambda p, x: p["w"].T,
}


@pytest.mark.parametrize("options", [{}, {"per_leaf": True}, {"diagonal": True}],
                         ids=["summed", "per_leaf", "diagonal"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_a_leaf_returned_as_the_output(name: str, backend: str,
                                       options: dict[str, bool]) -> None:
    generator = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 2, generator=generator, dtype=torch.float64),
              "b": torch.randn(2, generator=generator, dtype=torch.float64)}
    x = torch.randn(4, 3, generator=generator, dtype=torch.float64)
    f = FUNCTIONS[name]
    dense = dense_gramian(f, (params, x))
    G = tg.gramian(f, backend=backend, **options)(params, x)
    if options.get("per_leaf"):
        for block, expected in zip([G[k] for k in sorted(G)], dense.blocks, strict=True):
            torch.testing.assert_close(block, dense.shaped(expected), rtol=1e-12, atol=1e-12)
    else:
        torch.testing.assert_close(G, dense.shaped(diagonal=options.get("diagonal", False)),
                                   rtol=1e-12, atol=1e-12)
