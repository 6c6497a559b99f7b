"""The join engine's timers: ``(due time, impression_id)`` entries taken in ascending order, as sorted runs.

A heap of such tuples costs a ``heappush`` and a ``heappop`` in Python per impression. The engine adds its timers a
batch at a time, and a batch's impressions are close in event time, so :class:`TimerRuns` keeps each batch's timers
as one sorted list (a *run*, sorted in C) and takes everything due with a bisection and a slice per run. The order
is the heap's: ascending ``(time, impression_id)`` tuples (equal tuples are alike), whatever order the runs came in.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import chain, islice
from operator import itemgetter, le

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


class ForgetRuns:
    """Impression ids to forget once event time passes ``ts + after``, added a batch at a time as runs (the order
    impressions expire in is ascending ``ts`` but for a rare stale timer); taken in no particular order. No tuple per
    id, and no sort of a run already in order."""

    __slots__ = ("_after", "_runs")

    def __init__(self, after: int) -> None:
        self._after = after
        self._runs: list[tuple[list[int], list[str]]] = []  # (ts (N,) ascending, ids (N,)), non-empty

    def add(self, times: list[int], ids: list[str]) -> None:
        """Add ``ids`` with their event times ``times`` (the lists become a run: the caller hands them over)."""
        if not times:
            return
        if not all(map(le, times, islice(times, 1, None))):
            pairs = sorted(zip(times, ids, strict=True))
            times, ids = [t for t, _ in pairs], [i for _, i in pairs]
        self._runs.append((times, ids))

    def pop_through(self, t: int) -> list[str]:
        """Remove and return every id due by ``t`` (ts + after <= t)."""
        limit, out = t - self._after, []
        for times, ids in self._runs:
            if times[0] <= limit:
                k = bisect_right(times, limit)
                out += ids[:k]
                del times[:k], ids[:k]
        if out:
            self._runs = [run for run in self._runs if run[0]]
        return out
