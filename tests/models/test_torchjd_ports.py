"""torchjd's autogram test architectures (ported) × backend × batch_dim vs the oracle.

Same contract as the real models (:mod:`models.case`); the list of ported and not ported
architectures is in :mod:`models.torchjd_ports`.
"""

from __future__ import annotations

import pytest

from models import torchjd_ports
from models.case import assert_contract, grid


@pytest.mark.parametrize(("name", "backend", "batch_dim"), grid(torchjd_ports.BUILDERS))
def test_torchjd_architecture(name: str, backend: str, batch_dim: int | None) -> None:
    assert_contract(torchjd_ports.BUILDERS, name, backend, batch_dim)
