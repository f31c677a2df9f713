"""Where a Jacobian-descent step's time goes: the Gramian, the weighting, ``Jᵀw``."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepTimes:
    """Seconds spent in each part of one step (wall clock, device work included).

    Attributes:
        gramian: Computing ``G`` (the forward and backward passes and the contractions).
        weighting: The weighting ``G -> w``.
        pullback: ``Jᵀ w`` (from what the backend kept, or one more forward and backward).

    Example:
        >>> print(StepTimes(gramian=0.003, weighting=0.001, pullback=0.0005))
        Gramian 3.00 ms (67%), weighting 1.00 ms (22%), Jᵀw 0.50 ms (11%): 4.50 ms in all
    """

    gramian: float
    weighting: float
    pullback: float

    @property
    def total(self) -> float:
        """The whole step."""
        return self.gramian + self.weighting + self.pullback

    def __str__(self) -> str:
        total = self.total or 1.0
        parts = [(name, seconds) for name, seconds in (
            ("Gramian", self.gramian), ("weighting", self.weighting), ("Jᵀw", self.pullback))]
        shown = ", ".join(f"{name} {1e3 * seconds:.2f} ms ({100 * seconds / total:.0f}%)"
                          for name, seconds in parts)
        return f"{shown}: {1e3 * self.total:.2f} ms in all"


class Stopwatch:
    """Laps of wall-clock time, waiting for ``device``'s queued work at each lap.

    Example:
        >>> watch = Stopwatch(torch.device("cpu"))
        >>> watch.lap() >= 0.0
        True
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._last = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the previous lap (or the start)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        return seconds
