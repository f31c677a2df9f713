"""Real models (``transformers``, vision, recurrent) × backend × batch_dim vs the oracle.

The contract of :mod:`models.case`: the dense float64 oracle's matrix, or an error whose
message starts with ``torchgram.`` — never a raw torch error, a wrong matrix or a changed
buffer. ``BASELINE.md`` records what the library does today.
"""

from __future__ import annotations

import pytest

from models import recurrent, transformers_models, vision
from models.case import assert_contract, grid


@pytest.mark.parametrize(("name", "backend", "batch_dim"), grid(transformers_models.BUILDERS))
def test_transformers_model(name: str, backend: str, batch_dim: int | None) -> None:
    assert_contract(transformers_models.BUILDERS, name, backend, batch_dim)


@pytest.mark.parametrize(("name", "backend", "batch_dim"), grid(vision.BUILDERS))
def test_vision_model(name: str, backend: str, batch_dim: int | None) -> None:
    assert_contract(vision.BUILDERS, name, backend, batch_dim)


@pytest.mark.parametrize(("name", "backend", "batch_dim"), grid(recurrent.BUILDERS))
def test_recurrent_model(name: str, backend: str, batch_dim: int | None) -> None:
    assert_contract(recurrent.BUILDERS, name, backend, batch_dim)
