"""``streamrec refresh --status`` says when the last scheduled run failed since the last publish, and why: the run
was recorded in ``last_run.json`` as ``last_ran`` (a time, for the catch-up) and nothing else, and the status showed
the last success alone, as if nothing had run since; the failure was only in the log and the alert."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from cache_refresh import job, run_records, status
from cache_refresh.settings import RefreshSettings


def _scheduled_run(root: Path, monkeypatch: pytest.MonkeyPatch, outcome: Any) -> None:
    def run_once(*_a: object, **_k: object) -> dict[str, Any]:
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(job, "run_once", run_once)
    job.scheduled_run(RefreshSettings(publish_root=root), None, None)  # type: ignore[arg-type]


def test_the_status_names_the_last_scheduled_run_that_failed_and_its_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_records.write_last_success(tmp_path, time.time() - 86400, "v001")
    _scheduled_run(tmp_path, monkeypatch, job.RefreshError("hot_set", "Redis at redis://:hunter2@cache:6379 down"))
    failed = status.status(tmp_path)["last_run_failed"]
    assert failed["error"] == "refresh failed at hot_set: Redis at redis://***@cache:6379 down"
    assert failed["at"] == run_records.read_last_ran(tmp_path).isoformat()  # type: ignore[union-attr]


def test_a_run_the_pin_held_is_no_failure_and_a_publish_ends_the_failures_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _scheduled_run(tmp_path, monkeypatch, job.RefreshError("build", "out of memory"))
    _scheduled_run(tmp_path, monkeypatch, {"published": False, "pin_held": {"version": "v001"}})
    assert "last_run_failed" not in status.status(tmp_path)  # the last run was held, not failed
    _scheduled_run(tmp_path, monkeypatch, job.RefreshError("build", "out of memory"))
    assert status.status(tmp_path)["last_run_failed"]["error"] == "refresh failed at build: out of memory"
    run_records.write_last_success(tmp_path, time.time(), "v002")
    assert "last_run_failed" not in status.status(tmp_path)


def test_an_unexpected_exception_of_a_run_is_recorded_as_its_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ZeroDivisionError):
        _scheduled_run(tmp_path, monkeypatch, ZeroDivisionError("division by zero"))
    assert status.status(tmp_path)["last_run_failed"]["error"] == "ZeroDivisionError: division by zero"
