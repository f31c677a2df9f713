"""Smoke test of ``benchmarks/device_check.py`` on the CPU: the machinery, not a device.

The script is what a session runs on a GPU; here it runs its quick sections on the CPU (every
check must pass), and its verdicts are checked on planted outcomes: a wrong answer, an answer
off the device, a refusal the CPU shares and one it does not.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks import device_check  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")


def test_quick_sections_pass_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "device_check.md"
    status = device_check.main(["--device", "cpu", "--quick", "--out", str(out)])
    text = out.read_text()
    assert status == 0, text
    for section in ("zoo", "real", "ntk", "weighting"):
        assert f"| {section} |" in text
    assert "FAIL" not in text.split("| section |")[1].split("\n", 2)[2]


def _ones() -> torch.Tensor:
    return torch.ones(3, dtype=torch.float64)


def _refuse(message: str) -> None:
    raise ValueError(message)


@pytest.mark.parametrize(("on_device", "on_cpu", "expected", "status"), [
    pytest.param(lambda: _ones(), lambda: None, _ones(), "ok", id="right"),
    pytest.param(lambda: _ones() * (1 + 1e-9), lambda: None, _ones(), "FAIL",
                 id="wrong-by-1e-9"),
    pytest.param(lambda: _ones().float(), lambda: None, _ones(), "FAIL", id="wrong-dtype"),
    pytest.param(lambda: _ones() * math.nan, lambda: None, _ones(), "FAIL", id="nan"),
    pytest.param(lambda: _ones()[:2], lambda: None, _ones(), "FAIL", id="wrong-shape"),
    pytest.param(lambda: _refuse("torchgram.gramian: no"), lambda: _refuse("torchgram.gramian: no"),
                 _ones(), "refused", id="refused-as-on-the-cpu"),
    pytest.param(lambda: _refuse("torchgram.gramian: no"), _ones, _ones(), "FAIL",
                 id="refused-on-the-device-only"),
    pytest.param(lambda: _refuse("CUDA error"), lambda: _refuse("CUDA error"), _ones(),
                 "FAIL", id="raw-error-on-both"),
])
def test_verdicts(on_device, on_cpu, expected, status: str) -> None:  # noqa: ANN001
    checks = device_check.Checks(torch.device("cpu"))
    checks.run("planted", "case", on_device, on_cpu, expected, torch.float64)
    assert [c.status for c in checks.items] == [status]


def test_an_answer_off_the_device_fails() -> None:
    checks = device_check.Checks(torch.device("meta"))
    checks.run("planted", "case", _ones, lambda: None, _ones(), torch.float64)
    assert checks.items[0].status == "FAIL" and "answer on cpu" in checks.items[0].detail
