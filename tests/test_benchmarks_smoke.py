"""Smoke test of the benchmark suite (benchmarks/): tiny sizes, one timed call, in-process.

It checks the machinery (every method runs, the outputs are written, the answers agree, a
wrong answer is flagged), in both sections (the Gramian, and issue 5's aggregated update
``Jᵀw``), never the timings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks import cases, measure, peers, report, run  # noqa: E402

CASES = ("mlp", "ntk-mlp", "multitask", "tied-lm", "mlp-norms")
AGGREGATED_CASES = tuple(name for name in CASES if name in peers.AGGREGATED_CASES)
# Peers that give a different answer on a case: what the agreement check exists to catch.
# torchjd 0.18's autogram Engine drops the cross terms of a weight shared by two modules
# (tied embedding / output projection); it agrees once the weights are untied. Its UPGrad
# update there may still agree (when the weights come out the same, e.g. uniform).
KNOWN_PEER_MISMATCHES = {("tied-lm", "torchjd autogram"),
                         ("tied-lm", "torchjd Engine + backward(w)")}


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, report.Results]:
    out = tmp_path_factory.mktemp("benchmarks")
    threads = torch.get_num_threads()
    results = run.run(["--quick", "--in-process", "--threads", "1", "--cases", ",".join(CASES),
                       "--out", str(out)])
    assert torch.get_num_threads() == threads  # the run leaves the process as it found it
    return out, results


@pytest.fixture(scope="module")
def quick_run(quick_results: tuple[Path, report.Results]) -> tuple[Path, dict[str, Any]]:
    out, results = quick_results
    return out, {rep.name: rep for rep in results.cases}


@pytest.fixture(scope="module")
def quick_aggregated(quick_results: tuple[Path, report.Results],
                     ) -> dict[str, report.AggregateReport]:
    return {rep.name: rep for rep in quick_results[1].aggregated}


def test_outputs_are_written(quick_run: tuple[Path, dict[str, Any]]) -> None:
    out, _ = quick_run
    text = (out / "benchmarks.md").read_text()
    assert "## Summary" in text and "## Targets" in text
    for name in CASES:
        assert f"### `{name}`" in text
    assert "| method | time (ms) | n | × backward | × best peer | peak mem (MiB) |" in text
    assert "## Aggregated gradient `Jᵀw` (issue 5)" in text
    for name in AGGREGATED_CASES:
        assert f"### `{name}` (Jᵀw)" in text
    assert ("| method | time (ms) | n | × backward | in weighting (ms) | excl. weighting (ms) |"
            in text)
    assert (out / "benchmarks.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads((out / "benchmarks.json").read_text())
    assert [c["name"] for c in data["cases"]] == list(CASES)
    assert [c["name"] for c in data["aggregated"]] == list(AGGREGATED_CASES)
    assert data["environment"]["threads"] == 1


def test_render_rewrites_the_same_page_from_the_json(quick_run: tuple[Path, dict[str, Any]],
                                                    tmp_path: Path) -> None:
    out, _ = quick_run
    run.run(["--render", str(out / "benchmarks.json"), "--out", str(tmp_path), "--no-plot"])
    expected = (out / "benchmarks.md").read_text().replace("![time relative to a plain "
                                                          "backward](benchmarks.png)\n\n", "")
    assert (tmp_path / "benchmarks.md").read_text() == expected


@pytest.mark.parametrize("name", CASES)
def test_every_method_runs_and_agrees(quick_run: tuple[Path, dict[str, Any]], name: str) -> None:
    _, reports = quick_run
    rep = reports[name]
    assert [r.method for r in rep.records] == [m.name for m in peers.all_methods()]
    for r in rep.records:
        assert r.status in ("ok", "skipped"), f"{r.method}: {r.status}: {r.message}"
        # every peer package is in the test extra: a skip is about the case, never the install
        assert "not installed" not in r.message, f"{r.method}: {r.message}"
        if r.status == "ok":
            assert len(r.times_s) == 1
    backends = [r for r in rep.records if r.method.startswith("torchgram[")]
    assert backends and all(r.status == "ok" for r in backends)
    answered = [r for r in rep.records if r.result is not None]
    assert len(answered) >= 3
    assert rep.reference == "torch.func jacrev (naive)"
    for r in answered:
        if (name, r.method) not in KNOWN_PEER_MISMATCHES:
            assert rep.agrees(r.method), f"{r.method}: rel. err {rep.errors[r.method]:.1e}"
    m = rep.info["rows"]
    assert answered[0].result.shape == ((m,) if rep.info["diagonal"] else (m, m))


@pytest.mark.parametrize("name", AGGREGATED_CASES)
def test_every_aggregated_method_runs_and_agrees(
        quick_aggregated: dict[str, report.AggregateReport], name: str) -> None:
    rep = quick_aggregated[name]
    methods = [m.name for m in peers.aggregated_methods()]
    assert [r.method for r in rep.records] == [peers.FLOOR, *methods]
    for r in rep.records:
        assert r.status == "ok", f"{r.method}: {r.status}: {r.message}"
        assert len(r.times_s) == 1
    assert rep.reference == "torchgram gramian + vjp"
    updates = [r for r in rep.records if r.kind == peers.AGGREGATED]
    assert len(updates) == 5  # aggregated_grad, gramian + vjp, torchjd, autograd.backward (2)
    num_params = cases.build(name, cases.QUICK).num_params
    for r in updates:
        assert r.result is not None and r.result.shape == (num_params,)
        if (name, r.method) not in KNOWN_PEER_MISMATCHES:
            assert rep.agrees(r.method), f"{r.method}: rel. err {rep.errors[r.method]:.1e}"
        # the weighting is timed inside each call, and subtracted per call
        assert len(r.weighting_s) == len(r.times_s) == 1
        assert 0 < r.weighting_s[0] < r.times_s[0]
        assert rep.without_weighting(r.method) == pytest.approx(r.times_s[0] - r.weighting_s[0])
    assert not any(r.weighting_s for r in rep.records if r.kind != peers.AGGREGATED)
    assert rep.time("weighting only: torchgram upgrad") is not None


def test_one_subprocess_measures_several_methods_in_turn() -> None:
    names = ["torchgram aggregated_grad", "weighting only: torchgram upgrad"]
    records = measure.measure_isolated_many("multitask", names, "quick", measure.QUICK_POLICY,
                                            threads=1)
    assert [r.method for r in records] == names
    assert all(r.status == "ok" and r.isolated for r in records), [r.message for r in records]
    update, weighting = records
    assert update.result is not None and update.result.ndim == 1
    assert len(update.weighting_s) == len(update.times_s) == 1  # survives the JSON round trip
    assert weighting.result is None and not weighting.weighting_s


def test_aggregated_section_runs_only_on_its_cases(
        quick_aggregated: dict[str, report.AggregateReport]) -> None:
    assert tuple(quick_aggregated) == AGGREGATED_CASES
    assert "ntk-mlp" not in quick_aggregated and "mlp-norms" not in quick_aggregated


def test_norm_peers_run_on_diagonal_cases(quick_run: tuple[Path, dict[str, Any]]) -> None:
    _, reports = quick_run
    statuses = {r.method: r.status for r in reports["mlp-norms"].records}
    assert statuses["opacus ghost norms"] == "ok"
    assert statuses["torch.func vmap(grad)"] == "ok"
    assert {r.method: r.status for r in reports["multitask"].records}[
        "torch.func vmap(grad)"] == "skipped"


def _info() -> dict[str, Any]:
    return {"title": "fake", "rows": 3, "params_str": "1", "diagonal": False, "batch_dim": 0}


def test_a_wrong_answer_is_flagged_and_left_out_of_the_ratios() -> None:
    G = torch.eye(3) + 0.5
    records = [
        measure.Record("fake", peers.FLOOR, "floor", times_s=[1.0]),
        measure.Record("fake", "torch.func jacrev (naive)", "peer", times_s=[4.0], result=G),
        measure.Record("fake", "fast but wrong", "peer", times_s=[0.5], result=G * 1.01),
        measure.Record("fake", "torchgram[x]", "torchgram", times_s=[2.0], result=G.clone()),
    ]
    rep = report.CaseReport("fake", _info(), records)
    assert rep.agrees("torchgram[x]") and not rep.agrees("fast but wrong")
    assert rep.best("peer").method == "torch.func jacrev (naive)"
    table = "\n".join(report.case_table(rep))
    assert "| fast but wrong | 500 | 1 | — | — |" in table and "**MISMATCH**" in table
    assert "| torchgram[x] | 2,000 | 1 | 2.00× | 0.50× |" in table


def test_a_wrong_update_is_flagged_and_the_weighting_is_taken_out_per_call() -> None:
    update = torch.arange(5.0)
    records = [
        measure.Record("fake", peers.FLOOR, "floor", times_s=[0.001]),
        measure.Record("fake", "weighting only: torchgram upgrad", peers.WEIGHTING,
                       times_s=[0.004]),
        measure.Record("fake", "torchgram aggregated_grad", peers.AGGREGATED,
                       times_s=[0.010, 0.020, 0.009], weighting_s=[0.005, 0.016, 0.004],
                       result=update.clone()),
        measure.Record("fake", "torchgram gramian + vjp", peers.AGGREGATED, times_s=[0.012],
                       weighting_s=[0.004], result=update),
        measure.Record("fake", "torchjd Engine + backward(w)", peers.AGGREGATED,
                       times_s=[0.003], weighting_s=[0.001], result=update * 1.01),
    ]
    rep = report.AggregateReport("fake", _info(), records)
    assert rep.reference == "torchgram gramian + vjp"
    assert rep.agrees("torchgram aggregated_grad")
    assert not rep.agrees("torchjd Engine + backward(w)")
    # per call 5, 4, 5 ms without the weighting: median 5 ms (not 10 - 5 of the medians)
    assert rep.without_weighting("torchgram aggregated_grad") == pytest.approx(0.005)
    assert rep.without_weighting("torchjd Engine + backward(w)") is None
    table = "\n".join(report.aggregated_case_table(rep))
    assert "| torchgram aggregated_grad | 10 | 3 | 10× | 5 | 5 | 5.00× |" in table
    assert "| torchjd Engine + backward(w) | 3 | 1 | — | 1 | — | — |" in table
    assert "**MISMATCH**" in table
    summary = "\n".join(report.aggregated_summary_table([rep]))
    assert "| `fake` | 3 | 1 | 4 / — | 5 (5.00×) | 8 (8.00×) | MISMATCH | 1.60× | — |" in summary


def test_peak_memory_counts_what_a_call_touches() -> None:
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("peak-RSS measurement needs Linux /proc")
    result, peak = measure.peak_memory_of(lambda: torch.ones(16, 2**20).sum())  # 64 MiB
    assert float(result) == 16 * 2**20
    assert peak is not None and peak >= 60 * 2**20


def test_unknown_case_is_rejected_with_the_valid_names() -> None:
    with pytest.raises(ValueError, match=r"benchmarks: expected a case in \['mlp'"):
        cases.build("nope")
    with pytest.raises(SystemExit, match="expected cases among"):
        run.run(["--quick", "--cases", "mlp,nope"])


def test_eager_benchmark_interleaves_and_checks_answers(tmp_path: Path) -> None:
    from benchmarks import eager

    threads = torch.get_num_threads()
    results = eager.main(["--quick", "--threads", "1", "--cases", "mlp", "--out",
                          str(tmp_path)])
    assert torch.get_num_threads() == threads
    for section, names in (("gramian", eager.GRAMIAN_METHODS), ("step", eager.STEP_METHODS)):
        result = results["mlp"][section]
        assert set(result["times"]) == set(names)
        assert all(len(times) == 2 for times in result["times"].values())  # two rounds
        assert all(error <= report.TOLERANCE for error in result["errors"].values()), result
    text = (tmp_path / "eager.md").read_text()
    assert "| `mlp`: recorded Gramian ≤ 1.5× backward |" in text
    assert json.loads((tmp_path / "eager.json").read_text())["cases"]["mlp"]["title"]


def test_eager_benchmark_runs_the_real_models_with_their_masks(tmp_path: Path) -> None:
    """A real model's keyword inputs reach every method; a peer that fails is reported."""
    from benchmarks import eager

    results = eager.main(["--quick", "--threads", "1", "--cases", "bert,lstm", "--out",
                          str(tmp_path)])
    for name in ("bert", "lstm"):
        gram = results[name]["gramian"]
        assert {eager.REFERENCE, peers.EAGER_RECORDED} <= set(gram["times"]), gram["failures"]
        ours = {n: e for n, e in gram["errors"].items() if n.startswith("torchgram")}
        assert all(error <= report.TOLERANCE for error in ours.values()), gram  # torchjd's
        # Engine gives another matrix on BERT (as on GPT-2 and tied weights)
    assert eager.TORCHJD in results["lstm"]["gramian"]["failures"]  # torchjd refuses RNNs
    text = (tmp_path / "eager.md").read_text()
    assert "| `bert`: recorded Gramian ≤ 1.5× backward |" in text
    assert "`bert`: recorded Gramian ≥" not in text  # no torchjd speed-up target for them


def test_embedding_ways_times_every_way_and_reports_the_pick(tmp_path: Path) -> None:
    """``embedding_ways.py --quick``: every point's ways timed, the cost model's pick named."""
    from benchmarks import embedding_ways

    embedding_ways.main(["--quick", "--threads", "1", "--out", str(tmp_path)])
    text = (tmp_path / "embedding_ways.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 4  # the quick grid
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[7] in embedding_ways.WAYS and float(cells[8]) >= 1.0
    assert "mean regret" in text


def test_auto_choice_times_every_backend_and_names_what_auto_ran(tmp_path: Path) -> None:
    """``auto_choice.py``: auto and every backend timed, their answers compared, auto's choice
    named (never the timings)."""
    from benchmarks import auto_choice

    records = auto_choice.run(["--models", "lstm,t5", "--rounds", "1", "--threads", "1",
                               "--out", str(tmp_path)])
    assert [r["model"] for r in records] == ["lstm", "t5"]
    for record in records:
        assert record["auto_ran"] in auto_choice.BACKENDS
        assert {"auto", "structured", "graph"} <= set(record["medians_s"])
        assert max(record["agreement"].values()) < 1e-4  # float32 answers agree
    text = (tmp_path / "auto_choice.md").read_text()
    assert "| t5 |" in text and json.loads((tmp_path / "auto_choice.json").read_text())


def test_weight_ways_times_both_ways_and_reports_the_pick(tmp_path: Path) -> None:
    """``weight_ways.py --quick``: both ways timed per point, the cost model's pick named."""
    from benchmarks import weight_ways

    weight_ways.main(["--quick", "--threads", "1", "--out", str(tmp_path)])
    text = (tmp_path / "weight_ways.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| conv")
            or line.startswith("| linear")]
    assert len(rows) == 4  # the quick grid
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert float(cells[4]) > 0 and float(cells[5]) > 0
        assert cells[8] in weight_ways.WAYS and float(cells[9]) >= 1.0
    assert "mean regret" in text
