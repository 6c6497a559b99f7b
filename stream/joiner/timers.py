"""The join engine's timers: ``(due time, impression_id)`` entries taken in ascending order, as sorted runs.

A heap of such tuples costs a ``heappush`` and a ``heappop`` in Python per impression. The engine adds its timers a
batch at a time, and a batch's impressions are close in event time, so :class:`TimerRuns` keeps each batch's timers
as one sorted list (a *run*, sorted in C) and takes everything due with a bisection and a slice per run. The order
is the heap's: ascending ``(time, impression_id)`` tuples (equal tuples are alike), whatever order the runs came in.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import chain
from operator import itemgetter

Timer = tuple[int, str]  # (due event time, impression_id)
_TIME = itemgetter(0)


class TimerRuns:
    """A multiset of :data:`Timer` entries, taken smallest first (module docstring)."""

    __slots__ = ("_runs",)

    def __init__(self) -> None:
        self._runs: list[list[Timer]] = []  # each sorted ascending and non-empty

    def __bool__(self) -> bool:
        return bool(self._runs)

    def add(self, timers: list[Timer]) -> None:
        """Add ``timers`` (any order; the list becomes a run: the caller hands it over)."""
        if timers:
            timers.sort()
            self._runs.append(timers)

    def pop_through(self, t: int) -> list[Timer]:
        """Remove and return every entry due by ``t`` (time <= t), ascending."""
        parts = []
        for run in self._runs:
            if run[0][0] <= t:
                k = bisect_right(run, t, key=_TIME)
                parts.append(run[:k])
                del run[:k]
        if not parts:
            return []
        self._runs = [run for run in self._runs if run]
        return parts[0] if len(parts) == 1 else sorted(chain.from_iterable(parts))  # a merge of runs: timsort's case

    def peek(self) -> Timer | None:
        """The smallest entry (None: empty)."""
        return min(run[0] for run in self._runs) if self._runs else None

    def pop(self) -> Timer:
        """Remove and return the smallest entry (IndexError: empty)."""
        run = min(self._runs, key=itemgetter(0))  # the run whose head is smallest
        first = run.pop(0)
        if not run:
            self._runs.remove(run)
        return first
