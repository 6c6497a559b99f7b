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
from collections.abc import Sequence
from typing import Any

import numpy as np

QUORUM = 16  # as the joiner's default watermark_quorum: rows that must agree before event time moves


class EventClock:
    """Event time in ms after the rows seen (:meth:`advance`): the ``quorum``-th largest of their times (the largest
    until ``quorum`` are seen), never ahead of the wall clock. State: the ``quorum`` largest times (``state``)."""

    def __init__(self, quorum: int = QUORUM) -> None:
        if quorum < 1:
            raise ValueError(f"quorum must be >= 1, got {quorum}")
        self.quorum = quorum
        self._top = np.empty(0, np.int64)  # (<= quorum,) the largest times seen, any order

    def advance(self, times_ms: np.ndarray | Sequence[int]) -> int | None:
        """Take a batch's times (B,) into account; returns :attr:`now_ms`."""
        t = np.asarray(times_ms, np.int64).ravel()
        if len(t):
            self._top = largest(np.concatenate([self._top, largest(t, self.quorum)]), self.quorum)
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
        if not len(self._top):
            return None
        kth = int(self._top.min() if len(self._top) >= self.quorum else self._top.max())
        return min(kth, int(time.time() * 1000))

    @property
    def now_s(self) -> float | None:
        now = self.now_ms
        return None if now is None else now / 1000.0

    def state(self) -> list[int]:
        return sorted(int(x) for x in self._top)

    def load(self, state: Any, now_ms: int | None = None) -> None:
        """From :meth:`state`; a record from before this clock held only its ``now_ms``: it counts as one row."""
        if isinstance(state, list | tuple):
            self._top = largest(np.asarray([int(x) for x in state], np.int64), self.quorum)
        else:
            self._top = np.asarray([] if now_ms is None else [int(now_ms)], np.int64)


class FirstTime:
    """The stream's start in ms after the rows seen (:meth:`advance`): the ``quorum``-th smallest of their times (the
    smallest until ``quorum`` are seen), the mirror of :class:`EventClock`. Taken as the smallest, one row stamped
    1970 (or a year early) made a model's warm-up look long over: the calibration fitted the stream's first, worst
    predictions and the base-rate bias declared its span of delays covered at once. State: the ``quorum`` smallest
    times (``state``)."""

    def __init__(self, quorum: int = QUORUM) -> None:
        if quorum < 1:
            raise ValueError(f"quorum must be >= 1, got {quorum}")
        self.quorum = quorum
        self._low = np.empty(0, np.int64)  # (<= quorum,) the smallest times seen, any order

    def advance(self, times_ms: np.ndarray | Sequence[int]) -> int | None:
        """Take a batch's times (B,) into account; returns :attr:`first_ms`."""
        t = np.asarray(times_ms, np.int64).ravel()
        if len(t):
            self._low = -largest(-np.concatenate([self._low, -largest(-t, self.quorum)]), self.quorum)
        return self.first_ms

    @property
    def first_ms(self) -> int | None:
        """None before any row."""
        if not len(self._low):
            return None
        return int(self._low.max() if len(self._low) >= self.quorum else self._low.min())

    def state(self) -> list[int]:
        return sorted(int(x) for x in self._low)

    def load(self, state: Any) -> None:
        """From :meth:`state`; a record from before this held one ``first_ms`` (an int): it counts as one row."""
        if isinstance(state, list | tuple):
            self._low = -largest(-np.asarray([int(x) for x in state], np.int64), self.quorum)
        else:
            self._low = np.asarray([] if state is None else [int(state)], np.int64)


def largest(t: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` largest of ``t`` (any order; all of them when there are at most ``k``): what a clock needs of a batch
    (a sharded learner's ranks exchange only these)."""
    return t if len(t) <= k else np.partition(t, len(t) - k)[len(t) - k:]
