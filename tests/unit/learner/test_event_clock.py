"""The learner's event clock (learner/event_clock.py): a quorum of rows moves it, one row never does, and it never
leads the wall clock or goes back once the quorum is reached."""

from __future__ import annotations

import time

import numpy as np
import pytest

from learner.calibration import OnlineCalibration
from learner.delayed import BaseRateBias
from learner.event_clock import QUORUM, EventClock, FirstTime
from stream.samples import FINAL, OBSERVED

YEAR_2000_MS = 956_703_932_000


def test_one_row_stamped_now_in_a_replay_of_old_events_does_not_move_the_clock() -> None:
    """A replay of year-2000 events with one row stamped today (inside every future_ts_s bound): the clock stays in
    2000, where the newest-row clock jumped 26 years and aged every id and user bucket by that."""
    clock = EventClock()
    rows = YEAR_2000_MS + np.arange(4096, dtype=np.int64) * 1000
    rows[1234] = int(time.time() * 1000)
    assert clock.advance(rows) == rows[np.argsort(rows)[-QUORUM]]  # the 16th largest: a 2000 time
    assert clock.now_ms < YEAR_2000_MS + 4096 * 1000
    now = [int(time.time() * 1000)]
    assert clock.advance(now * (QUORUM - 2)) < YEAR_2000_MS + 4096 * 1000  # 15 of them: still not
    assert clock.advance(now) >= rows[1234]  # the 16th row stamped now (the first was in the batch): a quorum


def test_a_quorum_of_rows_moves_it_and_it_never_goes_back_or_leads_the_wall_clock() -> None:
    clock = EventClock(quorum=4)
    assert clock.now_ms is None and clock.advance([]) is None
    assert clock.advance([5_000]) == 5_000  # before the quorum: the newest row
    assert clock.advance([1_000, 2_000, 3_000]) == 1_000  # the 4th largest of 1, 2, 3, 5 (s)
    assert clock.advance([10, 20]) == 1_000  # older rows never take it back
    assert clock.advance([4_000]) == 2_000
    assert clock.advance([9_000] * 4) == 9_000  # a quorum at 9 s moves it
    future = int((time.time() + 3600) * 1000)
    before = time.time()
    assert int(before * 1000) <= EventClock(quorum=1).advance([future]) <= time.time() * 1000  # not past the wall
    with pytest.raises(ValueError):
        EventClock(quorum=0)


def test_the_clock_state_round_trips_and_a_state_from_before_it_loads_as_its_one_time() -> None:
    clock = EventClock(quorum=3)
    clock.advance([1, 7, 3, 9, 5])
    again = EventClock(quorum=3)
    again.load(clock.state())
    assert again.state() == [5, 7, 9] and again.now_ms == clock.now_ms == 5
    old = EventClock(quorum=3)
    old.load(None, now_ms=42)
    assert old.now_ms == 42
    none = EventClock()
    none.load(None, None)
    assert none.now_ms is None


@pytest.mark.parametrize("state, one", [([5, True], None), ([5.5], None), (None, "42"), (None, False)])
def test_a_clock_state_time_that_is_no_integer_is_refused_naming_it(state: object, one: object) -> None:
    """A damaged or edited checkpoint's clock: ``int()`` read ``true`` as 1 ms and ``5.5`` as 5, and ``"abc"`` raised
    a message naming no field; each is a ValueError naming the clock state and the value."""
    with pytest.raises(ValueError, match=r"event clock state: .* is not a time in integer ms"):
        EventClock(quorum=3).load(state, one)


@pytest.mark.parametrize("state, one", [([2 ** 70], None), (None, -2 ** 64)])
def test_a_clock_state_time_beyond_int64_is_refused_naming_it_not_an_overflow_error(state: object, one: object) -> None:
    """An integer no int64 holds raised an OverflowError from numpy, which a sharded restore does not take for damage:
    raised bare on rank 0 (its calibration's, quality's and bias's clocks), naming neither the checkpoint nor the fix,
    while the other ranks waited in the refusals' all-gather for it. It is a ValueError naming the clock state."""
    with pytest.raises(ValueError, match=r"event clock state: .* is not a time in integer ms"):
        EventClock(quorum=3).load(state, one)
    with pytest.raises(ValueError, match=r"calibration state .*event clock state"):
        OnlineCalibration().load_state_dict({"clock": state, "now_ms": one})


@pytest.mark.parametrize("state", [42, "[1, 2]", {"now_ms": 42}, True])
def test_a_clock_state_that_is_no_list_is_refused_naming_it(state: object) -> None:
    """A damaged or edited checkpoint's clock of another type was ignored: the clock started fresh (one row stamped a
    day ahead then moved it by a day), where a list of another value is refused."""
    with pytest.raises(ValueError, match=r"event clock state: .* is not a list of times in integer ms"):
        EventClock(quorum=3).load(state, 7)


def test_one_far_ahead_row_does_not_mature_the_calibrations_pending_impressions() -> None:
    """The calibration's maturity clock (ts + label_delay_ms) took the newest row: one row an hour ahead matured every
    observed impression at once, fitted as a 0 before its click could come."""
    cal = OnlineCalibration(maturity_s=300.0)
    n = 64
    ts = YEAR_2000_MS + np.arange(n, dtype=np.int64) * 10_000  # 630 s: past the warm-up of one maturity
    ids = np.array([f"i{i}" for i in range(n)], object)
    kinds = np.full(n, OBSERVED, np.int8)
    delay = np.zeros(n, np.int64)
    delay[-1] = 26 * 365 * 86_400_000  # one row's emission time: today
    cal.observe(ids, kinds, np.zeros(n), np.zeros(n), ts, delay)
    assert cal.now_ms < YEAR_2000_MS + n * 10_000 and cal.rows == 0 and cal.pending > 0
    state = cal.state_dict()
    again = OnlineCalibration(maturity_s=300.0)
    again.load_state_dict(state)
    assert again.now_ms == cal.now_ms


def test_one_far_ahead_row_does_not_age_the_delayed_feedback_bins() -> None:
    bias = BaseRateBias()
    n = 64
    ts = YEAR_2000_MS + np.arange(n, dtype=np.int64) * 1000
    delay = np.zeros(n, np.int64)
    delay[0] = 26 * 365 * 86_400_000
    bias.observe(np.zeros(n), np.full(n, OBSERVED, np.int8), ts, delay)
    assert bias.now_ms < YEAR_2000_MS + n * 1000
    bias.observe(np.zeros(2), np.full(2, FINAL, np.int8))
    again = BaseRateBias()
    again.load_state_dict(bias.state_dict())
    assert again.now_ms == bias.now_ms


def test_the_first_time_is_the_quorum_th_smallest_and_one_early_row_cannot_move_it() -> None:
    first = FirstTime(quorum=4)
    assert first.first_ms is None
    assert first.advance([500, 400]) == 400  # fewer rows than the quorum: the smallest, as before
    assert first.advance([100, 300, 200, 900]) == 400  # 100, 200, 300, 400: the 4th smallest
    assert first.advance([-1_000_000 + 5]) == 300  # one row far earlier moves it one row back, not to that row
    again = FirstTime(quorum=4)
    again.load(first.state())
    assert again.first_ms == 300 and again.state() == first.state()
    again.load(12345)  # a record from before: its one time as one row
    assert again.first_ms == 12345 and again.advance([99999]) == 12345
