"""A fixed-time schedule fires once on the night the clocks go back, as crontab runs it (cache_refresh/scheduler.py).

Europe/Berlin, 2027-10-31: 03:00 CEST -> 02:00 CET, so 02:00-03:00 local happens twice. crontab (cronie, Vixie cron)
runs a job whose minute and hour are fixed once then, and a job whose minute or hour is a wildcard (``*``, ``*/15``)
at every instant; APScheduler's CronTrigger fired a fixed ``30 2 * * *`` at both 02:30s: two nightly refreshes.
"""

from __future__ import annotations

import datetime as dt

import pytest

from cache_refresh.scheduler import build_scheduler, fire_times_between, make_trigger, missed_run

UTC = dt.timezone.utc


def utc(*args: int) -> dt.datetime:
    return dt.datetime(*args, tzinfo=UTC)


@pytest.mark.parametrize(("schedule", "expected"), [
    ("30 2 * * *", [utc(2027, 10, 31, 0, 30), utc(2027, 11, 1, 1, 30)]),  # the first 02:30 (CEST) only
    ("0 2 * * *", [utc(2027, 10, 31, 0, 0), utc(2027, 11, 1, 1, 0)]),
    ("0,30 2 * * 0", [utc(2027, 10, 31, 0, 0), utc(2027, 10, 31, 0, 30)]),  # a Sunday: still each wall time once
    ("0 3 * * *", [utc(2027, 10, 31, 2, 0), utc(2027, 11, 1, 2, 0)]),  # not in the repeated hour: unchanged
])
def test_fixed_time_schedule_fires_once_in_the_repeated_hour(schedule: str, expected: list[dt.datetime]) -> None:
    trig = make_trigger(schedule, "Europe/Berlin")
    times = fire_times_between(trig, utc(2027, 10, 30, 23, 0), utc(2027, 11, 1, 3, 0))
    assert [t.astimezone(UTC) for t in times] == expected


@pytest.mark.parametrize("schedule", ["*/30 2 * * *", "30 * * * *"])
def test_wildcard_schedule_fires_at_each_instant_of_the_repeated_hour(schedule: str) -> None:
    trig = make_trigger(schedule, "Europe/Berlin")
    times = [t.astimezone(UTC) for t in fire_times_between(trig, utc(2027, 10, 31, 0, 0), utc(2027, 10, 31, 1, 59))]
    assert utc(2027, 10, 31, 0, 30) in times and utc(2027, 10, 31, 1, 30) in times


def test_scheduler_loop_skips_the_second_instant() -> None:
    """What APScheduler itself asks: the next fire time after the first 02:30 is the next night's."""
    trig = make_trigger("30 2 * * *", "Europe/Berlin")
    first = trig.get_next_fire_time(None, utc(2027, 10, 30, 23, 0).astimezone(trig.timezone))
    assert first is not None and first.astimezone(UTC) == utc(2027, 10, 31, 0, 30)
    after = trig.get_next_fire_time(first, first)
    assert after is not None and after.astimezone(UTC) == utc(2027, 11, 1, 1, 30)


def test_start_in_the_repeated_hour_after_the_nights_run_catches_nothing_up() -> None:
    # the 02:30 CEST run succeeded; the process restarts at 02:40 CET (the second 02:40): no second run
    trig = make_trigger("30 2 * * *", "Europe/Berlin")
    assert missed_run(trig, utc(2027, 10, 31, 1, 40), utc(2027, 10, 31, 0, 31), 7200) is None
    sched = build_scheduler(lambda: None, "30 2 * * *", "Europe/Berlin", 7200, utc(2027, 10, 31, 0, 31),
                            now=utc(2027, 10, 31, 1, 40))
    assert [j.id for j in sched.get_jobs()] == ["refresh"]
