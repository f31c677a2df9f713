"""Every backend against the dense float64 oracle, on every zoo model.

Backends are listed in ``BACKENDS``; a new backend joins by adding its name there.
"""

from __future__ import annotations

import optree
import pytest
import torch

import torchgram as tg
from reference import dense_gramian
from zoo import NAMES, build

BACKENDS = ["jacobian", "auto", "ntvp", "graph", "structured"]
TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Relative agreement, scaled by the largest entry of the expected Gramian."""
    assert actual.shape == expected.shape
    assert actual.dtype == dtype
    scale = expected.abs().max().clamp_min(1.0)
    torch.testing.assert_close(actual / scale, expected.to(dtype) / scale, **TOLERANCE[dtype])


def _batch_options(name: str) -> list[object]:
    case = build(name)
    return [None] if case.batch_dim is None else [None, "per_sample"]


GRID = [
    pytest.param(backend, name, batch, chunk,
                 id=f"{backend}-{name}-{batch or 'dense'}-chunk{chunk}")
    for backend in BACKENDS
    for name in NAMES
    for batch in _batch_options(name)
    for chunk in (None, 1, 3)
]


@pytest.mark.parametrize(("backend", "name", "batch", "chunk_size"), GRID)
def test_gramian_matches_oracle_float64(backend: str, name: str, batch: str | None,
                                        chunk_size: int | None) -> None:
    case = build(name, torch.float64)
    expected = dense_gramian(case.f, case.args)
    batch_dim = case.batch_dim if batch else None
    G = tg.gramian(case.f, backend=backend, chunk_size=chunk_size, batch_dim=batch_dim,
                   in_dims=case.in_dims)(*case.args)
    assert_matches(G, expected.shaped(), torch.float64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_gramian_matches_oracle_float32(backend: str, name: str) -> None:
    case32 = build(name, torch.float32)
    expected = dense_gramian(build(name, torch.float64).f, build(name, torch.float64).args)
    G = tg.gramian(case32.f, backend=backend, batch_dim=case32.batch_dim,
                   in_dims=case32.in_dims)(*case32.args)
    assert_matches(G, expected.shaped(), torch.float32)


@pytest.mark.parametrize(("backend", "name", "batch"), [
    pytest.param(backend, name, batch, id=f"{backend}-{name}-{batch or 'dense'}")
    for backend in BACKENDS for name in NAMES for batch in _batch_options(name)
])
def test_diagonal_and_per_leaf_match_oracle(backend: str, name: str, batch: str | None) -> None:
    case = build(name, torch.float64)
    batch_dim = case.batch_dim if batch else None
    expected = dense_gramian(case.f, case.args)
    options = dict(backend=backend, batch_dim=batch_dim, in_dims=case.in_dims)
    diagonal = tg.gramian(case.f, diagonal=True, **options)(*case.args)
    assert_matches(diagonal, expected.shaped(diagonal=True), torch.float64)
    blocks = tg.gramian(case.f, per_leaf=True, **options)(*case.args)
    leaves = [b for b in optree.tree_leaves(blocks) if b is not None]
    assert len(leaves) == len(expected.blocks)
    for block, expected_block in zip(leaves, expected.blocks, strict=True):
        assert_matches(block, expected.shaped(expected_block), torch.float64)
    per_leaf_diagonal = tg.gramian(case.f, per_leaf=True, diagonal=True, **options)(*case.args)
    diagonals = [b for b in optree.tree_leaves(per_leaf_diagonal) if b is not None]
    for block, expected_block in zip(diagonals, expected.blocks, strict=True):
        assert_matches(block, expected.shaped(expected_block, diagonal=True), torch.float64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["mlp", "nested_pytree", "batch_on_dim1"])
def test_has_aux_and_argnums_tuple(backend: str, name: str) -> None:
    case = build(name, torch.float64)
    extra = torch.randn(3, dtype=torch.float64)

    def with_extra(params, extra, *inputs):
        out = case.f(params, *inputs)
        return out * (1 + extra.sum()), {"out": out.detach(), "tag": "x"}

    args = (case.params, extra, *case.inputs)
    expected = dense_gramian(lambda *a: with_extra(*a)[0], args, argnums=(0, 1))
    in_dims = (None, *((case.in_dims,) * len(case.inputs)))
    for batch_dim in {None, case.batch_dim}:
        G, aux = tg.gramian(with_extra, argnums=(0, -len(args) + 1), has_aux=True,
                            backend=backend, batch_dim=batch_dim,
                            in_dims=in_dims[1:] if batch_dim is not None else 0)(*args)
        assert_matches(G, expected.shaped(), torch.float64)
        assert aux["tag"] == "x"
        torch.testing.assert_close(aux["out"], case.f(case.params, *case.inputs))
        blocks, _ = tg.gramian(with_extra, argnums=(0, 1), has_aux=True, per_leaf=True,
                               backend=backend, batch_dim=batch_dim,
                               in_dims=in_dims[1:] if batch_dim is not None else 0)(*args)
        assert isinstance(blocks, tuple) and len(blocks) == 2
        params_blocks = [b for b in optree.tree_leaves(blocks[0]) if b is not None]
        for block, expected_block in zip([*params_blocks, blocks[1]], expected.blocks,
                                         strict=True):
            assert_matches(block, expected.shaped(expected_block), torch.float64)
