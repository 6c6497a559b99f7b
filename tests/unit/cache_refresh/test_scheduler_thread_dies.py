"""The scheduler's own thread (cache_refresh/scheduler.py run_forever, APScheduler's main loop) dying of an unexpected
exception. run_forever then returned as after a stop and ``streamrec refresh`` exited 0: a process that would never
refresh again looked like a clean shutdown to its supervisor, with no alert. It must end with an error line, a
``refresh_failed`` alert at stage ``scheduler`` and a non-zero exit code."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

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


def test_a_run_abandoned_because_the_scheduler_thread_died_says_so_not_that_a_signal_stopped_it(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The scheduler's thread dies while a run is going; the run outlasts the wait for it and is abandoned. Before,
    that abandonment said "the refresh scheduler was stopped (SIGTERM/SIGINT)", although no signal came."""
    import threading

    from cache_refresh.scheduler import EXIT_ABANDONED
    from tests.unit.cache_refresh.test_stop_during_run import Exited

    running, release = threading.Event(), threading.Event()
    process_jobs = BlockingScheduler._process_jobs

    def dies_during_the_run(self: BlockingScheduler) -> float | None:
        wait = process_jobs(self)  # submits the catch-up run to the executor
        if running.wait(10):
            raise RuntimeError("injected: the job store is corrupt")
        return wait

    def run() -> None:
        running.set()
        release.wait(30)

    monkeypatch.setattr(BlockingScheduler, "_process_jobs", dies_during_the_run)
    sink = ListSink()
    alerts = ListedAlerts(sink)
    try:
        with caplog.at_level(logging.ERROR, logger="streamrec.refresh"), pytest.raises(Exited) as exited:
            run_forever(run, "* * * * *", "UTC", 3600, None, alerts=alerts, stop_grace_s=0.3, hard_exit=hard_exit,
                        where=lambda: ("hot_set", None))
    finally:
        release.set()
    assert exited.value.code == EXIT_ABANDONED
    assert len(sink.sent) == 1 and sink.sent[0].rule == FAILED_RULE, sink.sent
    message = sink.sent[0].message
    assert "thread died" in message and "RuntimeError: injected: the job store is corrupt" in message, message
    assert "SIGTERM" not in message and "stop signal" not in message, message
    assert sink.sent[0].labels == {"stage": "scheduler", "run_stage": "hot_set"}, sink.sent[0].labels
    assert "at stage hot_set" in message, message


def _dies_after_a_signal(process_jobs: Any, running: threading.Event | None = None) -> Any:
    """APScheduler's pass over the due jobs: (after submitting the catch-up run, once it runs) a SIGTERM comes to the
    process and then the thread dies, before the main thread's next look: both are there when it looks."""

    def dies(self: BlockingScheduler) -> float | None:
        if running is not None:
            process_jobs(self)
            running.wait(10)
        os.kill(os.getpid(), signal.SIGTERM)
        raise RuntimeError("injected: the job store is corrupt")

    return dies


def test_a_scheduler_thread_that_dies_as_a_stop_signal_comes_is_still_a_failed_exit_with_a_scheduler_alert(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, a signal seen in the same look as the thread's death made it a plain stop: exit 0, no alert, the
    death only in APScheduler's log line."""
    monkeypatch.setattr(BlockingScheduler, "_process_jobs", _dies_after_a_signal(BlockingScheduler._process_jobs))
    sink = ListSink()
    alerts = ListedAlerts(sink)
    code = run_forever(lambda: None, "0 3 * * *", "UTC", 3600, None, alerts=alerts, hard_exit=hard_exit)
    alerts.close()
    assert code == EXIT_FAILED != 0
    assert [(a.rule, a.labels["stage"]) for a in sink.sent] == [(FAILED_RULE, "scheduler")], sink.sent
    assert "thread died (RuntimeError: injected: the job store is corrupt)" in sink.sent[0].message


def test_a_run_abandoned_as_the_scheduler_thread_dies_and_a_stop_signal_comes_says_the_thread_died(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the abandonment said "the refresh scheduler was stopped (SIGTERM/SIGINT)", at stage shutdown."""
    from cache_refresh.scheduler import EXIT_ABANDONED
    from tests.unit.cache_refresh.test_stop_during_run import Exited

    running, release = threading.Event(), threading.Event()

    def run() -> None:
        running.set()
        release.wait(30)

    monkeypatch.setattr(BlockingScheduler, "_process_jobs",
                        _dies_after_a_signal(BlockingScheduler._process_jobs, running))
    sink = ListSink()
    alerts = ListedAlerts(sink)
    try:
        with pytest.raises(Exited) as exited:
            run_forever(run, "* * * * *", "UTC", 3600, None, alerts=alerts, stop_grace_s=0.3, hard_exit=hard_exit,
                        where=lambda: ("build", None))
    finally:
        release.set()
    assert exited.value.code == EXIT_ABANDONED
    assert len(sink.sent) == 1 and sink.sent[0].labels == {"stage": "scheduler", "run_stage": "build"}, sink.sent
    message = sink.sent[0].message
    assert "thread died (RuntimeError: injected" in message and "stopped (SIGTERM/SIGINT)" not in message, message


def test_an_exception_of_the_scheduler_thread_after_a_stop_began_its_shutdown_is_a_warning_and_a_clean_stop(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A SIGTERM comes; the main thread shuts the scheduler down, and only then does the scheduler's thread raise
    (APScheduler failing in its own shutdown). Before, any exception but JobLookupError counted as the thread's death:
    exit 1 and a refresh_failed alert at stage scheduler for a genuine stop."""
    shut = threading.Event()
    shutdown = BlockingScheduler.shutdown

    def noted_shutdown(self: BlockingScheduler, *a: Any, **k: Any) -> None:
        shutdown(self, *a, **k)
        shut.set()

    def fails_in_its_shutdown(self: BlockingScheduler) -> float | None:
        os.kill(os.getpid(), signal.SIGTERM)
        assert shut.wait(10)  # the main thread has begun the shutdown: the stop came first
        raise RuntimeError("injected: the executor failed while shutting down")

    monkeypatch.setattr(BlockingScheduler, "shutdown", noted_shutdown)
    monkeypatch.setattr(BlockingScheduler, "_process_jobs", fails_in_its_shutdown)
    sink = ListSink()
    alerts = ListedAlerts(sink)
    with caplog.at_level(logging.WARNING, logger="streamrec.refresh"):
        code = run_forever(lambda: None, "0 3 * * *", "UTC", 3600, None, alerts=alerts, hard_exit=hard_exit)
    alerts.close()
    assert code == 0 and sink.sent == [], sink.sent
    [warning] = [r for r in caplog.records if "RuntimeError: injected: the executor failed" in r.getMessage()]
    assert warning.levelno == logging.WARNING
