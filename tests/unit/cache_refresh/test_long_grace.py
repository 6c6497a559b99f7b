"""A long ``[refresh] misfire_grace_s``: the catch-up at start (cache_refresh/scheduler.py ``missed_run``) finds the
latest fire time of the grace period without listing every fire time in it (a per-minute schedule and a grace of a
year held the scheduler's start for seconds, ten years for minutes), and a grace reaching back before 1970 is no
OverflowError traceback; a grace longer than a year is refused as a ConfigError naming the setting (APScheduler's
own misfire check overflows on larger ones)."""

from __future__ import annotations

import datetime as dt

import pytest

from cache_refresh.scheduler import make_trigger, missed_run
from cache_refresh.settings import RefreshSettings
from stream.errors import ConfigError
from tests.unit.cache_refresh.test_scheduler_dst import Bounded

NOW = dt.datetime(2026, 1, 10, 3, 30, 20, tzinfo=dt.timezone.utc)
YEAR = 366 * 86400


@pytest.mark.parametrize(("schedule", "latest"), [
    ("* * * * *", dt.datetime(2026, 1, 10, 3, 30, tzinfo=dt.timezone.utc)),
    ("0 3 * * *", dt.datetime(2026, 1, 10, 3, 0, tzinfo=dt.timezone.utc)),
    ("0 4 1 1 *", dt.datetime(2026, 1, 1, 4, 0, tzinfo=dt.timezone.utc)),
    ("0 4 1 2 *", dt.datetime(2025, 2, 1, 4, 0, tzinfo=dt.timezone.utc)),
])
def test_the_catch_up_finds_the_latest_fire_time_of_a_long_grace_without_listing_them_all(
        schedule: str, latest: dt.datetime) -> None:
    trigger = Bounded(make_trigger(schedule, "UTC"), limit=200)
    assert missed_run(trigger, NOW, None, YEAR) == latest  # type: ignore[arg-type]
    assert missed_run(trigger, NOW, latest, YEAR) is None  # type: ignore[arg-type]


def test_a_grace_reaching_back_before_1970_is_no_overflow() -> None:
    assert missed_run(make_trigger("0 3 * * *", "UTC"), NOW, None, 10**11) == dt.datetime(
        2026, 1, 10, 3, 0, tzinfo=dt.timezone.utc)


def test_a_grace_longer_than_a_year_is_a_config_error_naming_it() -> None:
    RefreshSettings(misfire_grace_s=YEAR)
    with pytest.raises(ConfigError, match=r"^\[refresh\] misfire_grace_s must be at most 31622400 "):
        RefreshSettings(misfire_grace_s=YEAR + 1)
