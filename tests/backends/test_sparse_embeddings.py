"""Embeddings with sparse gradients, and cached probes that no longer describe ``f``.

* ``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)`` give their table a sparse
  gradient: the same Jacobian in a layout every backend and both eager APIs refused with raw
  torch errors (session 27). Evaluations now ask for dense gradients, the graph walk makes
  sparse ones dense, and ``tg.autograd.backward`` still leaves a sparse ``.grad`` as
  ``.backward()`` does (NOTE [sparse embedding gradients] in ``_core/census.py``).
* A probe is cached per call signature, which cannot see what ``f``'s globals decide: the same
  code switching to ``torch.cdist`` (whose batched backward torch gets wrong) reused the probe
  that said vmapping was safe, and jacobian and auto were 0.76 off (NOTE [stale probes]).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own spelling
from torch import Tensor, nn

import torchgram as tg
from reference import dense_cross_kernel, dense_gramian

BACKENDS = ["auto", "structured", "graph", "jacobian", "ntvp"]


class _Tokens(nn.Module):
    def __init__(self, sparse: bool, bag: bool) -> None:
        super().__init__()
        self.bag = bag
        self.table: nn.Module = (nn.EmbeddingBag(10, 4, mode="sum", sparse=sparse) if bag
                                 else nn.Embedding(10, 4, sparse=sparse))
        self.head = nn.Linear(4, 3)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.table(ids) if self.bag else self.table(ids).sum(1)
        return self.head(torch.tanh(h))


def _models(bag: bool) -> tuple[nn.Module, nn.Module]:
    """The same model with dense and with sparse table gradients."""
    torch.manual_seed(0)
    dense = _Tokens(False, bag).double()
    sparse = _Tokens(True, bag).double()
    sparse.load_state_dict(dense.state_dict())
    return dense, sparse


def _losses(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    def f(params: dict[str, Tensor], ids: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(fn(params, ids), labels, reduction="none")

    return f


def _inputs() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randint(0, 10, (5, 3), generator=generator),
            torch.randint(0, 3, (5,), generator=generator))


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["no-batch", "batch"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bag", [False, True], ids=["embedding", "embedding-bag"])
def test_gramian_with_sparse_gradients(bag: bool, backend: str, batch_dim: int | None) -> None:
    dense, sparse = _models(bag)
    ids, labels = _inputs()
    dense_fn, params = tg.functionalize(dense)
    expected = dense_gramian(_losses(dense_fn), (params, ids, labels)).gramian
    sparse_fn, sparse_params = tg.functionalize(sparse)
    for _ in range(2):  # the probe, then its cached form
        try:
            G = tg.gramian(_losses(sparse_fn), backend=backend, batch_dim=batch_dim)(
                sparse_params, ids, labels)
        except tg.BackendCannotRun as error:  # torch has no forward-mode embedding_bag
            assert bag and backend == "ntvp", error
            return
        torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bag", [False, True], ids=["embedding", "embedding-bag"])
def test_cross_kernel_with_sparse_gradients(bag: bool) -> None:
    dense, sparse = _models(bag)
    ids, _ = _inputs()
    others = ids[:2].flip(-1)
    dense_fn, params = tg.functionalize(dense)
    sparse_fn, sparse_params = tg.functionalize(sparse)
    expected = dense_cross_kernel(dense_fn, params, ids, others)
    kernel = tg.ntk.empirical_ntk_fn(sparse_fn, trace_axes=())(ids, others, sparse_params)
    torch.testing.assert_close(kernel, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("recorded", [False, True], ids=["walked", "recorded"])
@pytest.mark.parametrize("bag", [False, True], ids=["embedding", "embedding-bag"])
def test_eager_step_keeps_the_sparse_grad(bag: bool, recorded: bool) -> None:
    """The eager Gramian is the oracle's; ``.grad`` is ``Jᵀw`` in the layout ``.backward()``
    gives (sparse for the table: ``torch.optim.SparseAdam`` needs it)."""
    dense, sparse = _models(bag)
    ids, labels = _inputs()
    dense_fn, params = tg.functionalize(dense)
    expected = dense_gramian(_losses(dense_fn), (params, ids, labels)).gramian
    weights = tg.weighting.upgrad(expected)
    F.cross_entropy(dense(ids), labels, reduction="none").backward(weights)
    leaves = list(sparse.parameters())
    for run in ("gramian", "backward"):
        if recorded:
            with tg.autograd.record():
                losses = F.cross_entropy(sparse(ids), labels, reduction="none")
        else:
            losses = F.cross_entropy(sparse(ids), labels, reduction="none")
        if run == "gramian":
            G = tg.autograd.gramian(losses, leaves, batch_dim=0)
            torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)
        else:
            tg.autograd.backward(losses, leaves, tg.weighting.upgrad, batch_dim=0)
    for ours, reference in zip(sparse.parameters(), dense.parameters(), strict=True):
        assert ours.grad is not None and reference.grad is not None
        assert ours.grad.is_sparse == (ours is sparse.table.weight)
        torch.testing.assert_close(ours.grad.to_dense(), reference.grad, rtol=1e-10,
                                   atol=1e-12)


class _Config:
    """A global the key of a call signature cannot see."""

    distance = False


def _global_switch(params: dict[str, Tensor], x: Tensor) -> Tensor:
    h = torch.tanh(x @ params["w"].T)
    if _Config.distance:  # a prototype loss: squared distances to learned centres
        return (torch.cdist(h, params["c"]) ** 2).sum(-1)
    return (h @ params["c"].T).sum(-1)


@pytest.mark.parametrize("backend", ["auto", "jacobian", "structured", "graph"])
def test_a_stale_cached_probe_is_probed_afresh(backend: str, monkeypatch: Any) -> None:
    """The same code, shapes and closure: the probe is cached, then ``f`` calls cdist."""
    torch.manual_seed(0)
    params = {"w": torch.randn(5, 4, dtype=torch.float64),
              "c": torch.randn(3, 5, dtype=torch.float64)}
    x = torch.randn(6, 4, dtype=torch.float64)
    tg.gramian(_global_switch, backend=backend)(params, x)  # probed without cdist
    monkeypatch.setattr(_Config, "distance", True)
    expected = dense_gramian(_global_switch, (params, x)).gramian
    G = tg.gramian(_global_switch, backend=backend)(params, x)
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)


def test_a_stale_cached_probe_learns_of_sparse_gradients(monkeypatch: Any) -> None:
    dense, sparse = _models(bag=False)
    ids, labels = _inputs()
    dense_fn, params = tg.functionalize(dense)
    sparse_fn, _ = tg.functionalize(sparse)
    current = {"fn": dense_fn}

    def f(p: dict[str, Tensor], ids: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(current["fn"](p, ids), labels, reduction="none")

    expected = dense_gramian(f, (params, ids, labels)).gramian
    tg.gramian(f, batch_dim=0)(params, ids, labels)
    monkeypatch.setitem(current, "fn", sparse_fn)
    torch.testing.assert_close(tg.gramian(f, batch_dim=0)(params, ids, labels), expected,
                               rtol=1e-10, atol=1e-12)


def _scripted_lookup(ids: Tensor, table: Tensor) -> Tensor:
    return torch.embedding(table, ids, -1, False, True)  # sparse=True, inside TorchScript


with warnings.catch_warnings():  # torch >= 2.11: torch.jit.script is deprecated
    warnings.simplefilter("ignore", DeprecationWarning)
    _scripted_lookup = torch.jit.script(_scripted_lookup)


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["no-batch", "batch"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_gradients_no_mode_sees(backend: str, batch_dim: int | None) -> None:
    """An embedding asking for a sparse gradient inside TorchScript: torchgram cannot ask it
    for a dense one, and the backends that meet the sparse gradient decline (raw torch errors
    before), naming graph, whose walk densifies it; auto goes on to it."""
    generator = torch.Generator().manual_seed(0)
    params = {"table": torch.randn(7, 3, dtype=torch.float64, generator=generator),
              "w": torch.randn(3, 2, dtype=torch.float64, generator=generator)}
    ids = torch.tensor([[1, 2], [3, 3], [0, 6]])

    def f(p: dict[str, Tensor], ids: Tensor) -> Tensor:
        return torch.tanh(_scripted_lookup(ids, p["table"]) @ p["w"]).sum(-1)

    def dense(p: dict[str, Tensor], ids: Tensor) -> Tensor:
        return torch.tanh(F.embedding(ids, p["table"]) @ p["w"]).sum(-1)

    expected = dense_gramian(dense, (params, ids)).shaped()
    for _ in range(3):
        try:
            G = tg.gramian(f, backend=backend, batch_dim=batch_dim)(params, ids)
        except tg.BackendCannotRun as error:
            assert backend in ("structured", "jacobian", "ntvp"), error
            assert "sparse gradient" in str(error) and "backend='graph'" in str(error), error
            continue
        torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)
