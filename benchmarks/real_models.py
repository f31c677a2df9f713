"""Real models: the per-sample Gramian's time against a plain backward, side by side.

``python benchmarks/real_models.py [--quick] [--models gpt2,bert] [--methods auto,vmap]
[--threads 1] [--rounds 7] [--out DIR]``

For every model of :mod:`benchmarks.real_cases` (GPT-2, LLaMA, BERT with attention masks,
ViT, ResNet-18, MobileNetV3-small, LSTM, GRU; float32, B=16, T=32; and GPT-2, the GRU and an
``nn.TransformerEncoder`` in train mode with dropout, every call re-seeded so that every method
sees one draw) it times, in one process and in alternated turns (round ``r`` calls every
method once, in reverse order every other round), the median of:

* ``backward``: ``losses.sum().backward()`` on the module (the floor of every ratio);
* ``torchgram[auto]`` and ``torchgram[structured]``: ``tg.gramian(f, batch_dim=0)``;
* ``vmap(grad)+Gram``: per-sample gradients by ``torch.func.vmap(grad)``, then ``Σ J_l J_lᵀ``;
* ``torchjd Engine``: ``Engine(model, batch_dim=0).compute_gramian(losses)``;

each method's peak memory during one more call (resident-set increase, as ``measure.py``
measures it), the agreement of every answer with a reference (``vmap(grad)``, or
``torchgram[jacobian]`` where vmap cannot run), and what ``tg.explain(..., run=True)`` says:
the number of leaves on the fallback as planned and as run, and how the pass ran. It writes
``real_models.md`` and ``real_models.json`` to ``--out`` (default ``benchmarks/results``;
with ``--quick``, tiny sizes and one round, a temporary folder).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

import torchgram as tg  # noqa: E402
from benchmarks import real_cases  # noqa: E402
from benchmarks.measure import error_line, peak_memory_of, set_threads  # noqa: E402
from benchmarks.run import _commit, _cpu, _load  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FLOOR = "backward"
TOLERANCE = 1e-4
"""Largest relative Frobenius error of an answer that agrees (float32)."""

Call = Callable[[], Any]


class Unavailable(Exception):
    """The method does not apply (its package is missing)."""


# -- the methods ----------------------------------------------------------------------------------

def _backward(case: real_cases.RealCase) -> Call:
    model, params = case.module, list(case.module.parameters())

    def call() -> None:
        for p in params:
            p.grad = None
        case.rows(model, *case.inputs, **case.kw_inputs).sum().backward()

    return call


def _torchgram(backend: str) -> Callable[[real_cases.RealCase], Call]:
    def prepare(case: real_cases.RealCase) -> Call:
        transform = tg.gramian(case.f, backend=backend, batch_dim=0)
        return lambda: transform(case.params, *case.inputs, **case.kw_inputs)

    return prepare


def _vmap_grad(case: real_cases.RealCase) -> Call:
    """Per-sample gradients by ``vmap(grad)`` over samples (a batch of one each), then Gram."""
    from torch.func import grad, vmap

    names = list(case.kw_inputs)

    def one(params: dict[str, Tensor], *sample: Tensor) -> Tensor:
        xs = [s.unsqueeze(0) for s in sample]
        kw = dict(zip(names, xs[len(xs) - len(names):], strict=True))
        return case.f(params, *xs[:len(xs) - len(names)], **kw).reshape(())

    per_sample = vmap(grad(one), in_dims=(None, *(0,) * (len(case.inputs) + len(names))))

    def call() -> Tensor:
        jac = per_sample(case.params, *case.inputs, *case.kw_inputs.values())
        total: Tensor | None = None
        for block in jac.values():
            flat = block.reshape(block.shape[0], -1)
            total = flat @ flat.T if total is None else total + flat @ flat.T
        assert total is not None
        return total

    return call


def _torchjd(case: real_cases.RealCase) -> Call:
    try:
        from torchjd.autogram import Engine
    except ImportError as error:
        raise Unavailable("package 'torchjd' is not installed") from error
    model = copy.deepcopy(case.module)  # the engine hooks the model
    engine = Engine(model, batch_dim=0)
    return lambda: engine.compute_gramian(case.rows(model, *case.inputs, **case.kw_inputs))


METHODS: dict[str, Callable[[real_cases.RealCase], Call]] = {
    FLOOR: _backward,
    "torchgram[auto]": _torchgram("auto"),
    "torchgram[structured]": _torchgram("structured"),
    "vmap(grad)+Gram": _vmap_grad,
    "torchjd Engine": _torchjd,
}
REFERENCE = "vmap(grad)+Gram"


# -- measuring ----------------------------------------------------------------------------------

@dataclass
class MethodRecord:
    """One method on one model."""

    method: str
    status: str = "ok"
    message: str = ""
    times_s: list[float] = field(default_factory=list)
    first_call_s: float | None = None
    peak_bytes: int | None = None
    error: float | None = None
    result: Tensor | None = None

    @property
    def median_s(self) -> float | None:
        """The median timed call."""
        return statistics.median(self.times_s) if self.times_s else None

    def to_json(self) -> dict[str, Any]:
        """Everything but the result."""
        data = asdict(self)
        data.pop("result")
        data["median_s"] = self.median_s
        return data


@dataclass
class ModelRecord:
    """One model: its methods, and what ``tg.explain(..., run=True)`` says."""

    name: str
    title: str
    params: int
    leaves: int
    methods: list[MethodRecord]
    fallback_planned: int | None = None
    fallback_ran: int | None = None
    ran: str = ""
    explain_agrees: bool | None = None
    notes: list[str] = field(default_factory=list)

    def get(self, method: str) -> MethodRecord | None:
        """The record of ``method``, if it was run."""
        return next((m for m in self.methods if m.method == method), None)

    def ratio(self, method: str) -> float | None:
        """``method``'s median over the floor's."""
        rec, floor = self.get(method), self.get(FLOOR)
        if rec is None or floor is None or rec.median_s is None or floor.median_s is None:
            return None
        if rec.error is not None and rec.error > TOLERANCE:
            return None
        return rec.median_s / floor.median_s

    def to_json(self) -> dict[str, Any]:
        """Every number."""
        data = asdict(self)
        data["methods"] = [m.to_json() for m in self.methods]
        return data


def _timed(call: Call) -> tuple[float, Any]:
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


def _flat(result: Any, batch: int) -> Tensor | None:
    if result is None:
        return None
    return torch.as_tensor(result).detach().reshape(batch, batch)


def _relative_error(actual: Tensor, expected: Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def measure_model(name: str, sizes: real_cases.Sizes, methods: list[str], rounds: int,
                  budget_s: float) -> ModelRecord:
    """Time ``methods`` on model ``name`` in alternated rounds; explain; check agreement."""
    case = real_cases.build(name, sizes)
    record = ModelRecord(name, case.title, case.num_params, len(case.params), [])
    calls: dict[str, Call] = {}
    for method in methods:
        rec = MethodRecord(method)
        record.methods.append(rec)
        try:
            call = _seeded(METHODS[method](case), case.seed)
            rec.first_call_s, result = _timed(call)
            _timed(call)  # warm-up
            calls[method] = call
            rec.result = _flat(result, case.batch)
        except Unavailable as why:
            rec.status, rec.message = "skipped", str(why)
        except Exception as error:  # noqa: BLE001 -- reported, not raised
            rec.status = "error"
            rec.message = error_line(error, limit=160)
    order = list(calls)
    start = time.perf_counter()
    for r in range(rounds):
        for method in order if r % 2 == 0 else order[::-1]:
            seconds, _ = _timed(calls[method])
            record.get(method).times_s.append(seconds)  # type: ignore[union-attr]
        if r >= 2 and time.perf_counter() - start > budget_s:
            break
    for method, call in calls.items():
        _, record.get(method).peak_bytes = peak_memory_of(call)  # type: ignore[union-attr]
    _check_agreement(case, record)
    _explain(case, record)
    return record


def _seeded(call: Call, seed: int | None) -> Call:
    """``call``, after ``torch.manual_seed(seed)`` when the case draws (the same draw each)."""
    if seed is None:
        return call

    def seeded() -> Any:
        torch.manual_seed(seed)
        return call()

    return seeded


def _check_agreement(case: real_cases.RealCase, record: ModelRecord) -> None:
    reference = record.get(REFERENCE)
    expected = reference.result if reference is not None else None
    if expected is None:  # vmap cannot run this model: torchgram's reference backend
        # jacobian refuses an f that draws (NOTE [draws under torch.func]); graph walks it
        backend = "jacobian" if case.seed is None else "graph"
        try:
            expected = _flat(_seeded(lambda: tg.gramian(case.f, backend=backend, batch_dim=0)(
                case.params, *case.inputs, **case.kw_inputs), case.seed)(), case.batch)
            record.notes.append(f"reference: torchgram[{backend}]")
        except Exception as error:  # noqa: BLE001
            record.notes.append(f"no reference ({type(error).__name__})")
            return
    for rec in record.methods:
        if rec.result is not None and expected is not None:
            rec.error = _relative_error(rec.result, expected)
        rec.result = None


def _explain(case: real_cases.RealCase, record: ModelRecord) -> None:
    try:
        report = _seeded(lambda: tg.explain(case.f, batch_dim=0, run=True)(
            case.params, *case.inputs, **case.kw_inputs), case.seed)()
    except Exception as error:  # noqa: BLE001
        record.notes.append(f"explain failed: {type(error).__name__}: {str(error)[:120]}")
        return
    planned = tuple(leaf.way for leaf in report.leaves)
    record.fallback_planned = planned.count("fallback")
    ran = report.ran
    if ran is None:
        return
    record.ran = f"{ran.backend} ({ran.way})" if ran.way else ran.backend
    if ran.backend == "structured":
        record.fallback_ran = ran.leaf_ways.count("fallback")
        record.explain_agrees = ran.leaf_ways == planned and report.backend == ran.backend
    else:
        record.explain_agrees = report.backend == ran.backend
    record.notes += list(ran.notes)


# -- the report ----------------------------------------------------------------------------------

def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.1f}"


def _cell(record: ModelRecord, method: str) -> str:
    rec = record.get(method)
    if rec is None:
        return ""
    if rec.status != "ok":
        return rec.status
    if rec.error is not None and rec.error > TOLERANCE:
        return f"MISMATCH ({rec.error:.0e})"
    ratio = record.ratio(method)
    return "—" if ratio is None else f"{ratio:.2f}×"


def markdown(records: list[ModelRecord], env: dict[str, Any]) -> str:
    """The results page."""
    methods = [m for m in METHODS if any(r.get(m) for r in records)]
    lines = [
        "# Real models: the per-sample Gramian against a plain backward", "",
        f"`{env['command']}` — {env['date']}, {env['commit']}, torch {env['torch']}, "
        f"{env['cpu']}, {env['threads']} torch thread(s), {env['rounds']} alternated rounds, "
        f"load average {env['load_before']} before / {env['load_after']} after, "
        f"{env['wall_s']:.0f} s.", "",
        "Times are medians; ratios are to the plain backward of the same model in the same run "
        "(float32, per-sample losses, `batch_dim=0`). Fallback leaves: planned by "
        "`tg.explain` / as run (`explain(..., run=True).ran`).", "",
        "| model | P | backward (ms) | " + " | ".join(m for m in methods if m != FLOOR)
        + " | fallback leaves | ran | explain = run |",
        "|---|--:|--:|" + "--:|" * (len(methods) - 1) + "---|---|---|",
    ]
    for r in records:
        floor = r.get(FLOOR)
        fallback = (f"{r.fallback_planned} / {r.fallback_ran} of {r.leaves}"
                    if r.fallback_planned is not None else "—")
        agrees = "—" if r.explain_agrees is None else ("yes" if r.explain_agrees else "**no**")
        lines.append(f"| {r.name} | {r.params / 1e6:.2f}M | "
                     f"{_ms(floor.median_s if floor else None)} | "
                     + " | ".join(_cell(r, m) for m in methods if m != FLOOR)
                     + f" | {fallback} | {r.ran} | {agrees} |")
    lines += ["", "| model | method | median (ms) | n | peak memory (MiB) | × backward's | "
              "rel. error |", "|---|---|--:|--:|--:|--:|--:|"]
    for r in records:
        floor = r.get(FLOOR)
        for rec in r.methods:
            mem = "—" if rec.peak_bytes is None else f"{rec.peak_bytes / 2**20:.1f}"
            mem_ratio = ("—" if rec.peak_bytes is None or floor is None or not floor.peak_bytes
                         else f"{rec.peak_bytes / floor.peak_bytes:.2f}")
            err = "—" if rec.error is None else f"{rec.error:.1e}"
            what = _ms(rec.median_s) if rec.status == "ok" else f"{rec.status}: {rec.message}"
            lines.append(f"| {r.name} | {rec.method} | {what} | {len(rec.times_s)} | {mem} | "
                         f"{mem_ratio} | {err} |")
    notes = [(r.name, note) for r in records for note in r.notes]
    if notes:
        lines += ["", "Notes:", ""] + [f"* {name}: {note}" for name, note in notes]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Time the per-sample Gramian of real models.")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (smoke)")
    parser.add_argument("--models", default=",".join((*real_cases.NAMES, *real_cases.TRAINING)))
    parser.add_argument("--methods", default="",
                        help="comma-separated substrings of method names (backward always kept)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (7; quick 1)")
    parser.add_argument("--budget", type=float, default=60.0,
                        help="seconds of timed rounds per model before stopping (after 3)")
    parser.add_argument("--out", type=Path, default=None)
    return parser


def run(argv: list[str] | None = None) -> list[ModelRecord]:
    """Parse ``argv``, measure, write ``real_models.{md,json}``; return the records."""
    args = _parser().parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    filters = [s.strip() for s in args.methods.split(",") if s.strip()]
    methods = [m for m in METHODS if m == FLOOR or not filters or any(s in m for s in filters)]
    sizes = real_cases.QUICK if args.quick else real_cases.FULL
    rounds = args.rounds or (1 if args.quick else 7)
    out = args.out or (Path(tempfile.gettempdir()) / "torchgram-real-quick" if args.quick
                       else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    threads_before = torch.get_num_threads()
    set_threads(args.threads)
    load_before, start = _load(), time.perf_counter()
    records = []
    try:
        for name in names:
            print(f"== {name}", flush=True)
            record = measure_model(name, sizes, methods, rounds, args.budget)
            records.append(record)
            for rec in record.methods:
                print(f"   {rec.method:24s} {_ms(rec.median_s):>9s} ms  "
                      f"{_cell(record, rec.method):>12s}  {rec.message}", flush=True)
            print(f"   fallback {record.fallback_planned} / {record.fallback_ran} of "
                  f"{record.leaves}, ran {record.ran}, explain agrees: "
                  f"{record.explain_agrees}", flush=True)
    finally:
        torch.set_num_threads(threads_before)
    env = {"command": "python benchmarks/real_models.py" + "".join(f" {a}" for a in argv),
           "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
           "commit": _commit(), "torch": torch.__version__, "cpu": _cpu(),
           "threads": args.threads, "rounds": rounds, "python": platform.python_version(),
           "load_before": load_before, "load_after": _load(),
           "wall_s": time.perf_counter() - start, "cpus": os.cpu_count()}
    (out / "real_models.md").write_text(markdown(records, env))
    (out / "real_models.json").write_text(json.dumps(
        {"environment": env, "models": [r.to_json() for r in records]}, indent=1))
    print(f"wrote {out / 'real_models.md'} in {env['wall_s']:.0f} s")
    return records


if __name__ == "__main__":
    run()
