"""``torchgram.ntk`` against neural-tangents, side by side, turn by turn (issue 11).

neural-tangents runs in its own venv (``benchmarks/nt/setup_venv.sh``) as a subprocess
serving timed calls on demand (``benchmarks/nt/worker.py --serve``); this process runs
torchgram. On each case both build their kernel function once (NT: every
``nt.NtkImplementation``, ``jax.jit``-ed; its first call, trace + compile + run, is timed
after a jitted forward and gradient warmed jax up; torchgram: ``tg.ntk.empirical_ntk_fn``,
whose first call is timed after torch was warmed up: :func:`warm_up_torch`), then the
timed warm calls **take turns**: one call of each NT implementation, one of torchgram, the
order rotating every round, so that both sides see the same machine load. Every answer is
compared with a dense float64 ``jacrev`` reference in NT's layout
(``benchmarks.nt.client.reference_kernel``) and torchgram's with each NT implementation's.

    python benchmarks/ntk.py              # every case, 1 thread; writes results/ntk.{md,json}
    python benchmarks/ntk.py --cases mlp-trace --repeats 30
    python benchmarks/ntk.py --quick                  # tiny sizes (smoke)
    python benchmarks/run.py                          # runs this section too (--no-ntk: not)

Without the NT venv it prints ``neural-tangents not installed: run
benchmarks/nt/setup_venv.sh`` and measures nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import torchgram as tg  # noqa: E402
from benchmarks.nt import client  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_SKIP = ("mlp-cross:NTK_VECTOR_PRODUCTS",)
"""NTK_VECTOR_PRODUCTS on the cross kernel vmaps a parameter-sized tangent over 16 × 512 ×
10 pairs (about 200 GB): skipped (``benchmarks/nt/RESULTS.md``)."""
TORCHGRAM = "torchgram ntk_fn"


class Worker:
    """The NT worker in ``--serve`` mode: one jitted kernel per implementation, on demand."""

    def __init__(self, case: client.NTCase, threads: int, implementations: list[str],
                 folder: Path, layout: str = "NHWC", max_memory_gb: float = 12.0) -> None:
        layers, arrays = client.torch_to_layers(case.module, case.x1, layout)
        arrays = {k: v.astype(np.float32) for k, v in arrays.items()}
        arrays["x1"] = client.jax_input(case.x1, layout).astype(np.float32)
        if case.x2 is not None:
            arrays["x2"] = client.jax_input(case.x2, layout).astype(np.float32)
        np.savez(folder / "request.npz", **arrays)
        request = {
            "arrays": str(folder / "request.npz"), "output": str(folder / "result"),
            "threads": threads, "x64": False, "layout": layout, "layers": layers,
            "kernels": [{"name": case.name, "x1": "x1",
                         "x2": None if case.x2 is None else "x2",
                         "trace_axes": list(case.trace_axes),
                         "diagonal_axes": list(case.diagonal_axes), "vmap_axes": 0}],
            "implementations": implementations, "max_memory_gb": max_memory_gb}
        (folder / "request.json").write_text(json.dumps(request))
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        start = time.perf_counter()
        self.process = subprocess.Popen(
            [str(client.VENV_PYTHON), str(client.WORKER), "--serve",
             str(folder / "request.json")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env)
        line = self._read()
        self.start_s = time.perf_counter() - start
        self.report = json.loads(line)["ready"]
        self.timing = self.report["kernels"][case.name]["implementations"]
        with np.load(folder / "result.npz") as result:
            self.kernels = {name.split("__", 1)[1]: result[name] for name in result.files}

    def _read(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            assert self.process.stderr is not None
            self.process.wait(timeout=60)
            raise RuntimeError(f"NT worker exited with {self.process.returncode}: "
                               f"{self.process.stderr.read()[-3000:]}")
        return line

    def call(self, name: str) -> tuple[float, float]:
        """One timed warm call of implementation ``name``: ``(wall s, CPU s)``."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"run": name}) + "\n")
        self.process.stdin.flush()
        reply = json.loads(self._read())
        return reply["wall_s"], reply["cpu_s"]

    def gemm(self, m: int, k: int, n: int) -> float:
        """GMAC/s of a jitted float32 ``[m, k] × [k, n]`` product in the worker."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"gemm": [m, k, n]}) + "\n")
        self.process.stdin.flush()
        return float(json.loads(self._read())["gmacs"])

    def close(self) -> None:
        """Ask the worker to quit."""
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps({"quit": True}) + "\n")
            self.process.stdin.flush()
            self.process.wait(timeout=60)


GEMM = (5120, 512, 512)
"""The matrix product timed on both sides: the MLP cross kernel's largest (its x2 side's
backward, ``16 × 512`` rows times ``W₂``), the kind of product the MLP cases spend most of
their time in."""


def torch_gemm_gmacs(m: int, k: int, n: int, repeats: int = 5) -> float:
    """Billions of multiply-adds per second of torch's float32 ``[m, k] × [k, n]`` product."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=generator)
    b = torch.randn(k, n, generator=generator)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return m * k * n / statistics.median(times) / 1e9


def warm_up_torch(case: client.NTCase) -> None:
    """Warm torch up as the worker warms jax up: a forward and backward of the model, and
    one batched backward (torch's first ``is_grads_batched`` in a process imports sympy,
    about 3 s, once), so that torchgram's first call measures its own tracing and planning.
    """
    with torch.enable_grad():
        case.module(case.x1).sum().backward()
        x = torch.ones(2, requires_grad=True)
        torch.autograd.grad(x * 2, x, torch.eye(2), is_grads_batched=True)
    case.module.zero_grad(set_to_none=True)
    tg.backends.backend_names()  # import every backend module (as NT's import is excluded)


def torchgram_kernel_fn(case: client.NTCase) -> tuple[Any, dict[str, torch.Tensor]]:
    """``tg.ntk.empirical_ntk_fn`` of the case's module (``tg.functionalize``), and params."""
    fn, params = tg.functionalize(case.module)
    ntk_fn = tg.ntk.empirical_ntk_fn(fn, trace_axes=case.trace_axes,
                                     diagonal_axes=case.diagonal_axes)
    return ntk_fn, {k: v.detach() for k, v in params.items()}


def run_case(case: client.NTCase, threads: int, repeats: int, max_seconds: float,
             implementations: list[str], check: bool = True) -> dict[str, Any]:
    """Both sides on one case, turn by turn; a JSON-able record (module docstring)."""
    record: dict[str, Any] = {"case": case.name, "title": case.title, "threads": threads}
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="torchgram-ntk-") as tmp:
        try:
            worker = Worker(case, threads, implementations, Path(tmp))
        except (RuntimeError, OSError, subprocess.SubprocessError) as error:
            return {**record, "error": str(error)[-2000:]}
        try:
            record["worker_start_s"] = worker.start_s
            record["versions"] = worker.report["versions"]
            record["gemm_gmacs"] = {"torch": torch_gemm_gmacs(*GEMM), "jax": worker.gemm(*GEMM)}
            ntk_fn, params = torchgram_kernel_fn(case)
            warm_up_torch(case)
            start = time.perf_counter()
            kernel = ntk_fn(case.x1, case.x2, params)
            first = time.perf_counter() - start
            ntk_fn(case.x1, case.x2, params)  # one more, untimed
            methods = {name: e for name, e in worker.timing.items() if "error" not in e}
            timing: dict[str, dict[str, list[float]]] = {
                name: {"wall": [], "cpu": []} for name in [*methods, TORCHGRAM]}
            for round_ in range(repeats):
                running = [n for n in timing if sum(timing[n]["wall"]) < max_seconds]
                if not running:
                    break
                shift = round_ % len(running)
                for name in running[shift:] + running[:shift]:
                    if name == TORCHGRAM:
                        cpu, wall = time.process_time(), time.perf_counter()
                        ntk_fn(case.x1, case.x2, params)
                        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                    else:
                        wall, cpu = worker.call(name)
                    timing[name]["wall"].append(wall)
                    timing[name]["cpu"].append(cpu)
        finally:
            worker.close()
    reference = client.reference_kernel(case) if check else None
    entries: dict[str, Any] = {}
    for name, entry in worker.timing.items():
        entries[name] = {k: v for k, v in entry.items() if k in (
            "first_call_s", "error", "auto_choice", "shape")}
    entries[TORCHGRAM] = {"first_call_s": first, "shape": list(kernel.shape),
                          "backends": list(ntk_fn.last_run.backends) if ntk_fn.last_run
                          else []}
    ours = kernel.detach().numpy()
    for name, t in timing.items():
        entries[name].update({
            "warm_median_s": statistics.median(t["wall"]) if t["wall"] else None,
            "warm_min_s": min(t["wall"]) if t["wall"] else None,
            "cpu_median_s": statistics.median(t["cpu"]) if t["cpu"] else None,
            "calls": len(t["wall"])})
        values = ours if name == TORCHGRAM else worker.kernels.get(name)
        if reference is not None and values is not None:
            entries[name]["rel_error"] = client.relative_error(values, reference)
            entries[name]["agrees"] = entries[name]["rel_error"] <= client.TOLERANCE[
                torch.float32]
        if name != TORCHGRAM and values is not None:
            entries[name]["vs_torchgram"] = client.relative_error(values, ours)
    record["methods"] = entries
    return record


def best_nt(record: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """NT's fastest implementation whose answer agrees (by warm median)."""
    timed = [(name, e) for name, e in record.get("methods", {}).items()
             if name != TORCHGRAM and e.get("warm_median_s") is not None
             and e.get("agrees", True)]
    return min(timed, key=lambda item: item[1]["warm_median_s"]) if timed else None


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{1e3 * value:.1f}"


def summary_table(records: list[dict[str, Any]]) -> str:
    """One line per case: NT's best against torchgram, by wall median and by CPU."""
    lines = ["| case | kernel | NT best | NT (ms, wall / CPU) | torchgram `ntk_fn` (ms, wall / "
             "CPU) | NT ÷ torchgram (wall / CPU) | first call NT best / torchgram (s) | "
             "agree (rel. err. vs float64) |",
             "|---|---|---|--:|--:|--:|--:|---|"]
    for record in records:
        if "methods" not in record:
            lines.append(f"| {record['case']} | — | — | — | — | — | — | "
                         f"{record.get('skipped') or record.get('error', '')[:120]} |")
            continue
        ours = record["methods"][TORCHGRAM]
        best = best_nt(record)
        shape = "×".join(map(str, ours["shape"]))
        if best is None:
            lines.append(f"| {record['case']} | [{shape}] | — | — | "
                         f"{_ms(ours['warm_median_s'])} / {_ms(ours['cpu_median_s'])} | — | — "
                         f"| — |")
            continue
        name, nt = best
        ratio_wall = nt["warm_median_s"] / ours["warm_median_s"]
        ratio_cpu = nt["cpu_median_s"] / ours["cpu_median_s"]
        nan = float("nan")
        errors = f"{ours.get('rel_error', nan):.1e} / {nt.get('rel_error', nan):.1e}"
        lines.append(
            f"| {record['case']} | [{shape}] | {name} | {_ms(nt['warm_median_s'])} / "
            f"{_ms(nt['cpu_median_s'])} | {_ms(ours['warm_median_s'])} / "
            f"{_ms(ours['cpu_median_s'])} | **{ratio_wall:.2f}×** / {ratio_cpu:.2f}× | "
            f"{nt['first_call_s']:.2f} / {ours['first_call_s']:.2f} | {errors} |")
    return "\n".join(lines)


def detail_table(records: list[dict[str, Any]]) -> str:
    """Every method of every case."""
    lines = ["| case | method | first call (s) | warm median (ms) | warm min (ms) | CPU median "
             "(ms) | calls | rel. err. vs float64 | vs torchgram | note |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|---|"]
    for record in records:
        for name, e in record.get("methods", {}).items():
            if "error" in e:
                lines.append(f"| {record['case']} | {name} | — | — | — | — | — | — | — | "
                             f"{e['error'].splitlines()[0][:120]} |")
                continue
            note = []
            if "auto_choice" in e:
                note.append(f"AUTO chose {e['auto_choice']}")
            if e.get("backends"):
                note.append("backend " + ", ".join(e["backends"]))
            if e.get("agrees") is False:
                note.append("MISMATCH")
            err = f"{e['rel_error']:.1e}" if "rel_error" in e else "—"
            vs = f"{e['vs_torchgram']:.1e}" if "vs_torchgram" in e else "—"
            lines.append(f"| {record['case']} | {name} | {e.get('first_call_s', 0):.2f} | "
                         f"{_ms(e.get('warm_median_s'))} | {_ms(e.get('warm_min_s'))} | "
                         f"{_ms(e.get('cpu_median_s'))} | {e.get('calls', 0)} | {err} | {vs} | "
                         f"{'; '.join(note)} |")
    return "\n".join(lines)


def markdown(records: list[dict[str, Any]], header: dict[str, Any]) -> str:
    """The results page."""
    return "\n\n".join([
        "# `torchgram.ntk` vs neural-tangents (issue 11)",
        f"`{header['command']}` — {header['date']}, torch {header['torch']}, "
        f"{header.get('nt_versions', '')}; {header['threads']} thread(s); load average "
        f"{header['load_before']} before, {header['load_after']} after; {header['wall_s']:.0f} s.",
        "Timed warm calls take turns (one per method per round, order rotating), so both "
        "sides see the same load; medians over the rounds. *CPU* is the process's CPU time "
        "per call (NT: the worker's, torchgram: this process's). *first call*: NT's trace + "
        "compile + run after a jitted forward and gradient; torchgram's first call of a new "
        "`ntk_fn` after a plain forward and backward and one batched backward (torch's first "
        "in a process imports sympy, ~3 s once). See `benchmarks/ntk.py`.",
        *_gemm_line(records),
        "## Summary", summary_table(records), "## Every method", detail_table(records)])


def _gemm_line(records: list[dict[str, Any]]) -> list[str]:
    """The matrix-product speed of both sides, as measured with the first case."""
    speeds = next((r["gemm_gmacs"] for r in records if "gemm_gmacs" in r), None)
    if speeds is None:
        return []
    m, k, n = GEMM
    return [f"Matrix-product speed on this machine (float32 `[{m}, {k}] × [{k}, {n}]`, the same "
            f"threads, median of 5): torch {speeds['torch']:.0f}, jax "
            f"{speeds['jax']:.0f} billion multiply-adds per second. The MLP cases spend "
            "most of their time in such products (the CNN cases in convolutions), so their "
            "ratios move with this one."]


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="mlp-full,mlp-trace,cnn-full,cnn-trace,mlp-cross")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20, help="rounds of timed calls")
    parser.add_argument("--max-seconds", type=float, default=15.0,
                        help="stop timing a method after this much warm time")
    parser.add_argument("--implementations", default=",".join(client.IMPLEMENTATIONS))
    parser.add_argument("--skip", default=",".join(DEFAULT_SKIP),
                        help="comma-separated case:IMPLEMENTATION pairs not to run")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke)")
    parser.add_argument("--no-check", action="store_true", help="skip the float64 reference")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for ntk.md / ntk.json (default benchmarks/results; "
                             "--quick: a temporary folder)")
    args = parser.parse_args(argv)
    if not client.VENV_PYTHON.exists():
        print(client.NOT_INSTALLED)
        return 0
    out = args.out or (Path(tempfile.gettempdir()) / "torchgram-ntk-quick" if args.quick
                       else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    cases = client.build_cases(args.quick)
    skip = {tuple(pair.split(":", 1)) for pair in args.skip.split(",") if pair}
    threads_before = torch.get_num_threads()
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    start = time.perf_counter()
    records = []
    try:
        for name in args.cases.split(","):
            case = cases[name]
            implementations = [i for i in args.implementations.split(",")
                               if (name, i) not in skip]
            record = run_case(case, args.threads, args.repeats, args.max_seconds,
                              implementations, check=not args.no_check)
            records.append(record)
            print(summary_table([record]).split("\n", 2)[2], flush=True)
    finally:
        torch.set_num_threads(threads_before)
    versions = next((r["versions"] for r in records if "versions" in r), {})
    header = {
        "command": "python benchmarks/ntk.py" + "".join(
            f" {shlex.quote(a)}" for a in (sys.argv[1:] if argv is None else argv)),
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "torch": torch.__version__, "threads": args.threads,
        "nt_versions": ", ".join(f"{k} {v}" for k, v in versions.items()),
        "load_before": load_before,
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "wall_s": time.perf_counter() - start}
    (out / "ntk.md").write_text(markdown(records, header) + "\n")
    (out / "ntk.json").write_text(json.dumps({"header": header, "records": records},
                                             indent=1))
    print(f"\nwrote {out / 'ntk.md'} and {out / 'ntk.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
