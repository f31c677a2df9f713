"""NOTE [reads of the batch's values]: the trace notes what ``vmap`` over the samples refuses."""

from __future__ import annotations

import pytest
import torch

from helpers import make_problem
from torchgram.backends.structured.passes import trace


def _unbatchable(f, params, x):
    return trace(make_problem(f, (params, x), batch_dim=0)).unbatchable


def _linear(p, x):
    return torch.tanh(x @ p["w"]).sum(-1)


@pytest.mark.parametrize("read", [
    pytest.param(lambda p, x: bool(torch.isnan(x).any()), id="bool-of-a-check"),
    pytest.param(lambda p, x: (x @ p["w"]).abs().max().item() > 1e9, id="item-of-an-activation"),
    pytest.param(lambda p, x: int((x > 0).sum()) < 0, id="int"),
    pytest.param(lambda p, x: not torch.equal(x, x), id="torch.equal"),
    pytest.param(lambda p, x: x[x > 0].numel() < 0, id="boolean-index"),
    pytest.param(lambda p, x: x.nonzero().shape[0] < 0, id="nonzero"),
    pytest.param(lambda p, x: len(x.tolist()) < 0, id="tolist"),
    pytest.param(lambda p, x: not torch.is_nonzero((x > 1e9).any()), id="is_nonzero"),
    pytest.param(lambda p, x: torch.bincount((x > 0).long().flatten()).numel() < 0,
                 id="bincount"),
    pytest.param(lambda p, x: x.clone().__setitem__(x < -1e9, 0) is not None, id="mask-setitem"),
    pytest.param(lambda p, x: x.flatten().repeat_interleave((x > 0).long().flatten()).numel()
                 < 0, id="repeat_interleave-of-values"),
])
def test_a_read_of_values_computed_from_the_batch_is_noted(read):
    def f(p, x):
        if read(p, x):
            return _linear(p, x) * 0
        return _linear(p, x)

    params = {"w": torch.randn(3, 2)}
    found = _unbatchable(f, params, torch.randn(5, 3))
    assert found and all("a read of values computed from the batch" in what for what in found)


@pytest.mark.parametrize("read", [
    pytest.param(lambda p, x, c: bool(p["w"].abs().max() > 1e9), id="a-parameter"),
    pytest.param(lambda p, x, c: c.item() > 1e9, id="a-constant"),
    pytest.param(lambda p, x, c: x.shape[0] > 1e9, id="a-shape"),
    pytest.param(lambda p, x, c: x[:, p["w"][:, 0] > -1e9].numel() < 0,
                 id="the-batch-indexed-by-a-mask-of-parameters"),  # (vmap batches it)
])
def test_reads_of_parameters_constants_and_shapes_are_not(read):
    constant = torch.tensor(2.0)

    def f(p, x):
        if read(p, x, constant):
            return _linear(p, x) * 0
        return _linear(p, x)

    assert _unbatchable(f, {"w": torch.randn(3, 2)}, torch.randn(5, 3)) == []


def test_a_keyword_input_of_the_batch_is_followed():
    def f(p, x, *, mask):
        if mask.all():  # transformers' mask code: no mask where every token is real
            mask = None
        out = _linear(p, x)
        return out if mask is None else out * mask.sum(-1)

    problem = make_problem(f, ({"w": torch.randn(3, 2)}, torch.randn(5, 3)),
                           {"mask": torch.ones(5, 4)}, batch_dim=0)
    assert trace(problem).unbatchable == [
        "Tensor.__bool__ (a read of values computed from the batch)"]
