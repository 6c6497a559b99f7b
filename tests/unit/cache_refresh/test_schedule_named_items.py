"""A name in ``[refresh] schedule`` (a month, a weekday, the day field's ``last``) followed by more (a step, ``#``,
other text) is refused naming the item: APScheduler 3 matches a name item by its start alone, so ``0 3 * * mon-fri/2``
(crontab: Monday, Wednesday, Friday) ran every weekday, ``0 3 * jan-jun/2 *`` every month of the half year and
``mon#2`` every Monday, said nowhere."""

from __future__ import annotations

import pytest

from cache_refresh.scheduler import check_schedule, make_trigger
from stream.errors import ConfigError


@pytest.mark.parametrize(("schedule", "what", "item"), [
    ("0 3 * * mon-fri/2", "weekday", "mon-fri/2"), ("0 3 * * sun/2", "weekday", "sun/2"),
    ("0 3 * * mon#2", "weekday", "mon#2"), ("0 3 * * 1,tue.", "weekday", "tue."),
    ("0 3 * jan-jun/2 *", "month", "jan-jun/2"), ("0 3 * feb;x *", "month", "feb;x"),
    ("0 3 lastx * *", "day of the month", "lastx"), ("0 3 * jan2 *", "month", "jan2"),
])
def test_a_name_with_more_after_it_is_refused_naming_the_item(schedule: str, what: str, item: str) -> None:
    with pytest.raises(ConfigError, match=rf"{what} '{item}' has more after its name .* would not read"):
        check_schedule(schedule, "UTC")


@pytest.mark.parametrize(("schedule", "days", "months"), [
    ("0 3 * * mon-wed,FRI", "mon-wed,fri", "*"), ("0 3 * JAN,feb *", "*", "jan,feb"),
    ("0 3 * jan-jun *", "*", "jan-jun"),
])
def test_names_and_ranges_of_names_are_read_whole(schedule: str, days: str, months: str) -> None:
    trigger = make_trigger(schedule, "UTC")
    fields = {f.name: str(f) for f in trigger.fields}
    assert (fields["day_of_week"], fields["month"]) == (days, months)


def test_a_step_over_numbers_is_the_way_to_say_it() -> None:
    fields = {f.name: str(f) for f in make_trigger("0 3 * 1-6/2 1-5/2", "UTC").fields}
    assert (fields["day_of_week"], fields["month"]) == ("mon,wed,fri", "1-6/2")


@pytest.mark.parametrize(("schedule", "why"), [
    ("0 3 mon * *", 'Unrecognized expression "mon" for field "day"'), ("0 3 * janx *", 'Invalid month name "janx"'),
])
def test_a_name_that_is_none_is_refused_as_before(schedule: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        check_schedule(schedule, "UTC")
