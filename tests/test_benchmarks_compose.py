"""Smoke test of ``benchmarks/compose.py`` (tiny sizes, one timed call): it runs and reports."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks import compose  # noqa: E402


def test_compose_benchmark_reports_every_row(tmp_path: Path) -> None:
    out = tmp_path / "compose.md"
    text = compose.run(["--quick", "--threads", "1", "--compile-backend", "aot_eager",
                        "--out", str(out)])
    assert out.read_text() == text
    for row in ("G (auto; nothing requires grad: fast path)", "G, then backward through it",
                "torch.compile", "fullgraph=True"):
        assert row in text
    assert "auto` ran `structured`" in text
