"""``WarmStart``: the previous solution of a weighting's QPs, handed back by a training loop."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class _Key(NamedTuple):
    """What a stored solution is valid for: the weighting, its QP's shape, dtype and device."""

    name: str
    shape: tuple[int, ...]
    device: torch.device


class WarmStart:
    """The last solution of a weighting's quadratic programs, to start the next call from.

    Consecutive Gramians of a training loop are close, and so are the solutions of the
    quadratic programs behind :func:`upgrad`, :func:`dualproj` and :func:`mgda`: which
    constraints are active (the *active set*) rarely changes much from one step to the next.
    Pass the same ``WarmStart`` to every call (``state=``): each call starts from the solution
    the previous one stored, and stores its own. This only changes the time a call takes: the
    weights are the solution of the call's own problem, certified to the same tolerance as from
    a cold start (for :func:`mgda` on a rank-deficient Gramian, whose minimising weights are not
    unique, the same update ``Jᵀw`` with possibly other weights). A state whose stored solution
    does not fit the call (another weighting, or another number of losses, e.g. a smaller last
    batch) is ignored and overwritten.

    Warm starts pay off when the rows of consecutive Gramians are the same losses, slowly
    changing: the tasks of multi-task learning, or a fixed (full) batch. With a fresh
    mini-batch at every step (instance-wise risk minimisation), row ``i`` is another sample each
    time and the previous solution is no better a start than none (see the benchmark's
    warm-start section).

    Attributes:
        calls: Number of calls that used this state.
        warm_calls: How many of them started from a stored solution.
        solver: The method the last call used: ``"direct"`` (batched Cholesky factorisations,
            small ``m``) or ``"cg"`` (batched conjugate gradients, large ``m``).
        iterations: The last call's iterations (active-set rounds for ``"direct"``, CG
            iterations for ``"cg"``).

    Example:
        >>> import torch
        >>> import torchgram.weighting as weighting
        >>> state = weighting.WarmStart()
        >>> J = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
        >>> for step in range(3):  # a training loop: J, hence G, changes a little every step
        ...     w = weighting.upgrad((J + 0.01 * step) @ (J + 0.01 * step).T, state=state)
        >>> state.calls, state.warm_calls
        (3, 2)
        >>> torch.allclose(w, weighting.upgrad((J + 0.02) @ (J + 0.02).T))  # Same answer.
        True
    """

    calls: int
    warm_calls: int
    solver: str | None
    iterations: int

    def __init__(self) -> None:
        self._key: _Key | None = None
        self._solution: Tensor | None = None
        self.reset()

    def reset(self) -> None:
        """Forgets the stored solution (the next call starts cold) and zeroes the counters."""
        self._key, self._solution = None, None
        self.calls, self.warm_calls, self.solver, self.iterations = 0, 0, None, 0

    def __repr__(self) -> str:
        stored = "empty" if self._key is None else f"{self._key.name} {list(self._key.shape)}"
        return (f"WarmStart({stored}, calls={self.calls}, warm_calls={self.warm_calls}, "
                f"solver={self.solver!r}, iterations={self.iterations})")

    def load(self, name: str, like: Tensor) -> Tensor | None:
        """The stored solution if it fits a call of ``name`` whose solution is shaped as ``like``.

        Counts the call. The result is a float64 tensor shaped as ``like``, on its device.
        """
        self.calls += 1
        key = _Key(name, tuple(like.shape), like.device)
        if self._key != key or self._solution is None:
            return None
        self.warm_calls += 1
        return self._solution

    def store(self, name: str, solution: Tensor, solver: str, iterations: int) -> None:
        """Keeps ``solution`` (detached) for the next call of ``name``."""
        self._key = _Key(name, tuple(solution.shape), solution.device)
        self._solution = solution.detach()
        self.solver, self.iterations = solver, iterations


def check_state(state: object, name: str) -> WarmStart | None:
    """Raises a TypeError naming the weighting ``name`` unless ``state`` is a WarmStart or None."""
    if state is None or isinstance(state, WarmStart):
        return state
    raise TypeError(
        f"torchgram.weighting.{name}: expected state to be a torchgram.weighting.WarmStart or "
        f"None, got {type(state).__name__}. Create one with torchgram.weighting.WarmStart() "
        "before the training loop and pass the same object to every call."
    )
