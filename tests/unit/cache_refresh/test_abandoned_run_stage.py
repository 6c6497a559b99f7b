"""A scheduled run abandoned at SIGTERM (cache_refresh/scheduler.py run_forever: the stop grace ran out) while it was
still retrying an unreachable Redis at the hot set. The abandonment alert said ``refresh_failed{stage="shutdown"}``
and nothing else: not the stage the run was in, not the Redis error it was retrying (5 attempts, up to ~32 s by
default, longer than the stop grace). It must name both (``job.RunProgress``)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from cache_refresh import job
from cache_refresh.alerts import FAILED_RULE
from cache_refresh.scheduler import run_forever
from cache_refresh.settings import RefreshSettings
from stream.config import KafkaSettings, RedisSettings
from streamrec.stack import free_port
from tests.unit.cache_refresh.test_stop_during_run import Exited, ListedAlerts, ListSink, hard_exit
from tests.unit.cache_refresh.test_stop_signal_now import save


def test_a_run_abandoned_while_retrying_redis_names_its_stage_and_the_redis_error_in_the_shutdown_alert(
        tmp_path: Path) -> None:
    save(tmp_path / "ckpt", 100)
    rs = RefreshSettings(checkpoint_dir=tmp_path / "ckpt", publish_root=tmp_path / "serving", holdout_messages=0,
                         alerts_topic="", redis_attempts=5, redis_backoff_s=0.5, redis_timeout_s=0.5, format="eager")
    port = free_port()  # nothing listens: connection refused, retried
    sink, release = ListSink(), threading.Event()
    alerts, progress = ListedAlerts(sink), job.RunProgress()

    def backoff(seconds: float) -> None:  # the first retry's wait: the operator stops the scheduler now
        if not release.is_set():
            os.kill(os.getpid(), signal.SIGTERM)
            release.wait(30)

    def scheduled() -> None:  # streamrec refresh's scheduled job, with the retry wait above
        try:
            job.run_once(rs, KafkaSettings(), RedisSettings(url=f"redis://127.0.0.1:{port}/0"), sleep=backoff,
                         respect_pin=True, alerts=alerts, progress=progress)
        except job.RefreshError:
            pass
        finished.set()

    finished = threading.Event()
    try:
        with pytest.raises(Exited):
            run_forever(scheduled, "* * * * *", "UTC", 3600, None, alerts=alerts, stop_grace_s=0.3,
                        hard_exit=hard_exit, where=progress.where)
    finally:
        release.set()
    assert finished.wait(30)  # the abandoned run's thread ends (in production the process exits under it)
    assert [(a.rule, a.labels) for a in sink.sent] == [(FAILED_RULE, {"stage": "shutdown", "run_stage": "hot_set"})]
    message = sink.sent[0].message
    assert "at stage hot_set" in message, message
    assert "days with counts: Redis error" in message and f"127.0.0.1:{port}" in message, message


def test_the_run_progress_records_the_redis_retries_of_notifying_serving_after_the_publish(tmp_path: Path) -> None:
    """A run retrying Redis to notify serving after its publish (Redis down) and abandoned then said "last error it
    saw: none": notify's retries were not recorded in the RunProgress the abandonment alert reads."""
    import dataclasses

    from tests.unit.cache_refresh.test_stop_signal_now import _live_and_newer, _now_settings

    root, ckpts = _live_and_newer(tmp_path)
    rs = dataclasses.replace(_now_settings(root, ckpts), redis_attempts=2, redis_backoff_s=0.01)
    progress = job.RunProgress()
    during_backoff: list[tuple[str | None, str | None]] = []
    summary = job.run_once(rs, KafkaSettings(), RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"),
                           sleep=lambda s: during_backoff.append(progress.where()), progress=progress)
    assert summary["published"] and summary["notified"] is False
    assert during_backoff, "notify did not retry"
    stage, error = during_backoff[-1]
    assert stage == "after_publish" and error is not None and "notify serving: Redis error" in error, (stage, error)


@pytest.mark.parametrize("cleanup", ["rows a killed run left", "pruned versions' rows"])
def test_the_run_progress_records_the_redis_errors_of_the_embedding_store_cleanups(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cleanup: str) -> None:
    """The layered run's best-effort cleanups (the rows a killed run left, before this run writes its own; the pruned
    versions' rows, after its publish) only logged the Redis error they met: a run abandoned in the step after (the
    rows' write, notifying serving), each up to redis_timeout_s per command against that Redis, said "last error it
    saw: none". Redis here is a closed port: both cleanups fail to connect."""
    import dataclasses

    from serving import stored_versions
    from serving.settings import EmbeddingStore
    from tests.unit.cache_refresh.test_stop_signal_now import _live_and_newer, _now_settings

    root, ckpts = _live_and_newer(tmp_path)
    rs = dataclasses.replace(_now_settings(root, ckpts), embedding_store=EmbeddingStore.LAYERED)
    progress = job.RunProgress()
    seen: dict[str, tuple[str | None, str | None]] = {}

    def writes(*args: Any, **kwargs: Any) -> dict[str, Any]:  # the next step after the killed run's rows' cleanup
        seen["rows a killed run left"] = progress.where()
        return {"stored": 0, "dtype": "float32"}

    def notifies(*args: Any, **kwargs: Any) -> None:  # the next step after the prune
        seen["pruned versions' rows"] = progress.where()
        return None

    monkeypatch.setattr(stored_versions, "write_version", writes)
    monkeypatch.setattr(job, "notify", notifies)
    summary = job.run_once(rs, KafkaSettings(), RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"),
                           progress=progress)
    assert summary["published"]
    stage, error = seen[cleanup]
    assert stage == ("embedding_store" if cleanup == "rows a killed run left" else "after_publish"), stage
    assert error is not None and "Error 111" in error and cleanup.split()[0] in error, error
