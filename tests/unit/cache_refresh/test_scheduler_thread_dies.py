"""The scheduler's own thread (cache_refresh/scheduler.py run_forever, APScheduler's main loop) dying of an unexpected
exception. run_forever then returned as after a stop and ``streamrec refresh`` exited 0: a process that would never
refresh again looked like a clean shutdown to its supervisor, with no alert. It must end with an error line, a
``refresh_failed`` alert at stage ``scheduler`` and a non-zero exit code."""

from __future__ import annotations

import logging

import pytest
from apscheduler.schedulers.blocking import BlockingScheduler

from cache_refresh.alerts import FAILED_RULE
from cache_refresh.scheduler import EXIT_FAILED, run_forever
from tests.unit.cache_refresh.test_stop_during_run import ListedAlerts, ListSink, hard_exit


def test_a_scheduler_thread_that_dies_is_a_failed_exit_with_an_error_line_and_a_scheduler_alert(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(self: BlockingScheduler) -> float:  # APScheduler's pass over the due jobs, failing
        raise RuntimeError("injected: the job store is corrupt")

    monkeypatch.setattr(BlockingScheduler, "_process_jobs", broken)
    sink = ListSink()
    alerts = ListedAlerts(sink)
    ran: list[int] = []
    with caplog.at_level(logging.ERROR, logger="streamrec.refresh"):
        code = run_forever(lambda: ran.append(1), "0 3 * * *", "UTC", 3600, None, alerts=alerts, hard_exit=hard_exit)
    alerts.close()
    assert code == EXIT_FAILED != 0
    assert [(a.rule, a.labels["stage"]) for a in sink.sent] == [(FAILED_RULE, "scheduler")]
    assert "RuntimeError: injected: the job store is corrupt" in sink.sent[0].message
    assert any("RuntimeError: injected" in r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
    assert ran == []
