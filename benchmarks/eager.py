"""Eager code (issue 15), side by side in one process: ``python benchmarks/eager.py``.

On the ``mlp``, ``cnn`` and ``transformer`` cases it times, on the same eager model:

* the Gramian: a plain ``rows.sum().backward()`` (the floor), ``tg.autograd.gramian(rows,
  params, batch_dim=0)`` on the graph as built (the walk) and with the forward inside
  ``tg.autograd.record()``, torchjd's ``Engine.compute_gramian`` and, for reference, the
  functional ``tg.gramian`` (backend auto);
* one Jacobian-descent step with ``upgrad``: ``tg.autograd.backward(rows, params, upgrad,
  batch_dim=0)`` recorded and walked, torchjd's ``Engine`` + ``losses.backward(w)`` and, for
  reference, ``tg.aggregated_grad``; every method calls torchgram's ``upgrad``, whose own
  seconds are taken out of each call's time.

``--cases`` also takes the real models of ``benchmarks/real_cases.py`` (``--cases real``: all
of them: GPT-2, LLaMA and BERT with attention masks, ViT, ResNet-18, MobileNetV3, LSTM, GRU),
their per-sample losses computed eagerly from the module. A method that fails on a model is
reported with its error instead of a time.

# NOTE [interleaved timing]
``benchmarks/run.py`` measures each method in its own process, one after the other: on a
machine shared with other work, the load moves between those measurements and a ratio of two
of them can be off by many times. Here every method of a case is prepared in one process and
the timed calls are interleaved: each round calls every method once, in a shuffled order, and
a method's ratio to the floor (or torchjd's ratio to it) is the median over the rounds of the
ratio of its call to the floor's call *of the same round*. The times shown are medians too.
Answers are checked as in ``run.py`` (relative Frobenius error against ``tg.gramian`` /
``tg.aggregated_grad``; above ``report.TOLERANCE`` a method is marked MISMATCH).

Writes ``eager.md`` and ``eager.json`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import torchgram  # noqa: E402
from benchmarks import cases, peers, real_cases, report  # noqa: E402
from benchmarks.measure import error_line  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CASES = ("mlp", "cnn", "transformer")
REFERENCE = "torchgram[auto]"
STEP_REFERENCE = "torchgram aggregated_grad"
TORCHJD = "torchjd autogram"
TORCHJD_STEP = "torchjd Engine + backward(w)"
GRAMIAN_METHODS = (peers.FLOOR, peers.EAGER_WALK, peers.EAGER_RECORDED, TORCHJD, REFERENCE)
STEP_METHODS = (peers.FLOOR, peers.EAGER_STEP_WALK, peers.EAGER_STEP_RECORDED, TORCHJD_STEP,
                STEP_REFERENCE)
# Issue 15's speed-ups over torchjd, per case (the recorded Gramian and the recorded step).
SPEEDUP = {"mlp": 30.0, "cnn": 3.0, "transformer": 2.0}
AT_MOST_BACKWARD = 1.5


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds (smoke)")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"subset of {CASES} and of the real models "
                             f"{real_cases.NAMES} ('real': all of those)")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds per section (9)")
    parser.add_argument("--budget", type=float, default=60.0,
                        help="seconds of timed rounds per section at most (60)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (2)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default benchmarks/results; none with --quick)")
    return parser


def _method(name: str) -> peers.Method:
    return peers.get(name)


def _prepare(case: cases.Case, names: Sequence[str],
             failures: dict[str, str]) -> dict[str, Callable[[], Any]]:
    calls = {}
    for name in names:
        method = _method(name)
        reason = method.skip_reason(case)
        if reason is not None:
            print(f"  {name}: skipped ({reason})")
            continue
        try:
            calls[name] = method.prepare(case)
        except peers.Unavailable as why:
            print(f"  {name}: skipped ({why})")
        except Exception as error:  # a peer that cannot run this model: reported
            failures[name] = error_line(error, limit=160)
    return calls


def real_case(name: str, quick: bool) -> cases.Case:
    """A real model as a benchmark case: keyword inputs (masks) become positional ones."""
    real = real_cases.build(name, real_cases.QUICK if quick else real_cases.FULL)
    keywords = tuple(real.kw_inputs)
    count = len(real.inputs)

    def rows(model: Callable[..., Any], *inputs: torch.Tensor) -> torch.Tensor:
        return real.rows(model, *inputs[:count], **dict(zip(keywords, inputs[count:],
                                                            strict=True)))

    return cases.Case(real.name, real.title, real.module,
                      (*real.inputs, *real.kw_inputs.values()), rows)


def _answer(name: str, result: Any, case: cases.Case, step: bool) -> Any:
    if name == peers.FLOOR:
        return None
    return peers.flat_result(result, case, vector=step).double()


def _timed(call: Callable[[], Any]) -> tuple[float, Any]:
    lap = getattr(call, "weighting_lap", None)
    if lap is not None:
        lap()
    start = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - start
    return seconds - (lap() if lap is not None else 0.0), result


def section(case: cases.Case, names: Sequence[str], reference: str, step: bool,
            rounds: int, budget: float) -> dict[str, Any]:
    """Interleaved timings of ``names`` on ``case`` (NOTE [interleaved timing])."""
    failures: dict[str, str] = {}
    calls = _prepare(case, names, failures)
    answers: dict[str, Any] = {}
    for name, call in list(calls.items()):  # two warm-up calls each; the second is checked
        try:
            _timed(call)
            answers[name] = _answer(name, _timed(call)[1], case, step)
        except Exception as error:  # a peer that cannot run this model: reported
            failures[name] = error_line(error, limit=160)
            del calls[name]
    ref = answers.get(reference)
    errors = {}
    for name, answer in answers.items():
        if answer is not None and ref is not None:
            errors[name] = float((answer - ref).norm() / ref.norm().clamp_min(1e-30))
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    rng = random.Random(0)
    start = time.perf_counter()
    for done in range(rounds):
        rng.shuffle(order)
        for name in order:
            times[name].append(_timed(calls[name])[0])
        if done >= 2 and time.perf_counter() - start > budget:
            break
    return {"times": times, "errors": errors, "failures": failures}


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(result: dict[str, Any], num: str, den: str) -> float | None:
    """Median over rounds of ``num``'s time / ``den``'s time in the same round."""
    times, errors = result["times"], result["errors"]
    if num not in times or den not in times:
        return None
    if errors.get(num, 0.0) > report.TOLERANCE or errors.get(den, 0.0) > report.TOLERANCE:
        return None
    return _median([a / b for a, b in zip(times[num], times[den], strict=True)])


def targets(results: dict[str, dict[str, Any]]) -> list[tuple[str, float | None, bool | None]]:
    """Issue 15's targets: ``(label, measured ratio, met)``."""
    rows: list[tuple[str, float | None, bool | None]] = []

    def add(label: str, value: float | None, limit: float, at_most: bool) -> None:
        met = None if value is None else (value <= limit if at_most else value >= limit)
        rows.append((label, value, met))

    for name, per in results.items():
        speedup = SPEEDUP.get(name)  # the real models have the backward targets only
        gram, step = per["gramian"], per["step"]
        add(f"`{name}`: recorded Gramian ≤ {AT_MOST_BACKWARD:g}× backward",
            _ratio(gram, peers.EAGER_RECORDED, peers.FLOOR), AT_MOST_BACKWARD, True)
        if speedup is not None:
            add(f"`{name}`: recorded Gramian ≥ {speedup:g}× faster than torchjd's Engine",
                _ratio(gram, TORCHJD, peers.EAGER_RECORDED), speedup, False)
            add(f"`{name}`: walked Gramian at least as fast as torchjd's Engine",
                _ratio(gram, TORCHJD, peers.EAGER_WALK), 1.0, False)
        add(f"`{name}`: recorded JD step ≤ {AT_MOST_BACKWARD:g}× backward",
            _ratio(step, peers.EAGER_STEP_RECORDED, peers.FLOOR), AT_MOST_BACKWARD, True)
        if speedup is not None:
            add(f"`{name}`: recorded JD step ≥ {speedup:g}× faster than torchjd's Engine",
                _ratio(step, TORCHJD_STEP, peers.EAGER_STEP_RECORDED), speedup, False)
    return rows


def _table(result: dict[str, Any], torchjd: str) -> list[str]:
    lines = ["| method | time (ms) | × backward | torchjd ÷ this | rel. err | rounds |",
             "|---|--:|--:|--:|--:|--:|"]
    for name, why in result.get("failures", {}).items():
        lines.append(f"| {name} | error: {why.replace('|', '/')} | — | — | — | 0 |")
    for name, values in result["times"].items():
        t = _median(values)
        floor = _ratio(result, name, peers.FLOOR)
        jd = _ratio(result, torchjd, name)
        err = result["errors"].get(name)
        flag = " MISMATCH" if err is not None and err > report.TOLERANCE else ""
        lines.append(f"| {name} | {'—' if t is None else f'{1e3 * t:.3g}'} | "
                     f"{'—' if floor is None else f'{floor:.3g}×'} | "
                     f"{'—' if jd is None or name == torchjd else f'{jd:.3g}×'} | "
                     f"{'—' if err is None else f'{err:.1e}'}{flag} | {len(values)} |")
    return [*lines, ""]


def markdown(results: dict[str, dict[str, Any]], env: dict[str, Any]) -> str:
    lines = ["# Eager code (issue 15): torchgram's imperative API against torchjd's Engine", "",
             f"Generated by `{env['command']}` on {env['date']}.", "",
             f"torch {env['torch']}, torchgram {env['torchgram']} ({env['commit']}), torchjd "
             f"{env['torchjd']}; **{env['threads']} torch threads** on {env['cpus']} logical "
             f"CPUs; load average {env['load_before']} before the run, {env['load_after']} "
             f"after. Wall time {env['wall_s']:.0f} s.", "",
             "Every method of a case runs in one process, its timed calls interleaved with the "
             "others' in shuffled rounds; *× backward* and *torchjd ÷ this* are medians over the "
             "rounds of the ratio of two calls of the same round (NOTE [interleaved timing] in "
             "`benchmarks/eager.py`), so that load moving on a shared machine cancels out. "
             "Times are medians, forward included. The JD step's times exclude the seconds "
             "spent in the weighting (torchgram's `upgrad` for every method).", "",
             "## Targets", "", "| target | measured | met |", "|---|--:|:-:|"]
    for label, value, met in targets(results):
        lines.append(f"| {label} | {'not measured' if value is None else f'{value:.3g}×'} | "
                     f"{'—' if met is None else ('yes' if met else 'NO')} |")
    lines.append("")
    for name, per in results.items():
        lines += [f"## `{name}`: {per['title']}", "", "Gramian:", "",
                  *_table(per["gramian"], TORCHJD), "One Jacobian-descent step (upgrad):", "",
                  *_table(per["step"], TORCHJD_STEP)]
    return "\n".join(lines)


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Run, print and (unless ``--quick`` without ``--out``) write the results."""
    args = _parser().parse_args(argv)
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    sizes = cases.QUICK if args.quick else cases.FULL
    rounds = 2 if args.quick else args.rounds
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    env: dict[str, Any] = {
        "command": "python benchmarks/eager.py " + " ".join(sys.argv[1:] if argv is None
                                                            else argv),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__, "torchgram": torchgram.__version__,
        "commit": _commit(), "torchjd": _version("torchjd"), "threads": args.threads,
        "cpus": os.cpu_count(), "load_before": _load(),
    }
    start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    try:
        if "real" in names:
            names = [n for n in names if n != "real"] + list(real_cases.NAMES)
        for name in names:
            case = (real_case(name, args.quick) if name in real_cases.NAMES
                    else cases.build(name, sizes))
            print(f"== {name}: {case.title}", flush=True)
            gram = section(case, GRAMIAN_METHODS, REFERENCE, False, rounds, args.budget)
            step = section(case, STEP_METHODS, STEP_REFERENCE, True, rounds, args.budget)
            results[name] = {"title": case.title, "gramian": gram, "step": step}
            print("\n".join(_table(gram, TORCHJD) + _table(step, TORCHJD_STEP)), flush=True)
    finally:
        torch.set_num_threads(threads)
    env.update(load_after=_load(), wall_s=time.perf_counter() - start)
    text = markdown(results, env)
    print("\n".join(text.split("## Targets", 1)[1].split("\n## ", 1)[0].splitlines()))
    out = args.out if args.out is not None or args.quick else RESULTS
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "eager.md").write_text(text + "\n", encoding="utf-8")
        (out / "eager.json").write_text(json.dumps({"env": env, "cases": results}, indent=1)
                                        + "\n", encoding="utf-8")
    return results


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _commit() -> str:
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=root,
                               text=True, capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


if __name__ == "__main__":
    main()
