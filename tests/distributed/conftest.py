"""The 2 gloo ranks of the distributed tests, started once per session (``spawning``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from spawning import MODULES, Results, spawn


@pytest.fixture(scope="session")
def distributed_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Results]:
    """Per test module of :data:`spawning.MODULES`, every rank's check results."""
    return spawn(MODULES, Path(tmp_path_factory.mktemp("distributed")))
