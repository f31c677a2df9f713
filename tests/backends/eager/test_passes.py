"""The engine pass of the recorded taps: cotangents at slots, and freeing the graph.

``engine_cotangents`` is compared with one plain ``torch.autograd.grad`` per seed; without
``retain_graph`` it must free the graph as that plain pass does (NOTE [freeing from a
vectorized pass]), also when ``vmap`` cannot batch a node and the seeds are looped.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from custom_functions import NumpySquare
from torchgram.backends.eager.passes import engine_cotangents

DOUBLE = torch.float64




def _graph(numpy: bool) -> tuple[Tensor, Tensor]:
    """``(out [4], y [4, 3])``: ``y = x W`` and ``out`` a nonlinear function of ``y``."""
    torch.manual_seed(0)
    x = torch.randn(4, 2, dtype=DOUBLE)
    weight = torch.randn(2, 3, dtype=DOUBLE, requires_grad=True)
    y = x @ weight
    h = NumpySquare.apply(y) if numpy else torch.tanh(y)
    return (h * h.flip(0)).sum(1), y


@pytest.mark.parametrize("numpy", [False, True], ids=["vmapped", "looped"])
@pytest.mark.parametrize("seeds", [1, 2, 4], ids=["1-seed", "2-seeds", "4-seeds"])
@pytest.mark.parametrize("retain_graph", [True, False], ids=["retain", "free"])
def test_cotangents_match_plain_passes_and_free_the_graph(numpy: bool, seeds: int,
                                                           retain_graph: bool) -> None:
    out, y = _graph(numpy)
    edge = GradientEdge(y.grad_fn, y.output_nr)
    seed = torch.randn(seeds, *out.shape, dtype=DOUBLE)
    expected = torch.stack([torch.autograd.grad(out, y, s, retain_graph=True)[0]
                            for s in seed])
    (found,) = engine_cotangents([out], [(edge.node, edge.output_nr)], [seed],
                                 retain_graph=retain_graph)
    assert found is not None
    torch.testing.assert_close(found, expected, rtol=1e-12, atol=1e-12)
    if retain_graph:
        out.sum().backward()  # the graph is whole
    else:
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            out.sum().backward()
