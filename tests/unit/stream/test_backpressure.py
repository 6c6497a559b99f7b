"""InputGate: which partitions' inputs to pause so that neither runs far ahead of the other."""

from __future__ import annotations

from stream.joiner.backpressure import CLICKS, HOLD_ALL, IMPRESSIONS, InputGate, hold_limits

S = 1000  # ms
DAY = 86_400 * S


def behind(*keys: tuple[str, int]):
    return lambda kind, p: (kind, p) in keys


def everything_behind(kind: str, p: int) -> bool:
    return True


def test_clicks_near_the_cap_whose_impressions_lag_are_paused() -> None:
    gate = InputGate(cap=100, max_drift_ms=None)
    pause, resume = gate.update({0: 80, 1: 79}, {}, everything_behind)
    assert (pause, resume) == ({(CLICKS, 0)}, set())
    assert gate.held(CLICKS) == {0} and gate.pauses == {CLICKS: 1, IMPRESSIONS: 0}


def test_an_input_ahead_in_event_time_by_more_than_the_drift_is_paused_while_the_other_has_more() -> None:
    gate = InputGate(cap=100, max_drift_ms=60 * S)
    times = {0: (100 * S, 161 * S), 1: (300 * S, 200 * S), 2: (100 * S, 150 * S)}  # clicks ahead; impressions; within
    pause, _ = gate.update({0: 0, 1: 0, 2: 0}, times, everything_behind)
    assert pause == {(CLICKS, 0), (IMPRESSIONS, 1)}


def test_nothing_is_paused_when_the_other_input_is_read_to_the_end() -> None:
    # nothing more is coming to catch up with: pausing would only stall (the cap's overflow is the answer)
    gate = InputGate(cap=100, max_drift_ms=60 * S)
    assert gate.update({0: 95}, {0: (0, 600 * S)}, behind()) == (set(), set())
    assert gate.update({0: 0}, {0: (600 * S, 0)}, behind((IMPRESSIONS, 0))) == (set(), set())  # clicks at their end


def test_a_paused_input_resumes_under_half_the_drift_and_clicks_at_the_low_mark() -> None:
    gate = InputGate(cap=100, max_drift_ms=60 * S)
    gate.update({0: 90}, {0: (0, 100 * S)}, everything_behind)
    assert gate.update({0: 90}, {0: (80 * S, 100 * S)}, everything_behind) == (set(), set())  # waiting still high
    assert gate.update({0: 51}, {0: (80 * S, 100 * S)}, everything_behind) == (set(), set())  # hysteresis: 51 > 50
    assert gate.update({0: 50}, {0: (60 * S, 100 * S)}, everything_behind) == (set(), set())  # lead 40 s > 30 s
    assert gate.update({0: 50}, {0: (70 * S, 100 * S)}, everything_behind) == (set(), {(CLICKS, 0)})
    assert gate.paused == set()


def test_a_paused_input_resumes_once_the_other_is_caught_up() -> None:
    gate = InputGate(cap=100, max_drift_ms=60 * S)
    gate.update({0: 0}, {0: (500 * S, 0)}, everything_behind)
    assert gate.held(IMPRESSIONS) == {0}
    assert gate.update({0: 0}, {0: (500 * S, 0)}, behind()) == (set(), {(IMPRESSIONS, 0)})


def test_both_inputs_of_a_partition_are_never_paused_at_once() -> None:
    gate = InputGate(cap=100, max_drift_ms=60 * S)
    gate.update({0: 0}, {0: (500 * S, 0)}, everything_behind)  # impressions paused
    pause, _ = gate.update({0: 99}, {0: (500 * S, 0)}, everything_behind)  # clicks near the cap too
    assert pause == set() and gate.paused == {(IMPRESSIONS, 0)}


def test_a_partition_no_longer_held_is_resumed_and_release_forgets_pauses() -> None:
    gate = InputGate(cap=100, max_drift_ms=None)
    gate.update({0: 90, 1: 90, 2: 90}, {}, everything_behind)
    assert gate.update({1: 90, 2: 90}, {}, everything_behind) == (set(), {(CLICKS, 0)})
    assert gate.release({1, 7}) == {(CLICKS, 1)}
    assert gate.release() == {(CLICKS, 2)} and gate.paused == set()


def test_an_input_not_read_yet_with_more_to_read_holds_the_other_back_until_it_is_read() -> None:
    # it may be the oldest: impressions read for months before the first click put out a burst of late positives
    gate = InputGate(cap=100, max_drift_ms=60 * S)
    assert gate.update({0: 0}, {0: (600 * S, None)}, everything_behind) == ({(IMPRESSIONS, 0)}, set())
    assert gate.update({0: 0}, {0: (600 * S, 590 * S)}, everything_behind) == (set(), {(IMPRESSIONS, 0)})


def test_an_input_not_read_yet_with_nothing_to_read_holds_nobody_back() -> None:
    gate = InputGate(cap=100, max_drift_ms=60 * S)
    assert gate.update({0: 0}, {0: (600 * S, None)}, behind((IMPRESSIONS, 0))) == (set(), set())


def test_disabled_never_pauses() -> None:
    gate = InputGate(cap=100, enabled=False)
    assert gate.update({0: 100}, {0: (0, 600 * S)}, everything_behind) == (set(), set())


def test_the_high_mark_leaves_room_for_one_more_batch() -> None:
    # the engine gives clicks up past the cap after a batch: one batch of clicks on top of the high mark must fit
    assert InputGate(cap=100, headroom=20).high == 80
    assert InputGate(cap=100, headroom=40).high == 60
    assert InputGate(cap=1).high == 1


# -- hold_limits: inside one batch ----------------------------------------------------------------------------
def test_a_partition_is_joined_up_to_the_oldest_time_its_inputs_with_more_to_read_reached_plus_the_drift() -> None:
    reached = {(IMPRESSIONS, 0): 90 * DAY, (CLICKS, 0): 1 * DAY}  # a fetch brought impressions months ahead
    limits = hold_limits(reached, lambda kind, p: True, drift_ms=60_000)
    assert limits == {(IMPRESSIONS, 0): 1 * DAY + 60_000, (CLICKS, 0): 1 * DAY + 60_000}


def test_an_input_with_nothing_more_to_read_bounds_nobody() -> None:
    reached = {(IMPRESSIONS, 0): 90 * DAY, (CLICKS, 0): 1 * DAY, (IMPRESSIONS, 1): 5 * DAY, (CLICKS, 1): DAY}
    limits = hold_limits(reached, lambda kind, p: kind == IMPRESSIONS, drift_ms=0)
    assert limits == {(IMPRESSIONS, 0): 90 * DAY, (CLICKS, 0): 90 * DAY, (IMPRESSIONS, 1): 5 * DAY,
                      (CLICKS, 1): 5 * DAY}  # clicks are read to the end: the impressions bound both
    assert hold_limits(reached, lambda kind, p: False, drift_ms=0) == {}


def test_an_input_with_more_to_read_whose_time_is_unknown_is_read_and_holds_the_other_entirely() -> None:
    limits = hold_limits({(IMPRESSIONS, 3): DAY, (CLICKS, 3): None}, lambda kind, p: True, drift_ms=60_000)
    assert limits == {(IMPRESSIONS, 3): HOLD_ALL}
    assert hold_limits({(IMPRESSIONS, 3): None, (CLICKS, 3): None}, lambda kind, p: True, drift_ms=0) == {}
