"""Overlapping refreshes (cache_refresh/job.py skipped, cache_refresh/scheduler.py): the run that finds another going
does nothing, and says so as a skip (a warning, ``outcome="skipped"``, ``--now`` exit 3), never as a failure."""

from __future__ import annotations

import datetime as dt
import os
import threading
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from cache_refresh import job
from cache_refresh.alerts import RefreshAlerts
from cache_refresh.publish import refresh_lock
from cache_refresh.scheduler import build_scheduler
from cache_refresh.settings import RefreshSettings
from monitor.alerts import Alert
from stream.config import KafkaSettings, RedisSettings
from streamrec.cli import main


class RecordedAlerts(RefreshAlerts):
    """The refresh's alerts, logged as usual and kept here (no Kafka topic)."""

    def __init__(self) -> None:
        super().__init__(KafkaSettings(), "")
        self.fired: list[Alert] = []

    def _send(self, alert: Alert) -> None:  # every alert fired, and each resolved one a publish sends
        super()._send(alert)
        self.fired.append(alert)


def runs(outcome: str, stage: str) -> float:
    return REGISTRY.get_sample_value("streamrec_refresh_runs_total", {"outcome": outcome, "stage": stage}) or 0.0


def test_a_run_while_another_holds_the_publish_root_is_skipped_with_a_warning_not_a_failure(tmp_path: Path) -> None:
    """An operator's ``--now`` and the daemon's scheduled run overlap: the second to start did nothing while the first
    publishes. It was a critical ``refresh_failed`` at stage ``lock`` and a failed run in the metric."""
    rs = RefreshSettings(checkpoint_dir=tmp_path / "ckpt", publish_root=tmp_path / "serving", alerts_topic="")
    alerts = RecordedAlerts()
    skipped, failed = runs("skipped", "lock"), runs("failed", "lock")
    with refresh_lock(rs.publish_root):  # the other run
        summary = job.run_once(rs, KafkaSettings(), RedisSettings(), alerts=alerts)
    assert summary["published"] is False and summary["version"] is None
    assert summary["skipped"]["stage"] == "lock" and summary["skipped"]["holder"] == str(os.getpid())
    assert f"another refresh (pid {os.getpid()}) is running" in summary["skipped"]["message"]
    assert [(a.rule, a.severity.value, a.labels) for a in alerts.fired] == [
        (job.SKIP_RULE, "warning", {"stage": "lock", "holder": str(os.getpid())})]
    assert runs("skipped", "lock") == skipped + 1 and runs("failed", "lock") == failed


def test_now_while_another_refresh_runs_exits_3_saying_the_other_run_is_refreshing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMREC_REFRESH_ALERTS_TOPIC", "")
    root = tmp_path / "serving"
    with refresh_lock(root):
        code = main(["refresh", "--now", "--publish-root", str(root), "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert code == 3  # EXIT_BUSY: documented in --help
    err = capsys.readouterr().err
    assert "refresh skipped: another refresh" in err and "error" not in err


def test_a_scheduled_run_due_while_the_previous_still_runs_is_reported_as_skipped(tmp_path: Path) -> None:
    """The scheduler's own skip (its previous run has not ended, e.g. the missed run caught up at start still going
    when the cron run is due) reaches ``on_skip``: ``streamrec refresh`` counts and alerts it. It was a log line."""
    started, release = threading.Event(), threading.Event()

    def slow_run() -> None:
        started.set()
        release.wait(30)

    reported: list[tuple[str, str]] = []
    now = dt.datetime(2026, 1, 10, 3, 30, tzinfo=dt.timezone.utc)
    sched = build_scheduler(slow_run, "0 3 * * *", "UTC", 3600, None, now=now,
                            on_skip=lambda why, stage: reported.append((why, stage)))
    guarded = {j.id: j.func for j in sched.get_jobs()}
    first = threading.Thread(target=guarded["refresh-missed"])
    first.start()
    try:
        assert started.wait(30)
        guarded["refresh"]()  # the cron run, due while the missed run is still going
    finally:
        release.set()
        first.join()
    assert reported == [("this scheduler's previous refresh is still running; the run due now is skipped",
                         "scheduler")]


def test_the_schedulers_skip_is_counted_and_alerted_as_a_warning(tmp_path: Path) -> None:
    alerts = RecordedAlerts()
    before = runs("skipped", "scheduler")
    summary = job.skipped(alerts, tmp_path, "this scheduler's previous refresh is still running", "scheduler")
    assert summary["skipped"]["stage"] == "scheduler" and summary["published"] is False
    assert runs("skipped", "scheduler") == before + 1
    assert [(a.rule, a.severity.value, a.labels) for a in alerts.fired] == [
        (job.SKIP_RULE, "warning", {"stage": "scheduler"})]
