"""The hot set tells stale lookup counts by the counts keys' days (``YYYYMMDD``) read as ``stream.counts_keys`` reads
them, not by ``date.fromisoformat``: before Python 3.11 (``requires-python >= 3.10``) that takes ``YYYY-MM-DD`` only,
so with lookup and impression counts both present (the default ``count_event`` and ``fallback_event``) every
refresh failed at its hot set with ``ValueError: Invalid isoformat string: '20261207'``."""

from __future__ import annotations

import datetime as dt
import re
import types

import pytest

from cache_refresh import hot_set


class _Date310(dt.date):
    """``datetime.date`` whose ``fromisoformat`` takes what Python 3.10's does: ``YYYY-MM-DD`` only."""

    @classmethod
    def fromisoformat(cls, date_string: str) -> dt.date:  # type: ignore[override]
        if not re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date_string):
            raise ValueError(f"Invalid isoformat string: {date_string!r}")
        return dt.date.fromisoformat(date_string)


@pytest.fixture
def python_310_dates(monkeypatch: pytest.MonkeyPatch) -> None:
    shim = types.SimpleNamespace(**{name: getattr(dt, name) for name in dir(dt) if not name.startswith("__")})
    shim.date = _Date310
    monkeypatch.setattr(hot_set, "dt", shim)


def _available(lookup_days: list[str], impression_days: list[str]) -> hot_set.Days:
    return {("item", "lookup"): lookup_days, ("item", "impression"): impression_days}


@pytest.mark.usefixtures("python_310_dates")
def test_lookup_counts_two_days_behind_the_impressions_are_stale_with_python_310_dates() -> None:
    available = _available(["20261204", "20261205"], ["20261206", "20261207"])
    assert hot_set.stale_day(None, "item", "lookup", "impression", available) == "20261205"  # type: ignore[arg-type]


@pytest.mark.usefixtures("python_310_dates")
def test_lookup_counts_of_the_impressions_day_are_not_stale_with_python_310_dates() -> None:
    available = _available(["20261207"], ["20261206", "20261207"])
    assert hot_set.stale_day(None, "item", "lookup", "impression", available) is None  # type: ignore[arg-type]


def test_stale_day_counts_whole_days_across_a_month_and_a_year_end() -> None:
    assert hot_set.stale_day(None, "item", "lookup", "impression",  # type: ignore[arg-type]
                             _available(["20261231"], ["20270101"])) is None
    assert hot_set.stale_day(None, "item", "lookup", "impression",  # type: ignore[arg-type]
                             _available(["20261130"], ["20261202"])) == "20261130"
