"""Run the benchmark suite: ``python benchmarks/run.py [--quick] [--cases ...] [--threads N]``.

For each case and each method (plain backward, every torchgram backend, the peers) it
times the method, measures its peak memory and checks its answer against the others; on the
cases of :data:`benchmarks.peers.AGGREGATED_CASES` it does the same for the aggregated update
``Jᵀ w`` (issue 5: ``tg.aggregated_grad``, ``gramian`` + ``vjp``, torchjd's ``Engine`` +
``backward(w)``, the weighting alone). It writes ``benchmarks.md`` (tables),
``benchmarks.png`` (plot of the Gramian section) and ``benchmarks.json`` (every number) to
``--out``. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import torchgram  # noqa: E402
from benchmarks import cases, measure, peers, report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PEER_PACKAGES = ("torchjd", "opacus")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Time and measure the memory of torchgram's backends and its peers.")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, one timed call, in-process: a smoke configuration "
                             "(numbers meaningless); writes to a temporary folder by default")
    parser.add_argument("--cases", default=",".join(cases.NAMES),
                        help=f"comma-separated subset of {','.join(cases.NAMES)}")
    parser.add_argument("--methods", default="",
                        help="comma-separated substrings; keep only methods (of both sections) "
                             "whose name contains one of them (the floor is always kept)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (2)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default benchmarks/results; with --quick "
                             "<tmp>/torchgram-bench-quick)")
    isolation = parser.add_mutually_exclusive_group()
    isolation.add_argument("--isolate", dest="isolate", action="store_true", default=None,
                           help="one fresh subprocess per (case, method), per case for the "
                                "Jᵀw section (default unless --quick)")
    isolation.add_argument("--in-process", dest="isolate", action="store_false",
                           help="measure everything in this process (faster, less isolated)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--ntk", dest="ntk", action="store_true", default=None,
                        help="also run the torchgram.ntk vs neural-tangents section "
                             "(benchmarks/ntk.py; default unless --quick; skipped with a line "
                             "when the neural-tangents venv is missing)")
    parser.add_argument("--no-ntk", dest="ntk", action="store_false",
                        help="skip the neural-tangents section")
    parser.add_argument("--render", type=Path, default=None, metavar="JSON",
                        help="measure nothing: rewrite the markdown and plot from a saved "
                             "benchmarks.json (into --out, default: next to it)")
    return parser


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _commit() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=root,
                               text=True, capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit"
    return f"commit {head}{' + uncommitted changes in src/' if dirty else ''}"


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def run(argv: list[str] | None = None) -> report.Results:
    """Parse ``argv``, run the suite, write the outputs; return both sections' reports."""
    args = _parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.render is not None:
        return render(args.render, args.out or args.render.parent, plot=not args.no_plot)
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = sorted(set(names) - set(cases.NAMES))
    if unknown:
        raise SystemExit(f"benchmarks: expected cases among {list(cases.NAMES)}, but got "
                         f"{unknown}. Pass --cases with names from that list.")
    isolate = (not args.quick) if args.isolate is None else args.isolate
    sizes, sizes_name = (cases.QUICK, "quick") if args.quick else (cases.FULL, "full")
    policy = measure.QUICK_POLICY if args.quick else measure.Policy()
    out = args.out or (Path(tempfile.gettempdir()) / "torchgram-bench-quick" if args.quick
                       else RESULTS)
    out.mkdir(parents=True, exist_ok=True)

    filters = [s.strip() for s in args.methods.split(",") if s.strip()]
    methods = [m for m in peers.all_methods()
               if m.kind == "floor" or not filters or any(s in m.name for s in filters)]
    aggregated = [m for m in peers.aggregated_methods()
                  if not filters or any(s in m.name for s in filters)]
    present = set(peers.available_backends())
    missing_backends = [b for b in peers.EXPECTED_BACKENDS if b not in present]
    for b in missing_backends:
        print(f"torchgram backend {b!r} is not registered in this build: skipped")
    for package in PEER_PACKAGES:
        if _version(package) is None:
            print(f"peer package {package!r} is not installed: its method is skipped")

    threads_before = torch.get_num_threads()
    measure.set_threads(args.threads)
    try:
        results, env = _run_cases(args, names, methods, aggregated, sizes, sizes_name, policy,
                                  isolate)
    finally:
        torch.set_num_threads(threads_before)  # leave a calling process (e.g. pytest) as it was
    env["skipped_backends"] = missing_backends
    plot_name = None if args.no_plot else "benchmarks.png"
    if plot_name:
        report.plot(results.cases, out / plot_name)
    (out / "benchmarks.md").write_text(report.markdown(results.cases, env, plot_name,
                                                       results.aggregated))
    report.dump_json(results.cases, env, out / "benchmarks.json", results.aggregated)
    print(f"\nwrote {out / 'benchmarks.md'}" + (f", {out / plot_name}" if plot_name else "")
          + f", {out / 'benchmarks.json'} in {env['wall_s']:.0f} s (the Jᵀw section: "
          f"{env['aggregated_wall_s']:.0f} s)")
    if (not args.quick) if args.ntk is None else args.ntk:
        from benchmarks import ntk

        print("\n== torchgram.ntk vs neural-tangents (benchmarks/ntk.py, 1 thread)", flush=True)
        ntk.main(["--out", str(out), *(["--quick"] if args.quick else [])])
    return results


def render(path: Path, out: Path, *, plot: bool = True) -> report.Results:
    """Rewrite ``benchmarks.md`` (and the plot) in ``out`` from a saved ``benchmarks.json``."""
    data = json.loads(path.read_text())
    results = report.Results(
        [report.CaseReport.from_json(c) for c in data["cases"]],
        [report.AggregateReport.from_json(c) for c in data.get("aggregated", [])])
    out.mkdir(parents=True, exist_ok=True)
    plot_name = "benchmarks.png" if plot else None
    if plot_name:
        report.plot(results.cases, out / plot_name)
    (out / "benchmarks.md").write_text(report.markdown(results.cases, data["environment"],
                                                       plot_name, results.aggregated))
    print(f"wrote {out / 'benchmarks.md'}" + (f", {out / plot_name}" if plot_name else ""))
    return results


def _run_cases(args: argparse.Namespace, names: list[str], methods: list[peers.Method],
               aggregated: list[peers.Method], sizes: cases.Sizes, sizes_name: str,
               policy: measure.Policy, isolate: bool) -> tuple[report.Results, dict[str, Any]]:
    load_before, start = _load(), time.perf_counter()
    results = report.Results([])
    with_aggregated = [n for n in names if n in peers.AGGREGATED_CASES] if aggregated else []
    total = len(names) * len(methods) + len(with_aggregated) * len(aggregated)
    done, section_s = 0, 0.0
    for name in names:
        case = cases.build(name, sizes)
        info = cases.describe(case)
        print(f"\n== {name}: {info['title']} (m={info['rows']}, P={info['params_str']})",
              flush=True)
        records = []
        for method in methods:
            done += 1
            records.append(_measure(args, case, method, sizes, sizes_name, policy, isolate))
            print(f"[{done}/{total}] {method.name:40s} {_line(records[-1])}", flush=True)
        rep = report.CaseReport(name, info, records)
        results.cases.append(rep)
        _print_errors(rep)
        if name not in with_aggregated:
            continue
        print(f"-- {name}: aggregated update Jᵀw, w = upgrad(G)", flush=True)
        section_start = time.perf_counter()
        section = _measure_section(args, case, aggregated, sizes, sizes_name, policy, isolate)
        section_s += time.perf_counter() - section_start
        for method, record in zip(aggregated, section, strict=True):
            done += 1
            print(f"[{done}/{total}] {method.name:40s} {_line(record)}", flush=True)
        floor = [r for r in records if r.method == peers.FLOOR]  # measured once, shared
        agg = report.AggregateReport(name, info, floor + section)
        results.aggregated.append(agg)
        _print_errors(agg)

    env: dict[str, Any] = {
        "command": "python benchmarks/run.py" + "".join(f" {shlex.quote(a)}" for a in args.argv),
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "torch": torch.__version__, "torchgram": torchgram.__version__, "commit": _commit(),
        "python": platform.python_version(),
        "packages": {p: _version(p) or "not installed" for p in PEER_PACKAGES},
        "cpu": _cpu(), "cpus": os.cpu_count(), "threads": args.threads,
        "mode": (("quick sizes" if args.quick else "full sizes") + ", "
                 + ("one fresh subprocess per (case, method), per case for the Jᵀw section"
                    if isolate else "all in one process")),
        "load_before": load_before, "load_after": _load(),
        "wall_s": time.perf_counter() - start, "aggregated_wall_s": section_s,
    }
    return results, env


def _measure(args: argparse.Namespace, case: cases.Case, method: peers.Method,
             sizes: cases.Sizes, sizes_name: str, policy: measure.Policy,
             isolate: bool) -> measure.Record:
    reason = method.skip_reason(case)
    if reason is not None:
        return measure.Record(case.name, method.name, method.kind, status="skipped",
                              message=reason)
    if isolate:
        return measure.measure_isolated(case.name, method.name, sizes_name, policy,
                                        args.threads)
    return measure.measure(case.name, method.name, sizes, policy, args.threads)


def _measure_section(args: argparse.Namespace, case: cases.Case, methods: list[peers.Method],
                     sizes: cases.Sizes, sizes_name: str, policy: measure.Policy,
                     isolate: bool) -> list[measure.Record]:
    """The aggregated section's methods on ``case``: isolated, all in one fresh subprocess."""
    if not isolate:
        return [_measure(args, case, m, sizes, sizes_name, policy, isolate) for m in methods]
    reasons = {m.name: m.skip_reason(case) for m in methods}
    runnable = [m.name for m in methods if reasons[m.name] is None]
    measured = iter(measure.measure_isolated_many(case.name, runnable, sizes_name, policy,
                                                  args.threads) if runnable else [])
    return [next(measured) if reasons[m.name] is None
            else measure.Record(case.name, m.name, m.kind, status="skipped",
                                message=reasons[m.name] or "")
            for m in methods]


def _print_errors(rep: report.CaseReport) -> None:
    for method, err in rep.errors.items():
        flag = "" if rep.agrees(method) else "   <-- MISMATCH"
        print(f"    rel. err vs {rep.reference}: {method:40s} {err:.1e}{flag}")


def _line(r: measure.Record) -> str:
    if r.status != "ok":
        return f"{r.status}: {r.message}"
    mem = "?" if r.peak_bytes is None else f"{r.peak_bytes / 2**20:.1f} MiB"
    return f"{(r.median_s or 0) * 1e3:10.2f} ms (n={len(r.times_s)})  peak {mem}"


if __name__ == "__main__":
    run()
