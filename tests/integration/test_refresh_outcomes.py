"""What a refresh run reports as its outcome (cache_refresh/job.py, cache_refresh/metrics.py), against the session's
real Redis: a run that published reports success whatever fails after the switch.

The checkpoint is test_refresh's tiny trained DeepFM; ``holdout_messages=0`` (no holdout read) and alerts recorded
in-process (their delivery to Kafka is tests/integration/test_refresh_alerts.py's subject).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from prometheus_client import REGISTRY

from cache_refresh import job, run_records
from cache_refresh.settings import RefreshSettings
from learner import artifact, artifact_manifest, artifact_versions, checkpoint
from stream.config import KafkaSettings, RedisSettings
from stream.counts import DailyCounts
from streamrec.cli import main
from streamrec.stack import free_port
from tests.integration.test_refresh import DAY_MS, ITEMS, USERS, config_file, save_checkpoint
from tests.unit.cache_refresh.test_overlap import RecordedAlerts


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(d, steps=5)
    return d


@pytest.fixture
def env(stack: Any, tmp_path: Path, trained: Path,
        redis_client: redis.Redis) -> tuple[RefreshSettings, KafkaSettings, RedisSettings]:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    for p in checkpoint.list_checkpoints(trained):
        for suffix in (".pt", ".json"):
            (ckpt_dir / p.with_suffix(suffix).name).write_bytes(p.with_suffix(suffix).read_bytes())
    counts = DailyCounts(redis_client, prefix=prefix)
    counts.record("item", "impression", ITEMS[:5], np.full(5, DAY_MS))
    counts.record("user", "impression", USERS[:5], np.full(5, DAY_MS))
    # days=7: the window ends at the latest day with counts (DAY_MS's), not today, so a week holds them. 100_000 days
    # cost each refresh ~200,000 HMGETs: the hot set's names are looked for day by day, and these ids have none
    rs = RefreshSettings(checkpoint_dir=ckpt_dir, publish_root=tmp_path / "serving", days=7, hot_items=5,
                         hot_users=5, small_field_rows=0, holdout_messages=0, redis_attempts=1, alerts_topic="")
    return rs, KafkaSettings(bootstrap_servers=stack.bootstrap_servers), RedisSettings(url=stack.redis_url,
                                                                                        prefix=prefix)


def runs(outcome: str, stage: str) -> float:
    return REGISTRY.get_sample_value("streamrec_refresh_runs_total", {"outcome": outcome, "stage": stage}) or 0.0


def degraded(stage: str) -> float:
    return REGISTRY.get_sample_value("streamrec_refresh_degraded_total", {"stage": stage}) or 0.0


def test_an_error_after_the_switch_is_a_degraded_warning_of_a_published_run_not_a_failure(
        env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Notifying serving raises something unforeseen (here an OSError of the client) after ``CURRENT`` names the new
    version: the run has published, so it returns its summary, is counted ``published``, and the error is a
    ``refresh_degraded`` warning (summary, alert, ``streamrec_refresh_degraded_total{stage="notify"}``). It escaped
    ``run_once``: no runs metric, no alert, and the caller was told the run failed."""
    rs, kafka, rds = env

    def broken_notify(*args: Any, **kwargs: Any) -> bool:
        raise OSError("the notification client broke (injected)")

    monkeypatch.setattr(job, "notify", broken_notify)
    alerts = RecordedAlerts()
    published, failed, notify_degraded = runs("published", ""), runs("failed", "notify"), degraded("notify")
    summary = job.run_once(rs, kafka, rds, alerts=alerts)

    assert summary["published"] is True and artifact_versions.current_version(rs.publish_root) == summary["version"]
    assert summary["notified"] is False
    assert any("'notify'" in w and "the notification client broke" in w for w in summary["warnings"])
    assert runs("published", "") == published + 1 and runs("failed", "notify") == failed
    assert degraded("notify") == notify_degraded + 1
    assert [(a.rule, a.severity.value, a.labels["stage"]) for a in alerts.fired] == [
        (job.DEGRADED_RULE, "warning", "notify")]
    assert run_records.read_last_success(rs.publish_root) is not None


def test_now_exits_0_with_the_summary_when_the_published_version_cannot_be_read_back(
        env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Reading the published version's manifest back after the switch failed (``ArtifactError``: a file system
    hiccup, a permission changed): ``--now`` exited 1 with "error" although it had published. The summary now
    comes from the manifest the run validated, the one ``publish`` verified and renamed."""
    rs, kafka, rds = env
    versions = artifact_versions.versions_dir(rs.publish_root)
    real = artifact_manifest.read_manifest

    def unreadable_once_published(version_dir: Path, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if Path(version_dir).parent == versions:
            raise artifact_versions.ArtifactError(f"{version_dir}/manifest.json cannot be read (injected)")
        return real(version_dir, *args, **kwargs)

    monkeypatch.setattr(artifact_manifest, "read_manifest", unreadable_once_published)  # the refresh reads it back
    monkeypatch.setattr(artifact, "read_manifest", unreadable_once_published)  # open_artifact reads it
    cfg = config_file(tmp_path / "c.toml", rs, kafka, rds)
    assert main(["refresh", "--now", "--json", "--config", str(cfg)]) == 0
    summary = json.loads(capsys.readouterr().out)
    on_disk = json.loads((Path(summary["path"]) / artifact_manifest.MANIFEST).read_text())
    assert summary["published"] is True and summary["version"] == artifact_versions.current_version(rs.publish_root)
    assert summary["hot_set"] == on_disk["hot_set"]
    assert summary["bytes"] == {name: f["bytes"] for name, f in on_disk["files"].items()}


def scrape(port: int, name: str, proc: subprocess.Popen[str]) -> float:
    """``name``'s value on the scheduler's /metrics, once the server answers (the process must stay up)."""
    while True:
        assert proc.poll() is None, proc.communicate()
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            time.sleep(0.2)  # the metrics server is not up yet
            continue
        return next(float(line.split(" ")[-1]) for line in text.splitlines() if line.startswith(name + " "))


def last_success_at_start(env: Any, tmp_path: Path) -> float:
    """The last-success gauge of a scheduler process started on ``env``'s publish root (its next run far off), at
    its first scrape; the process is then stopped with SIGTERM and must exit 0."""
    rs, kafka, rds = env
    cfg = config_file(tmp_path / "c.toml", dataclasses.replace(rs, schedule="0 3 1 1 *", misfire_grace_s=1),
                      kafka, rds)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "refresh", "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, STREAMREC_REFRESH_METRICS_PORT=str(port)))
    try:
        return scrape(port, "streamrec_refresh_last_success_timestamp_seconds", proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err


def test_a_restarted_scheduler_reports_the_last_success_on_record_from_its_first_scrape(
        env: Any, tmp_path: Path) -> None:
    """The publish root records a success an hour ago; the scheduler restarts and its next run is far off. Its
    last-success gauge said 0 (the dashboard's "time since last success": ~56 years) until it published again."""
    rs, _, _ = env
    recorded = time.time() - 3600
    rs.publish_root.mkdir(parents=True)
    run_records.write_last_success(rs.publish_root, recorded, "20260101T030000000Z")
    assert last_success_at_start(env, tmp_path) == pytest.approx(recorded, abs=0.01)


def test_a_scheduler_started_without_last_run_json_reports_the_live_versions_publish_time(
        env: Any, tmp_path: Path) -> None:
    """A new container with the publish root mounted, its last_run.json gone: a version is live, so the gauge says
    when it was published (its manifest's ``created``) from the first scrape. It said 0 ("56 years since the last
    success") until the next publish."""
    rs, kafka, rds = env
    summary = job.run_once(rs, kafka, rds)
    (rs.publish_root / run_records.LAST_RUN).unlink()
    created = artifact_manifest.read_manifest(Path(summary["path"]))["created"]
    assert last_success_at_start(env, tmp_path) == pytest.approx(created, abs=0.01)


def test_notified_is_true_only_when_a_serving_process_received_the_notification(
        env: Any, redis_client: redis.Redis) -> None:
    """PUBLISH reaching 0 subscribers (serving down, or listening under another prefix) said ``notified: true``."""
    rs, kafka, rds = env
    alone = job.run_once(rs, kafka, rds)
    assert alone["notified"] is False and alone["notify_receivers"] == 0
    pubsub = redis_client.pubsub()
    pubsub.subscribe(job.notify_channel(rs, rds))
    try:
        pubsub.get_message(timeout=5)  # the subscribe confirmation
        heard = job.run_once(rs, kafka, rds)
        assert heard["notified"] is True and heard["notify_receivers"] == 1
    finally:
        pubsub.close()


def lineage_switches() -> float:
    return REGISTRY.get_sample_value("streamrec_refresh_lineage_switched_total") or 0.0


def source_lineage(summary: dict[str, Any]) -> str:
    """The lineage of the checkpoint a published version was built from, as its manifest says."""
    return artifact_manifest.read_manifest(Path(summary["path"]))["source"]["lineage"]


def test_a_publish_from_another_training_run_alerts_once_naming_both_lineages(
        env: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    """The learner was pointed at an empty checkpoint directory (a new lineage, its count starting again) and the next
    refresh published its model over the live one: a refresh_lineage_switched warning naming both lineages, a log
    warning, the counter, and ``lineage_switched`` in the summary (``--now --json``) and last_run.json. The guard on
    samples trained skipped another lineage silently: the serving model was replaced by another training's without a
    word. The first publish ever (nothing live) is no switch; the publish is never held back by it."""
    rs, kafka, rds = env
    alerts = RecordedAlerts()
    before = lineage_switches()
    caplog.set_level(logging.WARNING, logger="streamrec.refresh")
    first = job.run_once(rs, kafka, rds, alerts=alerts)  # nothing live yet: no switch
    assert first["published"] is True and first["lineage_switched"] is None
    afresh = tmp_path / "afresh"  # the learner started afresh in an empty checkpoint_dir
    save_checkpoint(afresh, steps=5, seed=1)
    second = job.run_once(dataclasses.replace(rs, checkpoint_dir=afresh), kafka, rds, alerts=alerts)
    old, new = source_lineage(first), source_lineage(second)
    assert old and new and old != new

    assert second["published"] is True and artifact_versions.current_version(rs.publish_root) == second["version"]
    switches = [a for a in alerts.fired if a.rule == job.LINEAGE_RULE]
    assert len(switches) == 1
    alert = switches[0]
    assert alert.severity.value == "warning"
    assert alert.labels == {"stage": "publish", "from_lineage": old, "to_lineage": new, "replaced": first["version"]}
    assert old in alert.message and new in alert.message and second["version"] in alert.message
    assert lineage_switches() == before + 1
    assert second["lineage_switched"]["from"] == old and second["lineage_switched"]["to"] == new
    assert second["lineage_switched"]["replaced"] == first["version"]
    assert second["lineage_switched"]["message"] == alert.message
    assert run_records.read_last_run(rs.publish_root)["lineage_switched"] == second["lineage_switched"]
    assert any(r.levelno == logging.WARNING and r.getMessage() == alert.message for r in caplog.records)

    # an operator's --now back to the first training: the --json summary says so too
    cfg = config_file(tmp_path / "c.toml", rs, kafka, rds)
    assert main(["refresh", "--now", "--json", "--config", str(cfg)]) == 0
    back = json.loads(capsys.readouterr().out)
    assert back["lineage_switched"]["from"] == new and back["lineage_switched"]["to"] == old
    assert back["lineage_switched"]["replaced"] == second["version"]
    assert lineage_switches() == before + 2


def test_publishes_of_the_same_training_run_raise_no_lineage_alert(env: Any) -> None:
    rs, kafka, rds = env
    alerts = RecordedAlerts()
    before = lineage_switches()
    first = job.run_once(rs, kafka, rds, alerts=alerts)  # the first publish ever
    again = job.run_once(rs, kafka, rds, alerts=alerts)  # the same lineage over it
    assert source_lineage(first) == source_lineage(again)
    assert again["published"] is True and first["lineage_switched"] is None and again["lineage_switched"] is None
    assert [a for a in alerts.fired if a.rule == job.LINEAGE_RULE] == []
    assert lineage_switches() == before
    assert run_records.read_last_run(rs.publish_root)["lineage_switched"] is None


def test_a_publish_resolves_once_each_alert_that_earlier_runs_fired(env: Any, tmp_path: Path) -> None:
    """A run fails (no checkpoint: ``refresh_failed`` at stage ``checkpoint``), in another process than the one that
    publishes next (a scheduled run, then an operator's ``--now``). The publish sends one ``resolved`` record with the
    failure's fingerprint (the monitor's contract: every firing is followed by one resolved); the publish after it
    resolves nothing again. Before, a refresh sent firing records only: the failure stayed firing in every consumer
    of the alerts topic for ever, good runs or not."""
    rs, kafka, rds = env
    failing = RecordedAlerts()
    with pytest.raises(job.RefreshError, match="at checkpoint"):
        job.run_once(dataclasses.replace(rs, checkpoint_dir=tmp_path / "none"), kafka, rds, alerts=failing)
    [fired] = failing.fired
    assert fired.state.value == "firing"

    publishing = RecordedAlerts()
    assert job.run_once(rs, kafka, rds, alerts=publishing)["published"] is True
    resolved = [a for a in publishing.fired if a.state.value == "resolved"]
    assert [(a.rule, a.fingerprint, dict(a.labels)) for a in resolved] == [
        (fired.rule, fired.fingerprint, dict(fired.labels))]

    again = RecordedAlerts()
    assert job.run_once(rs, kafka, rds, alerts=again)["published"] is True
    assert [a for a in again.fired if a.state.value == "resolved"] == []


def test_a_publish_over_a_live_version_with_holdout_messages_0_raises_no_degraded_warning(env: Any) -> None:
    """``holdout_messages = 0`` (env's) is "no quality check" by the operator's setting: the run reads no holdout and
    says so; it sent a refresh_degraded warning on every publish blaming an empty or misnamed samples topic."""
    rs, kafka, rds = env
    alerts = RecordedAlerts()
    job.run_once(rs, kafka, rds, alerts=alerts)
    again = job.run_once(rs, kafka, rds, alerts=alerts)  # over a live version
    assert again["published"] is True and again["warnings"] == [] and "unchecked" not in again["holdout"]
    assert "holdout_messages = 0" in again["holdout"]["skipped"]
    assert [a.rule for a in alerts.fired] == []
