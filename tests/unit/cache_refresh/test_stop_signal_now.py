"""``streamrec refresh --now`` (cache_refresh/job.py ``run_now``) stopped by SIGTERM/SIGINT while the run is inside
one of the best-effort ``except Exception`` blocks on its way (here: ``checkpoint.load_latest``, which skips a newest
checkpoint its ``accept`` check raises on and falls back to the previous one). The stop raised by the signal handler
was an ``Exception``: that block took it for a refused checkpoint, and the run went on with an older one after an
operator had asked it to stop (a second signal only logs). It must end the run as a failed run at the stage it was
in, as a stop anywhere else does.

No Redis here: a run that went on would fail at stage ``hot_set`` (Redis at a closed port, one attempt). The stop
during the publish (the run finishes) is tested with a real subprocess in tests/integration/test_faults_serving.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cache_refresh import job
from cache_refresh import redis_client as refresh_redis
from cache_refresh.metrics import RUNS
from cache_refresh.publish import publish
from cache_refresh.settings import RefreshSettings
from learner import artifact as A
from learner import artifact_manifest as M
from learner import artifact_versions as V
from learner import checkpoint
from learner.artifact import build_artifact
from stream.config import KafkaSettings, RedisSettings
from streamrec.stack import free_port
from tests.unit.learner.test_artifact import make_checkpoint


def save(directory: Path, samples: int) -> Path:
    ck = make_checkpoint()
    path = checkpoint.save(directory, {"model": ck["model"]}, {**ck["meta"], "samples_trained": samples,
                                                                "lineage": "1" * 32}, keep=10)
    time.sleep(0.002)  # names carry ms
    return path


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_inside_a_best_effort_except_block_still_ends_refresh_now_as_a_failed_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sig: signal.Signals) -> None:
    root, ckpts = tmp_path / "serving", tmp_path / "ckpt"
    live = make_checkpoint()
    live["meta"] = {**live["meta"], "samples_trained": 512, "lineage": "1" * 32}
    publish(root, build_artifact(live, root, np.zeros(0), format="eager", version="v001"), keep=3)
    save(ckpts, 600)
    newest = save(ckpts, 1024)
    checked: list[str] = []
    check = M.check_checkpoint

    def signalled_check(ckpt: Any) -> Any:  # the accept callback load_latest calls inside its except Exception
        checked.append(Path(ckpt.path).name)
        if len(checked) == 1:
            signal.raise_signal(sig)  # the operator's stop, handled by run_now's handler right here
        return check(ckpt)

    monkeypatch.setattr(M, "check_checkpoint", signalled_check)  # the refresh checks each checkpoint it loads
    monkeypatch.setattr(A, "check_checkpoint", signalled_check)  # build_artifact checks it again
    rs = RefreshSettings(checkpoint_dir=ckpts, publish_root=root, holdout_messages=0, alerts_topic="",
                         redis_attempts=1, redis_backoff_s=0.01, redis_timeout_s=0.5, format="eager")
    failed = RUNS.labels("failed", "checkpoint")
    before = failed._value.get()
    handlers = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    with pytest.raises(job.RefreshError) as err:
        job.run_now(rs, KafkaSettings(), RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
    assert checked == [newest.name]  # the run stopped there: it did not go on with the older checkpoint
    assert err.value.stage == "checkpoint" and sig.name in str(err.value), str(err.value)
    assert failed._value.get() == before + 1  # recorded as a run that failed at that stage
    assert V.current_version(root) == "v001" and V.list_versions(root) == ["v001"]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers  # put back


def _now_settings(root: Path, ckpts: Path) -> RefreshSettings:
    """A run that reaches the build without Redis: no counted ids asked for (hot_items = hot_users = 0)."""
    return RefreshSettings(checkpoint_dir=ckpts, publish_root=root, holdout_messages=0, alerts_topic="",
                           hot_items=0, hot_users=0, redis_attempts=1, redis_backoff_s=0.01, redis_timeout_s=0.5,
                           format="eager")


def _live_and_newer(tmp_path: Path) -> tuple[Path, Path]:
    root, ckpts = tmp_path / "serving", tmp_path / "ckpt"
    live = make_checkpoint()
    live["meta"] = {**live["meta"], "samples_trained": 512, "lineage": "1" * 32}
    publish(root, build_artifact(live, root, np.zeros(0), format="eager", version="v001"), keep=3)
    save(ckpts, 1024)
    return root, ckpts


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_while_refresh_now_handles_a_failure_keeps_that_failure_alerted_and_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        sig: signal.Signals) -> None:
    """The validation fails; the signal comes while the failure handler removes the staged artifact. Before, the stop
    raised there replaced the failure: RefreshError at stage shutdown, no refresh_failed alert and no failed-run count
    for the validation, and the staged artifact left behind."""
    root, ckpts = _live_and_newer(tmp_path)

    def failing_probe(*args: Any, **kwargs: Any) -> Any:
        raise job.validate.ValidationFailed("probe: scores differ from the learner's by 0.5")

    removed: list[Path] = []
    rmtree = job.shutil.rmtree

    def signalled_rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        if not removed:
            removed.append(Path(path))
            signal.raise_signal(sig)  # the operator's stop, while the run is handling its failure
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(job.validate, "probe", failing_probe)
    monkeypatch.setattr(job.shutil, "rmtree", signalled_rmtree)
    failed = RUNS.labels("failed", "validate")
    before = failed._value.get()
    with caplog.at_level("WARNING", logger="streamrec.refresh"), pytest.raises(job.RefreshError) as err:
        job.run_now(_now_settings(root, ckpts), KafkaSettings(),
                    RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
    assert err.value.stage == "validate" and "scores differ" in str(err.value), str(err.value)
    assert failed._value.get() == before + 1
    assert 'refresh_failed{stage="validate"}' in caplog.text and "scores differ" in caplog.text
    assert sig.name in caplog.text  # the signal is said, not hidden
    assert removed and not removed[0].exists()  # the handler went on to remove what was staged
    assert V.current_version(root) == "v001" and V.list_versions(root) == ["v001"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_while_refresh_now_takes_the_lock_ends_it_as_a_failed_run_at_stage_lock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        sig: signal.Signals) -> None:
    """Before, a stop while the run took the publish root's lock ended as RefreshError at stage shutdown with no
    refresh_failed alert and no failed-run count, unlike a stop during the run's stages."""
    root, ckpts = _live_and_newer(tmp_path)
    lock = job.refresh_lock

    @contextlib.contextmanager
    def signalled_lock(path: Path) -> Iterator[None]:
        signal.raise_signal(sig)  # the operator's stop, while the run takes the lock
        with lock(path):
            yield

    monkeypatch.setattr(job, "refresh_lock", signalled_lock)
    failed = RUNS.labels("failed", "lock")
    before = failed._value.get()
    handlers = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    with caplog.at_level("WARNING", logger="streamrec.refresh"), pytest.raises(job.RefreshError) as err:
        job.run_now(_now_settings(root, ckpts), KafkaSettings(),
                    RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
    assert err.value.stage == "lock" and sig.name in str(err.value), str(err.value)
    assert failed._value.get() == before + 1
    assert 'refresh_failed{stage="lock"}' in caplog.text
    assert V.current_version(root) == "v001" and V.list_versions(root) == ["v001"]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_while_the_layered_write_cleans_up_after_a_redis_error_keeps_that_error_and_deletes_every_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        sig: signal.Signals) -> None:
    """The layered write fails with a Redis error (OOM) and the stop comes while _store_rows deletes the rows written
    so far: the stop was raised inside that deletion, which only caught Exception, so half the rows stayed in Redis
    (no meta: never served, never pruned) with no line naming them, and the alert said the signal, not the OOM."""
    import redis

    from cache_refresh.settings import EmbeddingStore
    from serving import stored_versions

    root, ckpts = _live_and_newer(tmp_path)
    rows = {f"p:emb:x:{i}" for i in range(3)}

    class Client:
        def close(self) -> None:
            pass

    def oom(*args: Any, **kwargs: Any) -> Any:
        raise redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'.")

    def delete_version(client: Any, prefix: str, version: str) -> int:
        n = 0
        while rows:
            rows.pop()
            n += 1
            if n == 1:
                signal.raise_signal(sig)  # the operator's stop, while the failed write's rows are being deleted
        return n

    monkeypatch.setattr(job, "_redis", lambda rds, rs: Client())
    monkeypatch.setattr(stored_versions, "unfinished_versions", lambda *a, **k: set())
    monkeypatch.setattr(stored_versions, "write_version", oom)
    monkeypatch.setattr(stored_versions, "delete_version", delete_version)
    rs = dataclasses.replace(_now_settings(root, ckpts), embedding_store=EmbeddingStore.LAYERED)
    with caplog.at_level("WARNING", logger="streamrec.refresh"), pytest.raises(job.RefreshError) as err:
        job.run_now(rs, KafkaSettings(), RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0", prefix="p"))
    assert err.value.stage == "embedding_store" and "OOM" in str(err.value), str(err.value)
    assert rows == set()  # every row of the failed write deleted
    assert sig.name in caplog.text  # the signal is said, not hidden
    assert V.current_version(root) == "v001"


def _signalled_close(client: Any, sig: signal.Signals, closed: list[str], name: str) -> Any:
    """``client`` whose close() first delivers ``sig`` (the operator's stop, landing in the run's cleanup)."""
    close = client.close

    def signalled() -> None:
        if not closed:
            closed.append(name)
            signal.raise_signal(sig)
        close()

    client.close = signalled
    return client


@pytest.mark.parametrize("site", ["hot set client close", "pinger close", "build cleanup"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_in_a_cleanup_of_a_failing_refresh_now_stage_keeps_that_failure_alerted_and_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        sig: signal.Signals, site: str) -> None:
    """A stage fails (Redis down at the hot set, refused credentials at its PING, a full disk in the build) and the
    stop lands in the cleanup that runs on the way out (the clients' close() in ``finally``, build_artifact's removal
    of what it staged). Before, the stop raised there replaced the failure: the run failed at the same stage, alerted
    and counted, but the alert said "stopped by SIGTERM" instead of the reason, and the build's cleanup was cut
    short, leaving its staged directory."""
    import errno

    from stream.redis_client import RedisAuthError

    root, ckpts = _live_and_newer(tmp_path)
    rs = RefreshSettings(checkpoint_dir=ckpts, publish_root=root, holdout_messages=0, alerts_topic="",
                         redis_attempts=1, redis_backoff_s=0.01, redis_timeout_s=0.5, format="eager")
    closed: list[str] = []
    stage, reason = "hot_set", "unreachable"
    if site == "hot set client close":
        redis_client = refresh_redis._redis
        monkeypatch.setattr(job, "_redis", lambda rds, s: _signalled_close(redis_client(rds, s), sig, closed, site))
    elif site == "pinger close":
        connect = job.connect

        def signalled_connect(*args: Any, **kwargs: Any) -> Any:
            client = connect(*args, **kwargs)
            return _signalled_close(client, sig, closed, site) if kwargs.get("retries") == 0 else client

        def refused(client: Any, rds: Any, reachable: bool = True) -> bool:
            raise RedisAuthError("redis refused the credentials (WRONGPASS)")

        monkeypatch.setattr(job, "connect", signalled_connect)
        monkeypatch.setattr(job, "verify", refused)
        reason = "WRONGPASS"
    else:
        rs = _now_settings(root, ckpts)  # no Redis: the run reaches the build
        stage, reason = "build", "No space left on device"
        write_synced, rmtree = A.write_synced, A.shutil.rmtree

        def full(path: Path, write: Any) -> None:
            if path.name == M.COLD_FILE:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            write_synced(path, write)

        def signalled_rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
            if not closed:
                closed.append(site)
                signal.raise_signal(sig)
            rmtree(path, *args, **kwargs)

        monkeypatch.setattr(A, "write_synced", full)
        monkeypatch.setattr(A.shutil, "rmtree", signalled_rmtree)
    failed = RUNS.labels("failed", stage)
    before = failed._value.get()
    with caplog.at_level("WARNING", logger="streamrec.refresh"), pytest.raises(job.RefreshError) as err:
        job.run_now(rs, KafkaSettings(), RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
    assert closed and closed[0] == site  # the stop came where the test says
    assert err.value.stage == stage and reason in str(err.value), str(err.value)
    assert failed._value.get() == before + 1
    assert f'refresh_failed{{stage="{stage}"}}' in caplog.text
    alerted = [r.getMessage() for r in caplog.records if "refresh_failed" in r.getMessage()]
    assert alerted and all(reason in m and "stopped by" not in m for m in alerted), alerted
    assert sig.name in caplog.text  # the signal is said, not hidden
    assert V.current_version(root) == "v001" and V.list_versions(root) == ["v001"]
    assert not any((root / V.STAGING).glob("*"))  # nothing staged left: the cleanup was not cut short


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_kept_pending_in_a_best_effort_except_still_ends_refresh_now_before_it_publishes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sig: signal.Signals) -> None:
    """The stop lands while an exception is handled and then swallowed (a best-effort ``except``, here the live
    version's source read): it is not raised there (it would replace a failure in flight), and the run, which got
    past the exception, must still stop at the end of its stage instead of going on to publish."""
    root, ckpts = _live_and_newer(tmp_path)
    live_source = job._live_source

    def swallowing(path: Path) -> Any:
        try:
            raise V.ArtifactError("the live manifest is torn")
        except V.ArtifactError:
            signal.raise_signal(sig)  # the operator's stop, inside a best-effort except
        return live_source(path)

    monkeypatch.setattr(job, "_live_source", swallowing)
    failed = RUNS.labels("failed", "checkpoint")
    before = failed._value.get()
    with pytest.raises(job.RefreshError) as err:
        job.run_now(_now_settings(root, ckpts), KafkaSettings(),
                    RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
    assert err.value.stage == "checkpoint" and f"stopped by {sig.name}" in str(err.value), str(err.value)
    assert failed._value.get() == before + 1
    assert V.current_version(root) == "v001" and V.list_versions(root) == ["v001"]


def test_a_stop_signal_during_a_redis_retry_backoff_stops_the_run_at_once_not_after_the_retries() -> None:
    """A stop while the hot set waits between Redis retries is no failure's cleanup (the run is still trying): it must
    raise there, not be kept pending (StopSignals keeps a stop pending while an exception is in flight) and so wait
    out every remaining attempt."""
    import redis

    from cache_refresh import hot_set

    calls: list[int] = []

    def down() -> None:
        calls.append(1)
        raise redis.ConnectionError("Connection refused")

    stop = job.StopSignals()
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        stop.arm()
        with pytest.raises(job.RefreshTerminated):
            hot_set.with_retries("days with counts", down, attempts=4, backoff_s=0.01,
                                 sleep=lambda s: signal.raise_signal(signal.SIGTERM))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert calls == [1]


def test_a_failed_scheduled_run_is_alerted_before_its_cleanups_so_an_abandoning_stop_cannot_drop_that_alert(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler (``streamrec refresh``) waits STOP_GRACE_S for the run in progress at SIGTERM, then abandons it
    (os._exit) with a generic ``refresh_failed{stage="shutdown"}`` alert. A run that had already failed but was still
    in its failure cleanups then (deleting the layered rows it wrote, each Redis command up to redis_timeout_s against
    the Redis that failed it) never alerted its failure: the alert came after the cleanups. The operator saw
    "shutdown", not the reason. The failure's alert must be queued before the cleanups begin."""
    from cache_refresh.settings import EmbeddingStore

    root, ckpts = _live_and_newer(tmp_path)
    fired: list[str] = []

    class Alerts:
        def fire(self, stage: str, message: str, rule: str, **kwargs: Any) -> None:
            fired.append(f"{rule}{{stage={stage}}}: {message}")

        def record_in(self, root: Path) -> None:
            pass

    def full(*args: Any, **kwargs: Any) -> Any:
        raise V.ArtifactError("cannot hold PUBLISHING for the publish: No space left on device")

    alerted_at_cleanup: list[list[str]] = []
    monkeypatch.setattr(job, "_store_rows", lambda rs, rds, model, *args, **kwargs: {"stored": 1, "dtype": "float32"})
    monkeypatch.setattr(job, "publish", full)  # fails after the rows were written
    monkeypatch.setattr(job, "_discard_stored", lambda *a, **k: alerted_at_cleanup.append(list(fired)))
    rs = dataclasses.replace(_now_settings(root, ckpts), embedding_store=EmbeddingStore.LAYERED)
    with pytest.raises(job.RefreshError):
        job.run_once(rs, KafkaSettings(), RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"), respect_pin=True,
                     alerts=Alerts())  # type: ignore[arg-type]
    assert alerted_at_cleanup, "the failure handler did not clean up the stored rows"
    assert any("refresh_failed{stage=publish}" in a and "No space" in a for a in alerted_at_cleanup[0]), \
        alerted_at_cleanup
