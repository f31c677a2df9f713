"""Progress bars for long computations (``progress=True``): ``tqdm``, or nothing.

# NOTE [progress]
``progress=True`` shows a ``tqdm`` bar (on stderr) over the steps of a computation that has
more than one: the row chunks of a ``tg.gramian`` backend (``chunk_size`` or
``memory_budget`` splitting the rows), the tile pairs of a kernel (``torchgram.ntk``). A
computation of one step shows nothing, and ``progress=False`` never imports ``tqdm``. A
backend that learns its number of steps group by group announces them with
:meth:`Progress.extend`; the bar appears once there is more than one.
"""

from __future__ import annotations

from typing import Any


class Progress:
    """A ``tqdm`` bar of ``total`` steps when ``enabled`` and there are several, else a no-op.

    Example:
        >>> with Progress(False, 3, "tiles") as bar:
        ...     bar.update()
        >>> bar.count, bar.total
        (1, 3)
    """

    def __init__(self, enabled: bool, total: int = 0, desc: str = "") -> None:
        self.enabled = enabled
        self.total = 0
        self.count = 0
        self.desc = desc
        self._bar: Any = None
        self.extend(total)

    def extend(self, steps: int) -> None:
        """Announce ``steps`` more steps (the bar appears once there are more than one)."""
        self.total += steps
        if not self.enabled or self.total <= 1:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=self.desc, unit="step", dynamic_ncols=True,
                             initial=self.count)
        else:
            self._bar.total = self.total
            self._bar.refresh()

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
