"""Agreement check, markdown tables, PNG plot and JSON dump of a benchmark run.

Two sections: the Gramian (one :class:`CaseReport` per case) and the aggregated update
``Jᵀ w`` of issue 5 (one :class:`AggregateReport` per case it covers); see
``benchmarks/README.md``.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from benchmarks.measure import Record
from benchmarks.peers import (
    EAGER_RECORDED,
    EAGER_STEP_RECORDED,
    EAGER_WALK,
    FLOOR,
    WEIGHTING,
    WEIGHTING_ROW,
)

# The answer every other one is compared with: the first of these that produced one.
# torch.func's naive jacrev is the most direct definition of G = J Jᵀ, so it comes first.
REFERENCE_ORDER = ("torch.func jacrev (naive)", "torch.func vmap(grad)", "torchgram[jacobian]")
# Relative Frobenius error above which a method is flagged and kept out of every ratio.
# float32 Gramians computed in different orders agree to ~1e-6; a missing term is ~1e-2.
TOLERANCE = 1e-4
# Kinds whose records have no answer to check (their time counts without one).
UNCHECKED_KINDS = ("floor", WEIGHTING)


@dataclass
class CaseReport:
    """One case's records, with the agreement check and the ratios derived from them."""

    reference_order: ClassVar[tuple[str, ...]] = REFERENCE_ORDER
    name: str
    info: dict[str, Any]
    records: list[Record]
    reference: str | None = None
    errors: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_agreement()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CaseReport:
        """Rebuild a report from :func:`dump_json`'s entry (answers are not stored: errors are)."""
        records, errors = [], {}
        for raw in data["records"]:
            raw = dict(raw)
            err = raw.pop("rel_err", None)
            raw.pop("median_s", None)
            raw.pop("median_without_weighting_s", None)
            records.append(Record(**raw))
            if err is not None:
                errors[raw["method"]] = math.inf if isinstance(err, str) else float(err)
        info = {k: data[k] for k in ("title", "rows", "params", "batch_dim", "diagonal",
                                     "params_str")}
        rep = cls(data["name"], info, records)
        rep.reference, rep.errors = data["reference"], errors
        return rep

    def _check_agreement(self) -> None:
        answered = {r.method: r.result for r in self.records
                    if r.status == "ok" and r.result is not None}
        if not answered:
            return
        self.reference = next((name for name in self.reference_order if name in answered),
                              next(iter(answered)))
        expected = answered[self.reference].double()
        scale = expected.norm().clamp_min(torch.finfo(torch.float64).tiny)
        for name, result in answered.items():
            if result.shape != expected.shape:
                self.errors[name] = math.inf
            else:
                self.errors[name] = float((result.double() - expected).norm() / scale)

    def agrees(self, method: str) -> bool:
        """Whether ``method`` produced an answer within :data:`TOLERANCE` of the reference."""
        return self.errors.get(method, math.inf) <= TOLERANCE

    def time(self, method: str) -> float | None:
        """The median time of ``method``, if it ran (and agreed, unless it has no answer)."""
        for r in self.records:
            if r.method == method and r.status == "ok" and (r.kind in UNCHECKED_KINDS or
                                                            self.agrees(method)):
                return r.median_s
        return None

    def best(self, kind: str) -> Record | None:
        """The fastest record of ``kind`` whose answer agrees."""
        candidates = [r for r in self.records
                      if r.kind == kind and r.status == "ok" and self.agrees(r.method)]
        return min(candidates, key=lambda r: r.median_s or math.inf, default=None)

    def record(self, method: str) -> Record | None:
        """The record of ``method``."""
        return next((r for r in self.records if r.method == method), None)


class AggregateReport(CaseReport):
    """One case of the aggregated section: the update ``Jᵀ w``, ``w = upgrad(G)``, three ways.

    Its records are the Gramian section's floor, the weighting-only rows and the aggregated
    methods; the updates (vectors) are compared with the plain ``gramian`` + ``vjp``.
    """

    reference_order: ClassVar[tuple[str, ...]] = (
        "torchgram gramian + vjp", "torchgram aggregated_grad", "torchjd Engine + backward(w)")

    def without_weighting(self, method: str) -> float | None:
        """``method``'s median time without its calls' weighting time (the floor's as is).

        ``None`` when the method did not run, disagrees, or is a weighting-only row.
        """
        r = self.record(method)
        if r is None or self.time(method) is None:
            return None
        if r.kind == "floor":
            return r.median_s
        return r.median_without_weighting_s

    def in_weighting(self, method: str) -> float | None:
        """The median time ``method``'s calls spent in the weighting."""
        r = self.record(method)
        if r is None or r.status != "ok" or not r.weighting_s:
            return None
        return statistics.median(r.weighting_s)


@dataclass
class Results:
    """A run's reports: the Gramian section's and the aggregated ``Jᵀw`` section's."""

    cases: list[CaseReport]
    aggregated: list[AggregateReport] = field(default_factory=list)


# ------------------------------------------------------------------------------ formatting

def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 1000 else f"{ms:,.0f}"


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base <= 0:
        return "—"
    r = value / base
    return f"{r:.2f}×" if r < 10 else f"{r:.3g}×"


def _mib(n: int | None) -> str:
    if n is None:
        return "—"
    mib = n / 2**20
    return f"{mib:.1f}" if mib < 100 else f"{mib:,.0f}"


def _err(value: float | None) -> str:
    if value is None:
        return "—"
    return "shape differs" if math.isinf(value) else f"{value:.1e}"


def case_table(report: CaseReport) -> list[str]:
    """The markdown section of one case."""
    floor = report.time(FLOOR)
    best_peer = report.best("peer")
    peer_time = best_peer.median_s if best_peer else None
    info = report.info
    lines = [f"### `{report.name}`: {info['title']}", "",
             f"m = {info['rows']} rows, P = {info['params_str']} parameters"
             f"{', diagonal only' if info['diagonal'] else ''}; "
             f"batch_dim = {info['batch_dim']}. Reference for rel. err: "
             f"{report.reference or '—'}. Best peer: "
             f"{best_peer.method if best_peer else '—'}.", "",
             "| method | time (ms) | n | × backward | × best peer | peak mem (MiB) | rel. err | "
             "note |",
             "|---|--:|--:|--:|--:|--:|--:|---|"]
    for r in report.records:
        note = ""
        if r.status == "skipped":
            note = f"skipped: {r.message}"
        elif r.status != "ok":
            note = f"**{r.status}**: {r.message}"
        elif r.method != FLOOR and not report.agrees(r.method):
            note = "**MISMATCH**: answer differs, left out of every ratio"
        elif r.method == FLOOR:
            note = "no Gramian: the cost of one training step"
        elif r.slow and r.peak_bytes is None and len(r.times_s) == 1:
            note = "very slow: one cold call timed, memory not measured"
        elif r.slow:
            note = f"slow: {len(r.times_s)} timed calls only"
        if r.status != "ok":
            lines.append(f"| {r.method} | — | — | — | — | — | — | {note} |")
            continue
        agrees = r.method == FLOOR or report.agrees(r.method)
        lines.append(
            f"| {r.method} | {_ms(r.median_s)} | {len(r.times_s)} | "
            f"{_ratio(r.median_s, floor) if agrees else '—'} | "
            f"{_ratio(r.median_s, peer_time) if agrees and r.method != FLOOR else '—'} | "
            f"{_mib(r.peak_bytes)} | {_err(report.errors.get(r.method))} | {note} |")
    return [*lines, ""]


AGGREGATED_INTRO = (
    "The Jacobian-descent update `Jᵀw` with `w = torchgram.weighting.upgrad(G)`, computed by "
    "`tg.aggregated_grad(f, upgrad, batch_dim=...)` (backend auto), by `tg.gramian` (backend "
    "auto) then a separate `torch.func.vjp` with `w`, and by torchjd "
    "(`engine.compute_gramian(losses)`, then `losses.backward(w)`). All three call the same "
    "weighting, torchgram's `upgrad` (on torchjd's Gramian too, to compare like with like), so "
    "they differ only in how they get `G` and `Jᵀw`. The weighting's QP can cost more than the "
    "rest, so each call's time inside it is counted (*in weighting*) and *excl. weighting* is "
    "the median of each call's time less that; the weighting is also timed alone on the "
    "case's Gramian, torchjd's own `UPGradWeighting` too (for reference: no method here calls "
    "it). × backward: against the plain `loss.sum().backward()` of the Gramian section. "
    "rel. err: relative error of the update against `gramian + vjp`; above the same tolerance "
    "a method is marked MISMATCH and left out of every ratio.")
_AGG_METHODS = ("torchgram aggregated_grad", "torchgram gramian + vjp",
                "torchjd Engine + backward(w)")
_WEIGHTING_JD = "weighting only: torchjd UPGradWeighting"


def aggregated_summary_table(reports: Sequence[AggregateReport]) -> list[str]:
    """One line per case: each method's time excluding the weighting, and the speed-ups."""
    lines = ["Each method's cell: time excl. weighting in ms (× backward). Speed-up: the other "
             "method's time excl. weighting / `aggregated_grad`'s.", "",
             "| case | m | backward (ms) | upgrad alone (ms): torchgram / torchjd | "
             + " | ".join(_AGG_METHODS)
             + " | aggregated_grad speed-up vs gramian + vjp | vs torchjd |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for rep in reports:
        floor = rep.time(FLOOR)
        cells = []
        for name in _AGG_METHODS:
            r = rep.record(name)
            t = rep.without_weighting(name)
            if r is None:
                cells.append("—")
            elif r.status != "ok":
                cells.append(r.status)
            elif not rep.agrees(name):
                cells.append("MISMATCH")
            else:
                cells.append("—" if t is None else f"{_ms(t)} ({_ratio(t, floor)})")
        agg, vjp, jd = (rep.without_weighting(name) for name in _AGG_METHODS)
        lines.append(
            f"| `{rep.name}` | {rep.info['rows']} | {_ms(floor)} | "
            f"{_ms(rep.time(WEIGHTING_ROW))} / {_ms(rep.time(_WEIGHTING_JD))} | "
            f"{' | '.join(cells)} | {_ratio(vjp, agg)} | {_ratio(jd, agg)} |")
    return [*lines, ""]


def aggregated_case_table(report: AggregateReport) -> list[str]:
    """The markdown section of one case of the aggregated section."""
    floor, info = report.time(FLOOR), report.info
    lines = [f"### `{report.name}` (Jᵀw): {info['title']}", "",
             f"m = {info['rows']} rows, P = {info['params_str']} parameters; "
             f"batch_dim = {info['batch_dim']}. Reference for rel. err: "
             f"{report.reference or '—'}.", "",
             "| method | time (ms) | n | × backward | in weighting (ms) | excl. weighting (ms) | "
             "excl. weighting × backward | peak mem (MiB) | rel. err | note |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
    for r in report.records:
        if r.status != "ok":
            note = (f"skipped: {r.message}" if r.status == "skipped"
                    else f"**{r.status}**: {r.message}")
            lines.append(f"| {r.method} | — | — | — | — | — | — | — | — | {note} |")
            continue
        unchecked = r.kind in UNCHECKED_KINDS
        agrees = unchecked or report.agrees(r.method)
        if r.method == FLOOR:
            note = "no weighting, no Gramian: one training step (the Gramian section's)"
        elif r.method == WEIGHTING_ROW:
            note = "the weighting alone on the case's Gramian: the one every method calls"
        elif unchecked:
            note = "the weighting alone on the case's Gramian: for reference, not called"
        elif not agrees:
            note = "**MISMATCH**: update differs, left out of every ratio"
        elif r.slow:
            note = f"slow: {len(r.times_s)} timed calls only"
        else:
            note = ""
        excl = report.without_weighting(r.method)
        lines.append(
            f"| {r.method} | {_ms(r.median_s)} | {len(r.times_s)} | "
            f"{_ratio(r.median_s, floor) if agrees else '—'} | "
            f"{_ms(report.in_weighting(r.method))} | {_ms(excl)} | {_ratio(excl, floor)} | "
            f"{_mib(r.peak_bytes)} | "
            f"{'—' if unchecked else _err(report.errors.get(r.method))} | {note} |")
    return [*lines, ""]


EAGER_INTRO = (
    "The imperative API on a plain eager forward of the module: `tg.autograd.gramian(rows, "
    "params, batch_dim=0)` on the graph as built (`torchgram autograd.gramian`, the "
    "sample-sparse walk) and with the forward inside `tg.autograd.record()` (`+ record`); one "
    "Jacobian-descent step is `tg.autograd.backward(rows, params, upgrad, batch_dim=0)` "
    "(section below), against torchjd's `Engine.compute_gramian` + `losses.backward(w)`.")


def summary_table(reports: Sequence[CaseReport]) -> list[str]:
    """One line per case: the floor, the best torchgram backend, the best peer."""
    lines = ["| case | m | P | backward (ms) | best torchgram | × backward | best peer | "
             "× backward | torchgram speed-up vs best peer | peak MiB torchgram / torchjd |",
             "|---|--:|--:|--:|---|--:|---|--:|--:|--:|"]
    for rep in reports:
        floor = rep.time(FLOOR)
        tg_best, peer = rep.best("torchgram"), rep.best("peer")
        jd = rep.record("torchjd autogram")
        tg_t = tg_best.median_s if tg_best else None
        peer_t = peer.median_s if peer else None
        speedup = _ratio(peer_t, tg_t)
        jd_mem = jd.peak_bytes if jd is not None and rep.agrees(jd.method) else None
        lines.append(
            f"| `{rep.name}` | {rep.info['rows']} | {rep.info['params_str']} | {_ms(floor)} | "
            f"{tg_best.method if tg_best else '—'} | {_ratio(tg_t, floor)} | "
            f"{peer.method if peer else '—'} | {_ratio(peer_t, floor)} | {speedup} | "
            f"{_mib(tg_best.peak_bytes if tg_best else None)} / {_mib(jd_mem)} |")
    return [*lines, ""]


# Targets of issue 4, checked on torchgram[auto] (the default backend).
_AUTO = "torchgram[auto]"


def _target_rows(reports: Sequence[CaseReport]) -> list[tuple[str, str, bool | None]]:
    by_name = {r.name: r for r in reports}
    rows: list[tuple[str, str, bool | None]] = []

    def ratio(case: str, num: str | None, den: str | None) -> float | None:
        rep = by_name.get(case)
        if rep is None or num is None or den is None:
            return None
        a, b = rep.time(num), rep.time(den)
        return None if a is None or b is None else a / b

    def add(label: str, value: float | None, limit: float, at_most: bool, unit: str = "×") -> None:
        if value is None:
            rows.append((label, "not measured", None))
        else:
            rows.append((label, f"{value:.3g}{unit}",
                         value <= limit if at_most else value >= limit))

    for case, limit in (("mlp", 1.5), ("cnn", 2.0), ("transformer", 2.0)):
        add(f"`{case}`: auto ≤ {limit}× backward", ratio(case, _AUTO, FLOOR), limit, True)
    for case, limit in (("mlp", 20.0), ("cnn", 2.0), ("transformer", 2.0)):
        add(f"`{case}`: auto ≥ {limit:g}× faster than torchjd",
            ratio(case, "torchjd autogram", _AUTO), limit, False)
    for case in ("mlp", "cnn", "transformer"):
        rep = by_name.get(case)
        auto, jd = (rep.record(_AUTO), rep.record("torchjd autogram")) if rep else (None, None)
        if (auto is None or jd is None or auto.peak_bytes is None or jd.peak_bytes is None
                or rep is None or not rep.agrees(_AUTO) or not rep.agrees(jd.method)):
            rows.append((f"`{case}`: auto peak memory ≤ torchjd's", "not measured", None))
        else:
            rows.append((f"`{case}`: auto peak memory ≤ torchjd's",
                         f"{_mib(auto.peak_bytes)} vs {_mib(jd.peak_bytes)} MiB",
                         auto.peak_bytes <= jd.peak_bytes))
    add("`ntk-mlp`: auto ≥ 10× faster than naive jacrev",
        ratio("ntk-mlp", "torch.func jacrev (naive)", _AUTO), 10.0, False)
    for rep in reports:
        best = rep.best("torchgram")
        add(f"`{rep.name}`: auto ≤ 2× the best backend ({best.method if best else '—'})",
            ratio(rep.name, _AUTO, best.method if best else None), 2.0, True)
    return rows


def targets_table(reports: Sequence[CaseReport]) -> list[str]:
    """Issue 4's targets, measured in this run."""
    lines = ["| target | measured | met |", "|---|--:|:-:|"]
    for label, value, met in _target_rows(reports):
        lines.append(f"| {label} | {value} | {'—' if met is None else ('yes' if met else 'NO')} |")
    return [*lines, ""]


# Targets of issue 15 (eager code), per case: the Gramian of the recorded forward against the
# plain backward and against torchjd's Engine, the walk against torchjd, and the same for one
# Jacobian-descent step (times without the weighting's own).
_EAGER_SPEEDUP = {"mlp": 30.0, "cnn": 3.0, "transformer": 2.0}


def eager_rows(reports: Sequence[CaseReport],
               aggregated: Sequence[AggregateReport]) -> list[tuple[str, str, bool | None]]:
    """Issue 15's targets: ``(label, measured, met)``."""
    cases = {r.name: r for r in reports}
    steps = {r.name: r for r in aggregated}
    rows: list[tuple[str, str, bool | None]] = []

    def add(label: str, num: float | None, den: float | None, limit: float,
            at_most: bool) -> None:
        if num is None or den is None:
            rows.append((label, "not measured", None))
            return
        value = num / den
        rows.append((label, f"{value:.3g}×", value <= limit if at_most else value >= limit))

    for name, speedup in _EAGER_SPEEDUP.items():
        rep, step = cases.get(name), steps.get(name)
        t = rep.time if rep is not None else (lambda method: None)
        floor, jd = t(FLOOR), t("torchjd autogram")
        add(f"`{name}`: recorded Gramian ≤ 1.5× backward", t(EAGER_RECORDED), floor, 1.5, True)
        add(f"`{name}`: recorded Gramian ≥ {speedup:g}× faster than torchjd", jd,
            t(EAGER_RECORDED), speedup, False)
        add(f"`{name}`: walked Gramian at least as fast as torchjd", jd, t(EAGER_WALK), 1.0,
            False)
        w = step.without_weighting if step is not None else (lambda method: None)
        add(f"`{name}`: recorded JD step ≤ 1.5× backward (without the weighting)",
            w(EAGER_STEP_RECORDED), w(FLOOR), 1.5, True)
        add(f"`{name}`: recorded JD step ≥ {speedup:g}× faster than torchjd (without the "
            "weighting)", w("torchjd Engine + backward(w)"), w(EAGER_STEP_RECORDED), speedup,
            False)
    return rows


def eager_table(reports: Sequence[CaseReport],
                aggregated: Sequence[AggregateReport]) -> list[str]:
    """Issue 15's targets, measured in this run."""
    lines = ["| target | measured | met |", "|---|--:|:-:|"]
    for label, value, met in eager_rows(reports, aggregated):
        lines.append(f"| {label} | {value} | {'—' if met is None else ('yes' if met else 'NO')} |")
    return [*lines, ""]


def _load_warning(env: dict[str, Any]) -> list[str]:
    """A warning when other work was running: the run's threads did not have the CPUs."""
    try:
        load = float(str(env["load_before"]).split()[0])
    except (KeyError, ValueError, IndexError):
        return []
    if load + env["threads"] <= (env["cpus"] or 1) + 0.5:
        return []
    return [f"**Warning: the machine was busy (1-minute load average {load:.1f} on "
            f"{env['cpus']} CPUs before the run, which used {env['threads']} threads): these "
            "timings are unreliable. Regenerate them on a quiet machine.**", ""]


def markdown(reports: Sequence[CaseReport], env: dict[str, Any], plot_name: str | None,
             aggregated: Sequence[AggregateReport] = ()) -> str:
    """The whole results page."""
    peers = ", ".join(f"{k} {v}" for k, v in env["packages"].items())
    lines = [
        "# torchgram benchmarks", "",
        f"Generated by `{env['command']}` on {env['date']}.", "",
        *_load_warning(env),
        f"torch {env['torch']}, torchgram {env['torchgram']} ({env['commit']}), "
        f"Python {env['python']}; {peers}.  ",
        f"CPU: {env['cpu']} ({env['cpus']} logical CPUs), **{env['threads']} torch threads**; "
        f"load average {env['load_before']} before the run, {env['load_after']} after.  ",
        f"Mode: {env['mode']}. Wall time of the run: {env['wall_s']:.0f} s"
        + (f" (the Jᵀw section: {env['aggregated_wall_s']:.0f} s)."
           if "aggregated_wall_s" in env else "."), "",
        "Time: median of `n` calls after warm-up, each from the inputs to the result (forward "
        "included). Peak mem: increase of the resident set during one call (see "
        "`benchmarks/README.md`). × best peer: against the fastest non-torchgram method whose "
        f"answer agrees. rel. err: relative Frobenius error against the reference; above "
        f"{TOLERANCE:g} a method is marked MISMATCH and left out of every ratio.", "",
    ]
    if plot_name:
        lines += [f"![time relative to a plain backward]({plot_name})", ""]
    lines += ["## Summary", "", *summary_table(reports),
              "## Targets (issue 4, on `torchgram[auto]`)", "", *targets_table(reports),
              "## Eager code (issue 15)", "", EAGER_INTRO, "", *eager_table(reports, aggregated),
              "## Cases", ""]
    for rep in reports:
        lines += case_table(rep)
    if env.get("skipped_backends"):
        lines += ["Torchgram backends planned but not in this build: "
                  + ", ".join(env["skipped_backends"]) + ".", ""]
    if aggregated:
        lines += ["## Aggregated gradient `Jᵀw` (issue 5)", "", AGGREGATED_INTRO, "",
                  *aggregated_summary_table(aggregated)]
        for rep in aggregated:
            lines += aggregated_case_table(rep)
    return "\n".join(lines)


def plot(reports: Sequence[CaseReport], path: Path) -> None:
    """Bars of each method's time relative to the plain backward (log scale), one panel a case.

    A method whose answer disagrees is drawn hatched in red and labelled "(wrong)".
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, NullFormatter

    colors = {"floor": "#9e9e9e", "torchgram": "#1f77b4", "peer": "#ff7f0e"}
    shown = [r for r in reports if r.time(FLOOR)]
    if not shown:
        return
    cols = min(3, len(shown))
    rows = math.ceil(len(shown) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.4 * cols, 3.1 * rows + 0.6), squeeze=False)
    for ax, rep in zip(axes.flat, shown, strict=False):
        floor = rep.time(FLOOR)
        assert floor is not None
        bars = [(r.method + ("" if r.method == FLOOR or rep.agrees(r.method) else " (wrong)"),
                 r.median_s / floor, r.kind, r.method == FLOOR or rep.agrees(r.method))
                for r in rep.records if r.status == "ok" and r.median_s]
        bars.reverse()
        drawn = ax.barh([b[0] for b in bars], [b[1] for b in bars],
                        color=[colors[b[2]] if b[3] else "#d62728" for b in bars])
        for bar, b in zip(drawn, bars, strict=True):
            if not b[3]:
                bar.set_hatch("//")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{rep.name}  (backward: {_ms(floor)} ms)", fontsize=9)
        ax.tick_params(axis="both", labelsize=7)
        for y, b in enumerate(bars):
            ax.text(b[1], y, f" {b[1]:.3g}×", va="center", fontsize=6)
        ax.margins(x=0.15)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    fig.legend(handles=[Patch(color=colors["floor"], label="plain backward (floor)"),
                        Patch(color=colors["torchgram"], label="torchgram"),
                        Patch(color=colors["peer"], label="peers"),
                        Patch(facecolor="#d62728", hatch="//", label="wrong answer")],
               loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("time / plain loss.sum().backward()  (log scale; lower is better)", fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _json_err(value: float | None) -> float | str | None:
    return "shape differs" if value is not None and math.isinf(value) else value


def _json_reports(reports: Sequence[CaseReport]) -> list[dict[str, Any]]:
    return [{"name": rep.name, **rep.info, "reference": rep.reference,
             "records": [{**r.to_json(), "rel_err": _json_err(rep.errors.get(r.method))}
                         for r in rep.records]}
            for rep in reports]


def dump_json(reports: Sequence[CaseReport], env: dict[str, Any], path: Path,
              aggregated: Sequence[AggregateReport] = ()) -> None:
    """Every number of the run, for later comparison (the aggregated section under its key)."""
    data = {"environment": env, "tolerance": TOLERANCE, "cases": _json_reports(reports),
            "aggregated": _json_reports(aggregated)}
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
