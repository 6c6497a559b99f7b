"""The catch-up at start (cache_refresh/scheduler.py) on the nights the clocks change (Europe/Berlin, 2027).

Clocks go back on 2027-10-31 at 03:00 CEST -> 02:00 CET (02:00-03:00 happens twice); they go forward on
2027-03-28 at 02:00 CET -> 03:00 CEST (02:00-03:00 does not exist).
"""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from apscheduler.triggers.cron import CronTrigger

from cache_refresh.scheduler import fire_times_between, make_trigger, missed_run

BERLIN = ZoneInfo("Europe/Berlin")
UTC = dt.timezone.utc


class Bounded:
    """A trigger that fails after ``limit`` calls instead of looping for ever (the bug: the same time again)."""

    def __init__(self, trigger: CronTrigger, limit: int = 500) -> None:
        self.trigger, self.timezone, self.limit, self.calls = trigger, trigger.timezone, limit, 0

    def get_next_fire_time(self, previous: dt.datetime | None, now: dt.datetime) -> dt.datetime | None:
        self.calls += 1
        if self.calls > self.limit:
            raise AssertionError(f"get_next_fire_time called {self.limit} times: the walk does not advance")
        return self.trigger.get_next_fire_time(previous, now)


def bounded(trigger: CronTrigger) -> Any:
    return Bounded(trigger)


def utc(*args: int) -> dt.datetime:
    return dt.datetime(*args, tzinfo=UTC)


@pytest.mark.parametrize("schedule", ["30 2 * * *", "0 2 * * *", "*/15 * * * *"])
def test_fall_back_night_walk_advances_and_lists_each_instant_once(schedule: str) -> None:
    trig = bounded(make_trigger(schedule, "Europe/Berlin"))
    times = fire_times_between(trig, utc(2027, 10, 30, 23, 0), utc(2027, 11, 1, 3, 0))
    instants = [t.astimezone(UTC) for t in times]
    assert instants == sorted(set(instants)) and instants
    if schedule == "30 2 * * *":  # 02:30 CEST (not 02:30 CET again: crontab's once), then the next night's
        assert instants == [utc(2027, 10, 31, 0, 30), utc(2027, 11, 1, 1, 30)]
    if schedule == "*/15 * * * *":  # 25 hours that day: 4 per hour, none lost or repeated
        assert len(instants) == 4 * 28 + 1


@pytest.mark.parametrize("start", [dt.datetime(2027, 10, 31, 3, 10, tzinfo=BERLIN),
                                   dt.datetime(2027, 10, 31, 2, 40, fold=1, tzinfo=BERLIN),
                                   dt.datetime(2027, 10, 31, 2, 40, tzinfo=BERLIN)])
def test_scheduler_starts_in_or_after_the_repeated_hour(start: dt.datetime) -> None:
    trig = bounded(make_trigger("30 2 * * *", "Europe/Berlin"))
    due = missed_run(trig, start, None, 7200)
    # two hours of grace, as elapsed time: the night's one 02:30 (CEST; the second 02:30 is no fire time, as in crontab)
    expected = utc(2027, 10, 31, 0, 30)
    assert due is not None and due.astimezone(UTC) == expected
    # that run succeeded: nothing to catch up
    assert missed_run(trig, start, expected, 7200) is None


def test_build_scheduler_returns_in_the_repeated_hour() -> None:
    # in a child process: before the fix this never returned (and grew without bound), so bound it by a timeout
    code = ("import datetime as dt; from zoneinfo import ZoneInfo; from cache_refresh.scheduler import build_scheduler;"
            "now = dt.datetime(2027, 10, 31, 3, 10, tzinfo=ZoneInfo('Europe/Berlin'));"
            "s = build_scheduler(lambda: None, '30 2 * * *', 'Europe/Berlin', 7200, None, now=now);"
            "print(sorted(j.id for j in s.get_jobs()))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("build_scheduler did not return within 30 s in the repeated hour")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['refresh', 'refresh-missed']"


def test_spring_forward_gap_terminates_and_advances() -> None:
    for schedule in ("30 2 * * *", "*/15 * * * *", "0 3 * * *"):
        trig = bounded(make_trigger(schedule, "Europe/Berlin"))
        times = fire_times_between(trig, utc(2027, 3, 27, 23, 0), utc(2027, 3, 29, 3, 0))
        instants = [t.astimezone(UTC) for t in times]
        assert instants == sorted(set(instants)) and instants
    # started at 03:10 CEST (01:10 UTC) with an hour of grace: due is the first fire time of the morning, if any,
    # and never one from before the grace window
    trig = bounded(make_trigger("0 3 * * *", "Europe/Berlin"))
    due = missed_run(trig, dt.datetime(2027, 3, 28, 3, 10, tzinfo=BERLIN), None, 3600)
    assert due is not None and due.astimezone(UTC) == utc(2027, 3, 28, 1, 0)


@pytest.mark.parametrize("schedule", ["0 3 30 2 *", "0 3 31 4 *", "0 3 31 11 *"])
def test_a_schedule_that_never_fires_is_refused_not_idled_on(schedule: str) -> None:
    from cache_refresh.scheduler import check_schedule
    from stream.errors import ConfigError

    with pytest.raises(ConfigError, match="never fires"):
        check_schedule(schedule, "Europe/Berlin")
    check_schedule("0 3 29 2 *", "Europe/Berlin")  # leap days come
