"""A fixed-time schedule in the hours before the clocks' change fires on the day after it too
(cache_refresh/scheduler.py ``CrontabTrigger``).

APScheduler 3's CronTrigger moves to the next day by adding the wall-clock difference in UTC: from 00:00 CET on
2026-03-29 (Europe/Berlin; clocks forward at 02:00) "midnight next day" is 24 h later, 01:00 CEST on 2026-03-30, past
that day's 00:00, so a ``0 0 * * *`` refresh skipped 2026-03-30 and ran next on the 31st. Where the clocks skip
midnight itself (America/Santiago, 2026-09-06 00:00 -> 01:00) the fixed-time rule fires at the change, as crontab does.
"""

from __future__ import annotations

import datetime as dt
import itertools
from zoneinfo import ZoneInfo

import pytest

from cache_refresh.scheduler import fire_times_between, make_trigger

UTC = dt.timezone.utc


@pytest.mark.parametrize(("zone", "schedule", "day"), [
    ("Europe/Berlin", "0 0 * * *", dt.date(2026, 3, 30)),
    ("Europe/Berlin", "30 0 * * *", dt.date(2026, 3, 30)),
    ("America/New_York", "0 0 * * *", dt.date(2026, 3, 9)),
    ("America/St_Johns", "1 0 * * *", dt.date(2026, 3, 9)),  # clocks forward at 02:00, a day of its own skipped
    ("Australia/Lord_Howe", "0 0 * * *", dt.date(2026, 10, 5)),  # a 30-minute change
])
def test_the_day_after_the_clocks_go_forward_still_has_its_run(zone: str, schedule: str, day: dt.date) -> None:
    tz = ZoneInfo(zone)
    start = dt.datetime.combine(day - dt.timedelta(days=3), dt.time(), tz)
    end = start + dt.timedelta(days=6) - dt.timedelta(seconds=1)  # six midnights, the seventh not
    got = fire_times_between(make_trigger(schedule, zone), start, end)
    assert [t.date() for t in got] == [day + dt.timedelta(days=d) for d in range(-3, 3)]


def test_the_live_trigger_fires_every_day_around_the_change() -> None:
    """As the running scheduler asks (the previous fire time and a now just after it), one run a day, none lost."""
    tz = ZoneInfo("Europe/Berlin")
    trig = make_trigger("0 0 * * *", "Europe/Berlin")
    t = trig.get_next_fire_time(None, dt.datetime(2026, 3, 27, 12, tzinfo=tz))
    fired = []
    for _ in range(4):
        assert t is not None
        fired.append(t)
        t = trig.get_next_fire_time(t, t)
    assert [f.astimezone(tz).replace(tzinfo=None) for f in fired] == [
        dt.datetime(2026, 3, d) for d in (28, 29, 30, 31)]


def test_a_fixed_time_at_a_skipped_midnight_fires_once_at_the_change() -> None:
    tz = ZoneInfo("America/Santiago")  # 2026-09-06 00:00 -04 -> 01:00 -03: that day has no midnight
    got = fire_times_between(make_trigger("0 0 * * *", "America/Santiago"),
                             dt.datetime(2026, 9, 4, 12, tzinfo=tz), dt.datetime(2026, 9, 7, 12, tzinfo=tz))
    assert [t.astimezone(UTC) for t in got] == [dt.datetime(2026, 9, 5, 4, tzinfo=UTC),
                                                dt.datetime(2026, 9, 6, 4, tzinfo=UTC),  # 01:00 -03, the change
                                                dt.datetime(2026, 9, 7, 3, tzinfo=UTC)]


@pytest.mark.parametrize(("zone", "schedule"), list(itertools.product(
    ["Europe/Berlin", "America/New_York", "America/Santiago", "Australia/Lord_Howe", "America/St_Johns"],
    ["0 0 * * *", "30 0 * * *", "30 1 * * *", "30 2 * * *", "0 23 * * *"])))
def test_a_daily_fixed_time_fires_once_on_every_day_of_a_year(zone: str, schedule: str) -> None:
    tz = ZoneInfo(zone)
    got = fire_times_between(make_trigger(schedule, zone), dt.datetime(2026, 1, 1, tzinfo=tz),
                             dt.datetime(2026, 12, 31, 23, 59, tzinfo=tz))
    assert [t.date() for t in got] == [dt.date(2026, 1, 1) + dt.timedelta(days=d) for d in range(365)]


def test_a_monthly_midnight_run_on_the_first_after_the_change_is_not_lost() -> None:
    """``0 0 1 * *`` in Europe/Berlin: the clocks go forward on 2026-03-29, and April's run was skipped (11 a year)."""
    tz = ZoneInfo("Europe/Berlin")
    got = fire_times_between(make_trigger("0 0 1 * *", "Europe/Berlin"), dt.datetime(2026, 1, 1, tzinfo=tz),
                             dt.datetime(2026, 12, 31, tzinfo=tz))
    assert [t.replace(tzinfo=None) for t in got] == [dt.datetime(2026, m, 1) for m in range(1, 13)]


def test_a_wildcard_schedule_across_the_change_fires_each_instant_once_in_the_live_walk() -> None:
    tz = ZoneInfo("Europe/Berlin")
    trig = make_trigger("*/15 * * * *", "Europe/Berlin")
    t = trig.get_next_fire_time(None, dt.datetime(2026, 3, 29, 1, 0, tzinfo=tz))
    fired = []
    while t is not None and t < dt.datetime(2026, 3, 29, 4, 0, tzinfo=tz):
        fired.append(t.astimezone(UTC))
        t = trig.get_next_fire_time(t, t)
    assert fired == [dt.datetime(2026, 3, 29, 0, 0, tzinfo=UTC) + dt.timedelta(minutes=15 * i) for i in range(8)]
