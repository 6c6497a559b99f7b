"""The learner's event-time clocks, steered by the bulk of the rows, never by one.

Event time drives what the learner ages and matures: ids' ages and user-bucket decay (``learner/row_mapper.py``),
cold-start sightings, the calibration's maturity (``learner/calibration.py``) and the delayed-feedback bias
(``learner/delayed.py``). Taken as the newest row's time, one row from a client with a wrong clock moved all of it:
in a replay of year-2000 events run today, a single row stamped now (inside every ``future_ts_s`` bound) aged every
id by 26 years and zeroed every user bucket it touched. :class:`EventClock` reads the ``quorum``-th largest time
seen instead (the joiner's watermark rule, ``[joiner] watermark_quorum``; Flink's idle-robust watermarks work the same
way): fewer than ``quorum`` rows can never move it, and a learner batch of thousands of rows reaches the quorum at
once, where the clock lags the newest row by ``quorum - 1`` rows. Until ``quorum`` rows are seen it is the newest
row's time, as before. It never leads this machine's wall clock, and never goes back once the quorum is reached.
:class:`FirstTime` is the mirror for the stream's start (the ``quorum``-th smallest time), which the calibration's
warm-up and the bias rule's span of delays are measured from.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

QUORUM = 16  # as the joiner's default watermark_quorum: rows that must agree before event time moves
_MAX_MS = int(np.iinfo(np.int64).max)  # a time's bound either way: the clocks keep int64, FirstTime negated


class _QuorumTime:
    """The ``quorum``-th largest (``sign`` 1) or smallest (``sign`` -1) of the times seen, the extreme one until
    ``quorum`` are seen. State: those ``quorum`` times (``state``)."""

    sign = 1

    def __init__(self, quorum: int = QUORUM) -> None:
        if quorum < 1:
            raise ValueError(f"quorum must be >= 1, got {quorum}")
        self.quorum = quorum
        self._kept = np.empty(0, np.int64)  # (<= quorum,) sign * the times kept, the largest of them, any order

    def _take(self, times_ms: np.ndarray | Sequence[int]) -> None:
        t = self.sign * np.asarray(times_ms, np.int64).ravel()
        if len(t):
            self._kept = largest(np.concatenate([self._kept, largest(t, self.quorum)]), self.quorum)

    def _kth(self) -> int | None:
        if not len(self._kept):
            return None
        return self.sign * int(self._kept.min() if len(self._kept) >= self.quorum else self._kept.max())

    def state(self) -> list[int]:
        return sorted(self.sign * int(x) for x in self._kept)

    def _load(self, state: Any, one: Any) -> None:
        """From :meth:`state`; a record from before the quorum held one time, ``one``: it counts as one row. A time
        that is no integer (a bool, a fraction, a text) is a ValueError naming it: ``int()`` read ``true`` as 1 ms
        and ``"17e11"`` raised a message naming no field, from a damaged or edited checkpoint."""
        times = list(state) if isinstance(state, list | tuple) else [] if one is None else [one]
        self._kept = largest(self.sign * integer_times("event clock state", times), self.quorum)


class EventClock(_QuorumTime):
    """Event time in ms after the rows seen (:meth:`advance`): the ``quorum``-th largest of their times (the largest
    until ``quorum`` are seen), never ahead of the wall clock. State: the ``quorum`` largest times (``state``)."""

    def advance(self, times_ms: np.ndarray | Sequence[int]) -> int | None:
        """Take a batch's times (B,) into account; returns :attr:`now_ms`."""
        self._take(times_ms)
        return self.now_ms

    def advance_s(self, times_ms: np.ndarray | Sequence[int]) -> float:
        """:meth:`advance` over a batch of at least one row; the clock in seconds."""
        now = self.advance(times_ms)
        if now is None:
            raise ValueError("advance_s needs at least one row")
        return now / 1000.0

    @property
    def now_ms(self) -> int | None:
        """None before any row."""
        kth = self._kth()
        return None if kth is None else min(kth, int(time.time() * 1000))

    @property
    def now_s(self) -> float | None:
        now = self.now_ms
        return None if now is None else now / 1000.0

    def load(self, state: Any, now_ms: int | None = None) -> None:
        """From :meth:`state`; a record from before this clock held only its ``now_ms``: it counts as one row. A state
        that is neither a list of times nor None (absent) is a ValueError naming it: it was ignored, and the clock
        started fresh (one row stamped a day ahead then moved it by a day)."""
        if state is not None and not isinstance(state, list | tuple):
            raise ValueError(f"event clock state: {state!r:.80} is not a list of times in integer ms: the state is "
                             "damaged; the restore uses the previous checkpoint")
        self._load(state, now_ms)


class FirstTime(_QuorumTime):
    """The stream's start in ms after the rows seen (:meth:`advance`): the ``quorum``-th smallest of their times (the
    smallest until ``quorum`` are seen), the mirror of :class:`EventClock`. Taken as the smallest, one row stamped
    1970 (or a year early) made a model's warm-up look long over: the calibration fitted the stream's first, worst
    predictions and the base-rate bias declared its span of delays covered at once. State: the ``quorum`` smallest
    times (``state``)."""

    sign = -1

    def advance(self, times_ms: np.ndarray | Sequence[int]) -> int | None:
        """Take a batch's times (B,) into account; returns :attr:`first_ms`."""
        self._take(times_ms)
        return self.first_ms

    @property
    def first_ms(self) -> int | None:
        """None before any row."""
        return self._kth()

    def load(self, state: Any) -> None:
        """From :meth:`state`; a record from before this held one ``first_ms`` (an int), the start of a stream the code
        of then had seen: it counts as the whole quorum. Counted as one row, the first batch after the upgrade moved the
        start to the restart, and a stream hours old was taken for a fresh one (the calibration skipped a warm-up of its
        observed impressions again, the bias rule measured its span of delays from the restart)."""
        old = isinstance(state, int | np.integer) and not isinstance(state, bool)
        self._load([state] * self.quorum if old else state, None if isinstance(state, list | tuple) else state)


def integer_times(what: str, times: Iterable[Any]) -> np.ndarray:
    """``times`` as int64 ``(n,)``, else a ValueError naming ``what`` and the first that is no time in integer ms (a
    bool, a fraction, NaN, a text, beyond int64): read through ``astype(int64)`` or ``int()``, ``true`` was 1 ms, a
    NaN INT64_MIN (its pair matured at once) and 2**70 an OverflowError that no restore took for damage."""
    times = list(times)
    if (bad := [x for x in times if isinstance(x, bool) or not isinstance(x, int | np.integer)
                or not -_MAX_MS <= x <= _MAX_MS]):
        raise ValueError(f"{what}: {bad[0]!r:.80} is not a time in integer ms: the state is damaged; the restore "
                         "uses the previous checkpoint")
    return np.asarray(times, np.int64)


def load_times(state: str, clock: EventClock, first: FirstTime, d: Mapping[str, Any]) -> None:
    """A state's ``clock`` (``now_ms`` before it) into ``clock`` and its ``first_ms`` into ``first`` (the calibration's
    and the bias rule's layout); a time that is no integer is a ValueError naming ``state`` and the value."""
    try:
        clock.load(d.get("clock"), d.get("now_ms"))
        first.load(d.get("first_ms"))
    except ValueError as exc:
        raise ValueError(f"{state}: {exc}") from None


def largest(t: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` largest of ``t`` (any order; all of them when there are at most ``k``): what a clock needs of a batch
    (a sharded learner's ranks exchange only these)."""
    return t if len(t) <= k else np.partition(t, len(t) - k)[len(t) - k:]
