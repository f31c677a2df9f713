"""Which leaves still need each tap's cotangent and each activation (NOTE [streamed taps]).

A leaf can be contracted once the cotangents of all its uses' taps are in; a cotangent or an
activation can be let go once every leaf that reads it has been contracted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from torchgram.backends.structured.trace import UseRecord


class Lifetimes:
    """Readiness of leaves and last readers of taps and activations.

    Args:
        uses: The tapped uses of each leaf.
        leaves: The leaves the contraction handles (others are ignored).

    Example:
        >>> from types import SimpleNamespace as Use
        >>> uses = {0: (Use(tap=0, act=0),), 1: (Use(tap=0, act=None), Use(tap=1, act=1))}
        >>> lifetimes = Lifetimes(uses, [0, 1])
        >>> lifetimes.arrived(0), lifetimes.arrived(1)
        ([0], [1])
        >>> lifetimes.done(0), lifetimes.done(1)
        (([], [0]), ([0, 1], [1]))
    """

    def __init__(self, uses: Mapping[int, Sequence[UseRecord]], leaves: Iterable[int]) -> None:
        self._missing: dict[int, set[int]] = {}
        self._taps: dict[int, set[int]] = {}
        self._acts: dict[int, set[int]] = {}
        self._readers_of_tap: dict[int, list[int]] = {}
        self._tap_readers: dict[int, int] = {}
        self._act_readers: dict[int, int] = {}
        for leaf in leaves:
            taps = {use.tap for use in uses.get(leaf, ())}
            acts = {use.act for use in uses.get(leaf, ()) if use.act is not None}
            self._missing[leaf] = set(taps)
            self._taps[leaf], self._acts[leaf] = taps, acts
            for tap in taps:
                self._readers_of_tap.setdefault(tap, []).append(leaf)
                self._tap_readers[tap] = self._tap_readers.get(tap, 0) + 1
            for act in acts:
                self._act_readers[act] = self._act_readers.get(act, 0) + 1

    def arrived(self, tap: int) -> list[int]:
        """Tap ``tap``'s cotangent is in: the leaves that now have all of theirs."""
        ready = []
        for leaf in self._readers_of_tap.get(tap, ()):
            missing = self._missing[leaf]
            if tap in missing:
                missing.discard(tap)
                if not missing:
                    ready.append(leaf)
        return ready

    def done(self, leaf: int) -> tuple[list[int], list[int]]:
        """Leaf ``leaf`` is contracted: the taps and activations nobody reads any more."""
        taps, acts = [], []
        for tap in sorted(self._taps.pop(leaf, ())):
            self._tap_readers[tap] -= 1
            if not self._tap_readers[tap]:
                taps.append(tap)
        for act in sorted(self._acts.pop(leaf, ())):
            self._act_readers[act] -= 1
            if not self._act_readers[act]:
                acts.append(act)
        return taps, acts
