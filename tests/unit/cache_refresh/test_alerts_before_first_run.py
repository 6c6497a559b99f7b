"""An alert the scheduler fires before any run recorded its publish root (cache_refresh/alerts.py, "Resolution"). The
scheduler's RefreshAlerts recorded in ``<publish_root>/refresh_firing.jsonl`` only once a run had called
``record_in``: the thread dying before its first run (or a ``shutdown`` abandonment of the first run) fired a
``refresh_failed`` that no later publish resolved, firing for ever at every consumer of the alerts topic."""

from __future__ import annotations

from pathlib import Path

import pytest
from apscheduler.schedulers.blocking import BlockingScheduler

from cache_refresh.alerts import FAILED_RULE, FIRING
from streamrec.cli import main
from tests.unit.cache_refresh.test_overlap import RecordedAlerts


def test_a_scheduler_whose_thread_dies_before_its_first_run_fires_an_alert_a_later_publish_resolves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: BlockingScheduler) -> float:  # APScheduler's first pass over the due jobs, failing
        raise RuntimeError("injected: the job store is corrupt")

    monkeypatch.setattr(BlockingScheduler, "_process_jobs", broken)
    monkeypatch.setenv("STREAMREC_REFRESH_ALERTS_TOPIC", "")  # the log only
    root = tmp_path / "serving"  # not made yet: no run has started
    assert main(["refresh", "--publish-root", str(root), "--checkpoint-dir", str(tmp_path / "ckpt")]) == 1
    assert (root / FIRING).is_file()  # recorded, with no run having started

    later = RecordedAlerts()  # the next run that publishes (job.run_once records in the root, then resolves)
    later.record_in(root)
    assert later.resolve_firing("v2") == 1
    assert [(a.rule, a.state.value, a.labels["stage"]) for a in later.fired] == [(FAILED_RULE, "resolved", "scheduler")]
