"""Fuzzed calls from several threads at once: each gives what it gives alone.

A few generated calls (``fuzz_strategies.cases``) are first made one by one in this thread:
each answer is checked against the dense float64 oracle as in the Gramian property
(``fuzz_check``), and each refusal noted. Then :data:`THREADS` threads make all of them
again, every call twice, the two copies taken by two threads at nearly the same time (the
same function object, module and arguments: what a serving process or a notebook with
background work does). Every concurrent call must give the oracle's matrix where it answered
alone, a torchgram error where it refused alone, and afterwards no argument, module or
global switch may have changed (NOTE [threads] in ``torchgram._core.threads``).

Calls whose ``f`` draws random numbers are made without their dropout layers: a call's draws
start from the default generator's state when it starts (NOTE [one draw]), which the other
threads move, so no fixed oracle exists for them. Second calls (``case.repeat``) are left out:
each thread makes its own first call of a shared function.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from fuzz_arch import Built, FuzzCase, build, without_dropout
from fuzz_check import Snapshot, _call, _compare, oracle, run
from reference import Dense

THREADS = 3
"""Threads making the calls (each call is made twice, by two of them)."""

TIMEOUT_S = 600.0
"""A thread still running after this long counts as hung (a deadlock)."""


@dataclass
class Job:
    """One call, its oracle and how it ended when made alone."""

    case: FuzzCase
    built: Built
    backend: str
    expected: Dense | None
    alone: str


def without_draws(case: FuzzCase) -> FuzzCase:
    """``case`` without its dropout layers and second call (module docstring)."""
    return dataclasses.replace(without_dropout(case), repeat="none")


def check_concurrently(cases: Sequence[FuzzCase], backend: str) -> list[str]:
    """The property on ``cases`` with ``backend``; how each call ended alone."""
    jobs = []
    for case in map(without_draws, cases):
        built = build(case)
        expected = oracle(case)
        jobs.append(Job(case, built, backend, expected, _call(case, built, backend, expected)))
    snapshots = [Snapshot.take(job.built.args, job.built.kwargs, job.built.module)
                 for job in jobs]
    work: queue.Queue[Job] = queue.Queue()
    for job in jobs:
        work.put(job)
        work.put(job)  # the same call again, for the next free thread
    failures: list[str] = []
    start = threading.Barrier(THREADS)

    def worker() -> None:
        start.wait()
        while True:
            try:
                job = work.get_nowait()
            except queue.Empty:
                return
            failure = _concurrent_failure(job)
            if failure is not None:
                failures.append(f"{job.backend}: {failure}\n  {job.case!r}")

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a thread hung (deadlock?)"
    assert not failures, f"{len(failures)} concurrent calls went wrong:\n" + "\n".join(failures)
    for job, snapshot in zip(jobs, snapshots, strict=True):
        snapshot.assert_unchanged(job.built.module)
    return [job.alone for job in jobs]


def _concurrent_failure(job: Job) -> str | None:
    """What went wrong with ``job`` made beside other threads' calls, if anything."""
    try:
        result = run(job.built, job.backend, no_grad=job.case.grad_mode == "no_grad")
    except Exception as error:  # noqa: BLE001 -- the property is about which errors escape
        if job.alone == "answered":
            return f"answered alone, raised beside others: {type(error).__name__}: {error}"
        if not str(error).startswith("torchgram."):
            return f"a raw error escaped: {type(error).__name__}: {error}"
        return None
    if job.alone != "answered":
        return f"refused alone ({job.alone}), answered beside others"
    assert job.expected is not None
    try:
        _compare(job.case, job.built, result, job.expected)
    except AssertionError as error:
        return f"beside others: {error}"
    return None
