"""The catch-up at start (README: "a run missed while the process was down runs on start within misfire_grace_s")
catches up runs that were missed, not runs that ran: a scheduled run held by a rollback pin, or one that failed after
it started, is recorded in ``last_run.json`` (``last_ran``) and counts as ran for its fire time. Before, only a
publish counted: a scheduler restarted within the grace ran the held or failed run again, repeating its
``refresh_pinned`` or ``refresh_failed`` alert."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

from cache_refresh import job, run_records
from cache_refresh.scheduler import make_trigger, missed_run
from cache_refresh.settings import RefreshSettings

UTC = dt.timezone.utc


def _after_scheduled_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, outcome: Any) -> dt.datetime | None:
    """The catch-up's record after a scheduled run at 03:00:05 (fire time 03:00) whose run_once did ``outcome``,
    the last publish a day before; the scheduler restarted at 03:10 with a grace of an hour."""
    fire = dt.datetime(2026, 12, 5, 3, 0, tzinfo=UTC)
    run_records.write_last_success(tmp_path, (fire - dt.timedelta(days=1)).timestamp(), "v001")
    clock = iter([(fire + dt.timedelta(seconds=5)).timestamp()])
    monkeypatch.setattr(job.time, "time", lambda: next(clock, (fire + dt.timedelta(minutes=2)).timestamp()))

    def run_once(*_a: object, **_k: object) -> dict[str, Any]:
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(job, "run_once", run_once)
    job.scheduled_run(RefreshSettings(publish_root=tmp_path), None, None)  # type: ignore[arg-type]
    monkeypatch.undo()
    last = run_records.restore_last_success(tmp_path)
    return missed_run(make_trigger("0 3 * * *", "UTC"), fire + dt.timedelta(minutes=10), last, 3600)


def test_a_scheduled_run_held_by_the_pin_is_not_run_again_by_the_catch_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    held = {"published": False, "version": None, "built": "v002", "pin_held": {"version": "v001"}}
    assert _after_scheduled_run(tmp_path, monkeypatch, held) is None
    last_success = run_records.read_last_success(tmp_path)
    assert last_success == dt.datetime(2026, 12, 4, 3, 0, tzinfo=UTC)  # still the last publish


def test_a_scheduled_run_that_failed_is_not_run_again_by_the_catch_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _after_scheduled_run(tmp_path, monkeypatch, job.RefreshError("hot_set", "Redis unreachable")) is None


def test_a_run_skipped_at_the_lock_did_not_run_and_is_caught_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    skipped = {"published": False, "version": None, "skipped": {"stage": "lock"}}
    assert _after_scheduled_run(tmp_path, monkeypatch, skipped) == dt.datetime(2026, 12, 5, 3, 0, tzinfo=UTC)
