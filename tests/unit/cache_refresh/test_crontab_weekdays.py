"""``[refresh] schedule`` is a crontab expression, and its weekday field means what crontab means: 0 and 7 are Sunday,
1-5 Monday to Friday. APScheduler 3's ``CronTrigger.from_crontab`` counts 0 as Monday (its issue 286, fixed only in
4.x): ``0 3 * * 1-5`` ran Tuesday to Saturday, ``0 3 * * 0`` on Mondays, ``0 3 * * 7`` was refused. And where crontab
runs when either a restricted day of the month or a restricted weekday matches, APScheduler needs both: such a
schedule is refused, naming both fields, instead of firing on other days than it says."""

from __future__ import annotations

import datetime as dt

import pytest

from cache_refresh.scheduler import check_schedule, make_trigger
from stream.errors import ConfigError


def weekdays(schedule: str, n: int = 7) -> list[str]:
    trigger = make_trigger(schedule, "UTC")
    t = dt.datetime(2026, 1, 5, 12, tzinfo=dt.timezone.utc)  # a Monday
    out = []
    for _ in range(n):
        t = trigger.get_next_fire_time(None, t + dt.timedelta(seconds=1))
        out.append(t.strftime("%a"))
    return out


@pytest.mark.parametrize(("field", "days"), [
    ("0", ["Sun"]), ("7", ["Sun"]), ("6", ["Sat"]), ("1-5", ["Mon", "Tue", "Wed", "Thu", "Fri"]),
    ("*/2", ["Tue", "Thu", "Sat", "Sun"]), ("1-5/2", ["Mon", "Wed", "Fri"]), ("0,6", ["Sat", "Sun"]),
    ("5-7", ["Fri", "Sat", "Sun"]), ("0-6", ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]),
    ("mon-fri", ["Mon", "Tue", "Wed", "Thu", "Fri"]), ("sun", ["Sun"]), ("SAT,1", ["Mon", "Sat"]),
    ("*", ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]),
])
def test_the_weekday_field_counts_as_crontab_does(field: str, days: list[str]) -> None:
    """``days`` Monday first."""
    week = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
    assert sorted(set(weekdays(f"0 3 * * {field}", 14)), key=week.index) == days


@pytest.mark.parametrize("field", ["8", "3-1", "*/0", "1-9"])
def test_a_weekday_out_of_crontabs_range_is_a_config_error(field: str) -> None:
    with pytest.raises(ConfigError, match=r"^\[refresh\] schedule '0 3 \* \* "):
        check_schedule(f"0 3 * * {field}", "UTC")


def test_a_day_of_month_and_a_weekday_both_restricted_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"restricts both the day of the month \('1'\) and the weekday \('1'\)"):
        check_schedule("0 3 1 * 1", "UTC")
    check_schedule("0 3 1 * *", "UTC")  # either alone is what it says
    check_schedule("0 3 * * 1", "UTC")
