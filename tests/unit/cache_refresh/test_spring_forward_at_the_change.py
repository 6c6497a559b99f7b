"""A fixed-time schedule whose wall time the clocks skip fires once, at the change, as crontab runs it
(cache_refresh/scheduler.py ``CrontabTrigger``).

Europe/Berlin, 2026-03-29: 02:00 CET -> 03:00 CEST (01:00 UTC), so 02:00-03:00 local does not happen. cronie and
Vixie cron run a job whose minute and hour are fixed in the skipped hour "immediately" after the change; APScheduler's
CronTrigger read 02:30 with the offset before it, 03:30 CEST: the nightly refresh half an hour late on that night.
"""

from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo

import pytest

from cache_refresh.scheduler import fire_times_between, make_trigger

UTC = dt.timezone.utc


def utc(*args: int) -> dt.datetime:
    return dt.datetime(*args, tzinfo=UTC)


@pytest.mark.parametrize(("zone", "schedule", "expected"), [
    ("Europe/Berlin", "30 2 * * *", [utc(2026, 3, 29, 1, 0), utc(2026, 3, 30, 0, 30)]),  # 03:00 CEST, then 02:30
    ("Europe/Berlin", "0 2 * * *", [utc(2026, 3, 29, 1, 0), utc(2026, 3, 30, 0, 0)]),
    ("America/New_York", "30 2 * * *", [utc(2026, 3, 8, 7, 0), utc(2026, 3, 9, 6, 30)]),  # 03:00 EDT
    ("Australia/Lord_Howe", "15 2 * * *", [utc(2026, 10, 3, 15, 30), utc(2026, 10, 4, 15, 15)]),  # 02:30 +11
    ("Australia/Lord_Howe", "45 2 * * *", [utc(2026, 10, 3, 15, 45), utc(2026, 10, 4, 15, 45)]),  # not skipped
])
def test_a_fixed_time_in_the_skipped_hour_fires_once_at_the_change(zone: str, schedule: str,
                                                                   expected: list[dt.datetime]) -> None:
    trig = make_trigger(schedule, zone)
    got = fire_times_between(trig, expected[0] - dt.timedelta(hours=20), expected[1] + dt.timedelta(minutes=1))
    assert [t.astimezone(UTC) for t in got] == expected


def test_the_live_trigger_fires_at_the_change_and_not_again_that_night() -> None:
    tz = ZoneInfo("Europe/Berlin")
    trig = make_trigger("30 2 * * *", "Europe/Berlin")
    first = trig.get_next_fire_time(None, utc(2026, 3, 29, 0, 59).astimezone(tz))  # 01:59 CET
    assert first is not None and first.astimezone(UTC) == utc(2026, 3, 29, 1, 0)
    after = trig.get_next_fire_time(first, (first.astimezone(UTC) + dt.timedelta(microseconds=1)).astimezone(tz))
    assert after is not None and after.astimezone(UTC) == utc(2026, 3, 30, 0, 30)
    # started after the change (03:10 CEST), before APScheduler's 03:30: that night's run was at 03:00, not later
    late = trig.get_next_fire_time(None, utc(2026, 3, 29, 1, 10).astimezone(tz))
    assert late is not None and late.astimezone(UTC) == utc(2026, 3, 30, 0, 30)


def test_a_wildcard_schedule_in_the_skipped_hour_is_unchanged() -> None:
    trig = make_trigger("*/30 2 * * *", "Europe/Berlin")
    got = fire_times_between(trig, utc(2026, 3, 28, 12), utc(2026, 3, 29, 12))
    assert [t.astimezone(UTC) for t in got] == [utc(2026, 3, 29, 1, 0)]
