"""stream.idle_clock.IdleClock, on a fake clock: idle time summed between ticks, a stall counted as one ordinary
round, a loop of slow rounds still reaching its limit."""

from __future__ import annotations

import pytest

from stream.idle_clock import IdleClock


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_idle_time_is_summed_between_ticks_and_input_starts_it_afresh() -> None:
    t = Clock()
    idle = IdleClock(stall_s=2.2, stall_step_s=0.2, now=t)
    for _ in range(5):
        t.t += 0.2
        idle.tick()
    assert idle.idle_s == pytest.approx(1.0)
    t.t += 0.1
    idle.reset()
    t.t += 0.2
    assert idle.tick() == pytest.approx(0.2) and idle.stalls == 0


def test_a_stall_between_two_ticks_counts_as_one_round_not_as_its_length() -> None:
    t = Clock()
    idle = IdleClock(stall_s=2.2, stall_step_s=0.2, now=t)
    t.t += 12.0  # stopped (SIGSTOP) for 12 s past a 10 s limit
    assert idle.tick() == pytest.approx(0.2) and idle.stalls == 1


def test_a_loop_whose_every_round_is_slow_still_reaches_its_limit() -> None:
    t = Clock()
    idle = IdleClock(stall_s=2.2, stall_step_s=0.2, now=t)
    rounds = 0
    while idle.idle_s < 10.0:
        t.t += 3.0  # a slow checkpoint every round: each gap is over the stall bound
        idle.tick()
        rounds += 1
    assert 50 <= rounds <= 51 and idle.stalls == rounds  # 10 s of 0.2 s rounds (float sums)


def test_a_clock_that_restarts_on_a_stall_counts_idleness_afresh_from_it() -> None:
    t = Clock()
    idle = IdleClock(stall_s=2.0, stall_step_s=None, now=t)
    for _ in range(36):  # 9 s idle
        t.t += 0.25
        idle.tick()
    t.t += 12.0
    assert idle.tick() == 0.0 and idle.stalls == 1
    t.t += 0.25
    assert idle.tick() == pytest.approx(0.25)


@pytest.mark.parametrize(("stall_s", "step_s"), [(1.0, 2.0), (1.0, -0.1)])
def test_a_step_over_the_stall_bound_or_below_zero_is_refused(stall_s: float, step_s: float) -> None:
    with pytest.raises(ValueError, match="stall_step_s"):
        IdleClock(stall_s=stall_s, stall_step_s=step_s)


def test_a_stall_that_restarts_idleness_owes_after_stall_s_before_any_idleness_counts() -> None:
    t = Clock()
    idle = IdleClock(stall_s=2.0, stall_step_s=None, now=t, after_stall_s=2.0)
    t.t += 0.5
    assert idle.tick() == pytest.approx(0.5)
    t.t += 12.0
    assert idle.tick() == pytest.approx(-2.0) and idle.stalls == 1  # owes two heartbeats before any limit
    t.t += 1.5
    assert idle.tick() == pytest.approx(-0.5)
    t.t += 1.0
    assert idle.tick() == pytest.approx(2.5)  # the wait is over: the idle time since the stall


def test_input_during_the_wait_after_a_stall_does_not_end_the_wait() -> None:
    """The wait was a negative idle time, which reset() set to 0: records fetched before the stall, handed on as it
    ended (before the heartbeat that says the partitions are gone), made a limit under a heartbeat pass at once."""
    t = Clock()
    idle = IdleClock(stall_s=2.0, stall_step_s=None, now=t, after_stall_s=2.0)
    t.t += 12.0
    assert idle.tick() == pytest.approx(-2.0)
    idle.reset()  # records in hand
    t.t += 0.5
    assert idle.tick() < 0  # still owed 1.5 s
    t.t += 1.6
    assert idle.tick() == pytest.approx(2.1)


@pytest.mark.parametrize("after_stall_s, stall_step_s", [(-1.0, None), (1.0, 0.2)])
def test_after_stall_s_is_refused_where_it_means_nothing(after_stall_s: float, stall_step_s: float | None) -> None:
    with pytest.raises(ValueError, match="after_stall_s"):
        IdleClock(stall_s=2.0, stall_step_s=stall_step_s, after_stall_s=after_stall_s)
