"""The silent wrong answers of issue 9, one named test each, on every backend × batch_dim.

Each was a wrong matrix on the backend named in the test's docstring; the contract
(:mod:`models.case`) asks every backend for the oracle's matrix or a torchgram error.
"""

from __future__ import annotations

import pytest

from models.case import assert_contract, grid
from models.regressions import BUILDERS


def _grid(*names: str) -> pytest.MarkDecorator:
    return pytest.mark.parametrize(("name", "backend", "batch_dim"), grid(BUILDERS, names))


@_grid("tied-padding-idx")
def test_tied_embedding_with_padding_idx(name: str, backend: str, batch_dim: int | None) -> None:
    """1. ntvp: the padding row of a table also used by a tied head (was 1e-3 to 0.4 off)."""
    assert_contract(BUILDERS, name, backend, batch_dim)


@_grid("tied-scale-grad-by-freq")
def test_tied_embedding_with_scale_grad_by_freq(name: str, backend: str,
                                                batch_dim: int | None) -> None:
    """1. ntvp: a ``scale_grad_by_freq`` table also used by a tied head."""
    assert_contract(BUILDERS, name, backend, batch_dim)


@_grid("padding-idx-fallback")
def test_padding_idx_on_the_per_sample_fallback(name: str, backend: str,
                                                batch_dim: int | None) -> None:
    """2. structured/auto + batch_dim: padding row zeroed for sample 0 only under vmap."""
    assert_contract(BUILDERS, name, backend, batch_dim)


@_grid("keyword-mask")
def test_keyword_tensor_is_split_per_sample(name: str, backend: str,
                                            batch_dim: int | None) -> None:
    """3. A tensor passed by keyword must be split per sample like a positional one."""
    assert_contract(BUILDERS, name, backend, batch_dim)


@_grid("centered-batch")
def test_function_mixing_samples_with_batch_dim(name: str, backend: str,
                                                batch_dim: int | None) -> None:
    """4. ``x - x.mean(0)`` with batch_dim: the coupled Gramian or a torchgram error."""
    assert_contract(BUILDERS, name, backend, batch_dim)


@_grid("mixed-precision-f32-first", "mixed-precision-f64-first", "mixed-precision-f32-output")
def test_mixed_float32_and_float64_leaves(name: str, backend: str,
                                         batch_dim: int | None) -> None:
    """5. graph with float32 and float64 leaves (was 6e-3 off in some layouts)."""
    assert_contract(BUILDERS, name, backend, batch_dim)
