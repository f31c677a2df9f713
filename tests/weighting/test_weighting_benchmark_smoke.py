"""Smoke test of benchmarks/weighting.py: its --quick mode, in-process, checks its answers agree.

It checks the machinery (every weighting and section runs, the files are written, the thread
count is restored) and the accuracy columns, never the timings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not an installed package.
    sys.path.insert(0, str(ROOT))

from benchmarks import weighting as bench  # noqa: E402

from torchgram.weighting._kkt import KKT_TOL  # noqa: E402


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bench.Results]:
    out = tmp_path_factory.mktemp("weighting-benchmark")
    pytest.importorskip("sklearn")
    threads = torch.get_num_threads()
    results = bench.main(["--quick", "--out", str(out)])
    assert torch.get_num_threads() == threads  # The run leaves the process as it found it.
    return out, results


def test_every_weighting_and_gramian_ran(quick: tuple[Path, bench.Results]) -> None:
    _, results = quick
    ran = {(row.weighting, row.m, row.family) for row in results.rows}
    expected = {(name, m, family) for name in bench.QUICK.weightings
                for m in bench.QUICK.sizes for family in bench.QUICK.families}
    assert ran == expected
    assert all(row.ours_ms > 0 for row in results.rows)
    # Both solvers of the dual-cone QPs ran: direct below m = 128, CG above.
    assert {row.solver for row in results.rows if row.weighting == "upgrad"} == {"direct", "cg"}


def test_answers_agree_and_are_certified(quick: tuple[Path, bench.Results]) -> None:
    pytest.importorskip("torchjd")
    _, results = quick
    for row in results.rows:
        if row.weighting in ("upgrad", "dualproj"):
            assert row.kkt is not None and row.kkt <= KKT_TOL, row
        if row.weighting in ("upgrad", "dualproj", "imtl_g", "aligned_mtl"):
            assert row.agreement is not None and row.agreement < 1e-8, row
        if row.weighting == "mgda":
            assert row.kkt is not None and row.kkt < 1e-9, row
            # torchjd's Frank-Wolfe objective less ours, over tr(G): ours is never worse.
            assert row.agreement is not None and row.agreement >= -1e-12, row
    assert any(row.note for row in results.rows if row.weighting == "pcgrad")


def test_step_and_warm_start_sections(quick: tuple[Path, bench.Results]) -> None:
    _, results = quick
    (step,) = results.steps
    assert set(step["ms"]) == {"backward", "gramian", "upgrad", "vjp (Jᵀw)",
                               "gramian + upgrad + vjp", "aggregated_grad"}
    assert step["x backward"]["backward"] == 1.0
    for warm in results.warm:
        for kind in ("same batch", "fresh batches"):
            assert warm[kind]["max relative difference"] < 1e-10


def test_files_are_written(quick: tuple[Path, bench.Results]) -> None:
    out, results = quick
    page = (out / "weighting.md").read_text()
    for name in bench.QUICK.weightings:
        assert f"## {name}" in page
    assert "One Jacobian-descent step" in page and "Warm starts" in page
    payload = json.loads((out / "weighting.json").read_text())
    assert len(payload["rows"]) == len(results.rows)
    assert payload["config"]["quick"] is True
