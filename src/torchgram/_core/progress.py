"""Progress bars for long computations (``progress=True``): ``tqdm``, or nothing.

# NOTE [progress]
``progress=True`` shows a ``tqdm`` bar (on stderr) over the steps of a computation that has
more than one: the row chunks of a ``tg.gramian`` backend, the tiles of a kernel
(``torchgram.ntk``). A computation of one step shows nothing, and ``progress=False`` never
imports ``tqdm``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class Progress:
    """A ``tqdm`` bar of ``total`` steps when ``enabled`` and ``total > 1``, else a no-op.

    Example:
        >>> with Progress(False, 3, "tiles") as bar:
        ...     bar.update()
        >>> bar.count
        1
    """

    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self.count = 0
        self._bar: Any = None
        if enabled and total > 1:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True)

    def update(self, steps: int = 1) -> None:
        """Count ``steps`` finished steps."""
        self.count += steps
        if self._bar is not None:
            self._bar.update(steps)

    def close(self) -> None:
        """Close the bar (idempotent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_iter(enabled: bool, items: Iterable[T], total: int, desc: str) -> Iterator[T]:
    """``items``, advancing a :class:`Progress` bar after each one."""
    with Progress(enabled, total, desc) as bar:
        for item in items:
            yield item
            bar.update()
