"""A ``last_run.json`` dated in the future (clock skew, a root copied from another host, a hand edit) is not trusted
(cache_refresh/job.py ``read_last_success``, ``MAX_CLOCK_SKEW_S``): it set the last-success gauge ahead of now, and the
staleness alert on it stayed silent for as long as the date was ahead. The gauge now comes from the publish root, as
for a missing record, and a warning names the file and the date."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

from cache_refresh import metrics, run_records
from learner import artifact_manifest as M
from learner import artifact_versions as V
from tests.unit.cache_refresh.test_last_success_fallback import fresh_gauge, gauge, published  # noqa: F401

DAY = 86400.0


def test_a_last_success_in_the_future_is_no_record_and_the_gauge_is_the_live_versions_publish_time(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    version = published(tmp_path)
    run_records.write_last_success(tmp_path, time.time() + 30 * DAY, version.name)
    with caplog.at_level(logging.WARNING, logger="streamrec.refresh"):
        assert run_records.restore_last_success(tmp_path) is None  # the scheduler's catch-up counts no success either
    created = json.loads((version / M.MANIFEST).read_text())["created"]
    assert gauge() == pytest.approx(created)
    warning = next(r.getMessage() for r in caplog.records if "in the future" in r.getMessage())
    recorded = json.loads((tmp_path / run_records.LAST_RUN).read_text())["last_success_utc"]
    assert str(tmp_path / run_records.LAST_RUN) in warning and recorded in warning


def test_a_last_success_within_the_clock_skew_is_believed(tmp_path: Path) -> None:
    now = 1_800_000_000.0
    run_records.write_last_success(tmp_path, now + run_records.MAX_CLOCK_SKEW_S - 1, "v001")
    assert run_records.read_last_success(tmp_path, now=now) is not None
    run_records.write_last_success(tmp_path, now + run_records.MAX_CLOCK_SKEW_S + 1, "v001")
    assert run_records.read_last_success(tmp_path, now=now) is None


def test_a_future_manifest_and_current_leave_the_gauge_at_0_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The fallback is held to the same rule: a root copied from a host whose clock is ahead says nothing usable."""
    version = published(tmp_path)
    manifest = json.loads((version / M.MANIFEST).read_text())
    now = manifest["created"] - 30 * DAY  # this host's clock a month behind the one that built and published it
    future = manifest["created"]
    os.utime(tmp_path / V.CURRENT, (future, future))
    with caplog.at_level(logging.WARNING, logger="streamrec.refresh"):
        assert run_records.live_published_at(tmp_path, now=now) is None
    assert sum("in the future" in r.getMessage() for r in caplog.records) == 2


def test_a_gauge_set_while_the_clock_was_ahead_moves_back_at_the_next_publish(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The same in the running scheduler: a publish while this host's clock was a month ahead set the gauge a month
    ahead, and since it only moves forward, the publishes after the clock was corrected left it there: the staleness
    alert stayed silent for the month."""
    real = time.time
    monkeypatch.setattr(metrics.time, "time", lambda: real() + 30 * DAY)
    metrics.observe({"published": True}, 1.0)  # the clock ahead
    assert gauge() > real() + 29 * DAY
    monkeypatch.setattr(metrics.time, "time", real)  # corrected
    with caplog.at_level(logging.WARNING, logger="streamrec.refresh"):
        metrics.observe({"published": True}, 1.0)
    assert gauge() == pytest.approx(real(), abs=60)
    assert any("in the future" in r.getMessage() for r in caplog.records)
    metrics.observe({"published": True}, 1.0)  # and from here on it moves forward only, as before
    metrics.restore_last_success(real() - DAY)
    assert gauge() == pytest.approx(real(), abs=60)
