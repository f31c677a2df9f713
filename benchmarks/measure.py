"""Timing and peak memory of one (case, method), in this process or in a fresh one.

# NOTE [what the numbers mean]
Time: every call goes from the inputs to the result (forward included). After two warm-up
calls (one when the first takes over ``rewarm_s``), the median of ``n`` timed calls is
reported; ``n`` is at least 5, more for fast methods, and 3 for a method whose last warm-up
call took longer than ``slow_s`` (the naive methods on the large cases; the table shows
``n``). One call, at the
end, measures memory; it is not timed. A method whose first call exceeds ``very_slow_s`` is
reported with that one (cold) call and no memory figure, so a run stays bounded.

Memory: the increase of the process's resident set during that one call, at its peak:
``VmHWM - VmRSS`` after resetting the high-water mark (``/proc/self/clear_refs``, value 5)
right before the call. Before the reset, ``gc.collect()`` and glibc's ``malloc_trim(0)``
hand every freed page back to the OS, so memory that earlier calls left in malloc's free
lists cannot hide this call's allocations, and torchgram's scratch buffer (kept between
calls, NOTE [scratch memory]) is freed, so the call's large temporaries count as allocated
within it. The figure counts everything the call touches
(activations, Jacobians, temporaries, outputs, library workspaces), not the model and
inputs that exist before it. In the default mode each (case, method) runs in a fresh
subprocess, so one method's hooks, caches or heap state cannot leak into another's numbers.
Linux only (``/proc``); elsewhere memory is reported as unknown.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks import cases, peers

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Policy:
    """How many calls to make.

    Attributes:
        min_reps: Timed calls for a method of ordinary speed.
        max_reps: Upper bound for fast methods (which get about ``target_s`` of calls).
        slow_reps: Timed calls for a method whose warm-up took longer than ``slow_s``.
        slow_s: See ``slow_reps``.
        very_slow_s: A method whose first call takes longer is timed by that call alone (cold,
            ``n = 1``) and its memory is not measured, to keep a run bounded.
        warmups: Warm-up calls (2: a second one when the first took at most ``rewarm_s``;
            the number of timed calls is chosen from the last warm-up's time).
        rewarm_s: See ``warmups``.
        target_s: Seconds of timed calls to aim for (between ``min_reps`` and ``max_reps``).
        timeout_s: Wall-clock limit of one (case, method) subprocess.
    """

    min_reps: int = 5
    max_reps: int = 15
    slow_reps: int = 3
    slow_s: float = 1.0
    very_slow_s: float = 30.0
    warmups: int = 2
    rewarm_s: float = 3.0
    target_s: float = 1.0
    timeout_s: float = 300.0


QUICK_POLICY = Policy(min_reps=1, max_reps=1, slow_reps=1, slow_s=1.0, very_slow_s=60.0,
                      warmups=1, target_s=0.0, timeout_s=120.0)


@dataclass
class Record:
    """The outcome of one (case, method).

    ``status`` is ``"ok"``, ``"skipped"`` (the method does not apply or its package is
    missing; ``message`` says which), ``"error"`` (it raised; ``message`` has the error) or
    ``"timeout"``. ``result`` (the Gramian, ``[m, m]``, or its diagonal ``[m]``; the update
    ``[P]`` for an ``aggregated`` method) is not serialized to JSON. ``weighting_s`` holds,
    for a method that calls a weighting, the seconds each timed call spent in it (aligned with
    ``times_s``).
    """

    case: str
    method: str
    kind: str
    status: str = "ok"
    message: str = ""
    times_s: list[float] = field(default_factory=list)
    first_call_s: float | None = None
    peak_bytes: int | None = None
    slow: bool = False
    threads: int = 0
    isolated: bool = False
    warnings: list[str] = field(default_factory=list)
    weighting_s: list[float] = field(default_factory=list)
    result: torch.Tensor | None = None

    @property
    def median_s(self) -> float | None:
        """The median time of the timed calls."""
        return statistics.median(self.times_s) if self.times_s else None

    @property
    def median_without_weighting_s(self) -> float | None:
        """The median over the timed calls of their time less their weighting's (if known)."""
        if not self.times_s or len(self.weighting_s) != len(self.times_s):
            return None
        return statistics.median(t - w for t, w in zip(self.times_s, self.weighting_s,
                                                       strict=True))

    def to_json(self) -> dict[str, Any]:
        """Everything but the result tensor."""
        data = asdict(self)
        data.pop("result")
        data["median_s"] = self.median_s
        data["median_without_weighting_s"] = self.median_without_weighting_s
        return data


# ----------------------------------------------------------------------------------- memory

_LIBC: Any = None


def _malloc_trim() -> None:
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
        except OSError:
            _LIBC = False
    if _LIBC and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


def _status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def peak_memory_of(call: Callable[[], Any]) -> tuple[Any, int | None]:
    """Run ``call()`` once; return its result and the peak RSS increase (bytes) during it."""
    import torchgram as tg

    tg.autograd.release_scratch()  # its pages would hide the call's temporaries
    gc.collect()
    _malloc_trim()
    ok = _reset_peak()
    base = _status_bytes("VmRSS")
    result = call()
    peak = _status_bytes("VmHWM")
    if not ok or base is None or peak is None:
        return result, None
    return result, max(peak - base, 0)


# ----------------------------------------------------------------------------------- timing

def _timed(call: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


def alternated_medians(calls: dict[str, Callable[[], Any]], rounds: int,
                       warmups: int = 1) -> dict[str, float]:
    """Each call's median seconds over ``rounds`` turns, the order reversed every other turn.

    Every call first runs ``warmups`` times untimed; within a turn each call runs once, so
    load moving on a shared machine falls on all of them alike.
    """
    for call in calls.values():
        for _ in range(warmups):
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for turn in range(rounds):
        for name in order if turn % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def error_line(error: BaseException, limit: int = 200) -> str:
    """``"Type: first line of the message"``, at most ``limit`` characters of the message.

    Example:
        >>> error_line(ValueError("bad shape\\nmore"), limit=5), error_line(KeyError())
        ('ValueError: bad s', 'KeyError: ')
    """
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0][:limit] if lines else ''}"


def set_threads(threads: int) -> None:
    """Fix torch's intra-op threads (and inter-op threads, when still possible)."""
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already started in this process: keep it
        pass


def measure(case_name: str, method_name: str, sizes: cases.Sizes, policy: Policy,
            threads: int, isolated: bool = False) -> Record:
    """Build the case, prepare the method, time it and measure its memory, in this process."""
    set_threads(threads)
    method = peers.get(method_name)
    record = Record(case_name, method_name, method.kind, threads=threads, isolated=isolated)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            case = cases.build(case_name, sizes)
            reason = method.skip_reason(case)
            if reason is not None:
                raise peers.Unavailable(reason)
            call = method.prepare(case)
            lap = getattr(call, "weighting_lap", None)  # seconds spent in the weighting
            first, result = _timed(call)
            record.first_call_s = first
            if first > policy.very_slow_s:  # keep the run bounded: that call is the only one
                record.slow, record.times_s = True, [first]
                record.weighting_s = [lap()] if lap else []
            else:
                steady = first  # the first call pays one-off costs (tracing, lazy init)
                if policy.warmups > 1 and first <= policy.rewarm_s:
                    steady, _ = _timed(call)
                record.slow = steady > policy.slow_s and policy.slow_reps < policy.min_reps
                reps = (policy.slow_reps if steady > policy.slow_s
                        else max(policy.min_reps,
                                 min(policy.max_reps, int(policy.target_s / max(steady, 1e-9)))))
                if lap:
                    lap()  # drop the warm-up calls' share
                for _ in range(reps):
                    record.times_s.append(_timed(call)[0])
                    if lap:
                        record.weighting_s.append(lap())
                result, record.peak_bytes = peak_memory_of(call)
            record.result = (None if result is None else peers.flat_result(
                result, case, vector=method.kind == peers.AGGREGATED))
        except peers.Unavailable as why:
            record.status, record.message = "skipped", str(why)
        except Exception as error:  # noqa: BLE001 — any failure is reported, not raised
            record.status = "error"
            record.message = error_line(error)
            record.warnings.append(traceback.format_exc(limit=-3))
    record.warnings.extend(sorted({f"{w.category.__name__}: {str(w.message)[:160]}"
                                   for w in caught}))
    return record


def measure_isolated(case_name: str, method_name: str, sizes_name: str, policy: Policy,
                     threads: int) -> Record:
    """:func:`measure` in a fresh ``python -m benchmarks.measure`` subprocess."""
    return measure_isolated_many(case_name, [method_name], sizes_name, policy, threads)[0]


def measure_isolated_many(case_name: str, method_names: list[str], sizes_name: str,
                          policy: Policy, threads: int) -> list[Record]:
    """:func:`measure` of each method in turn, all in one fresh subprocess (its timeout scaled).

    The aggregated section uses it, one subprocess per case, to keep a run short.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    timeout = policy.timeout_s * len(method_names)

    def failed(name: str, status: str, message: str) -> Record:
        return Record(case_name, name, peers.get(name).kind, status=status, message=message,
                      threads=threads, isolated=True)

    with tempfile.TemporaryDirectory(prefix="torchgram-bench-") as tmp:
        command = [sys.executable, "-m", "benchmarks.measure", "--case", case_name,
                   *(arg for name in method_names for arg in ("--method", name)),
                   "--sizes", sizes_name, "--threads", str(threads),
                   "--policy", json.dumps(asdict(policy)), "--out", tmp]
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return [failed(name, "timeout", f"over {timeout:.0f} s") for name in method_names]
        out, records = Path(tmp), []
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        for i, name in enumerate(method_names):  # a crash loses the methods not yet written
            if not (out / f"record{i}.json").exists():
                records.append(failed(name, "error", f"worker exited with {done.returncode}: "
                                                     f"{tail[0][:200]}"))
                continue
            data = json.loads((out / f"record{i}.json").read_text())
            data.pop("median_s", None)
            data.pop("median_without_weighting_s", None)
            record = Record(**data)
            if (out / f"result{i}.pt").exists():
                record.result = torch.load(out / f"result{i}.pt", weights_only=True)
            records.append(record)
        return records


def _worker() -> None:
    parser = argparse.ArgumentParser(description="Measure (case, method) pairs; internal.")
    parser.add_argument("--case", required=True)
    parser.add_argument("--method", required=True, action="append",
                        help="a method to measure; repeat to measure several in turn")
    parser.add_argument("--sizes", choices=("full", "quick"), required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--policy", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    sizes = cases.QUICK if args.sizes == "quick" else cases.FULL
    for i, method in enumerate(args.method):
        record = measure(args.case, method, sizes, Policy(**json.loads(args.policy)),
                         args.threads, isolated=True)
        if record.result is not None:
            torch.save(record.result, args.out / f"result{i}.pt")
        (args.out / f"record{i}.json").write_text(json.dumps(record.to_json()))


if __name__ == "__main__":
    _worker()
