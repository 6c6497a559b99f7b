"""A stop (SIGTERM) of ``streamrec refresh --now`` kept pending by ``job.StopSignals`` (it came while an exception was
in flight, which the run then got past in a best-effort ``except``) must end the run at the end of the stage it came
in, named with that stage, and long stages must see it between their units of work, not only at their end."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cache_refresh import job
from cache_refresh.metrics import RUNS
from learner import artifact as A
from learner import artifact_manifest as M
from learner import artifact_versions as V
from stream.config import KafkaSettings, RedisSettings
from streamrec.stack import free_port
from tests.unit.cache_refresh.test_stop_signal_now import _live_and_newer, _now_settings


def _stop_inside_a_swallowed_error() -> None:
    """The operator's SIGTERM, delivered while a best-effort ``except`` handles an error it then swallows."""
    try:
        raise OSError("a best-effort step's error")
    except OSError:
        signal.raise_signal(signal.SIGTERM)


@pytest.mark.parametrize("stage", ["lock", "signing", "cleanup"])
def test_a_stop_kept_pending_in_the_lock_signing_or_cleanup_stage_ends_the_run_at_that_stage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str) -> None:
    """Before, these stages had no stage end: the pending stop was raised only at the end of the checkpoint stage,
    after every checkpoint had been loaded and checked, and the failure and its alert said stage checkpoint."""
    root, ckpts = _live_and_newer(tmp_path)
    if stage == "lock":
        lock = job.refresh_lock

        @contextlib.contextmanager
        def swallowing_lock(path: Path) -> Iterator[None]:
            with lock(path):
                _stop_inside_a_swallowed_error()
                yield

        monkeypatch.setattr(job, "refresh_lock", swallowing_lock)
    elif stage == "signing":
        load_key = job.load_signing_key

        def swallowing_key(path: Any) -> Any:
            _stop_inside_a_swallowed_error()
            return load_key(path)

        monkeypatch.setattr(job, "load_signing_key", swallowing_key)
    else:
        clean = job.clean_leftovers

        def swallowing_clean(path: Path) -> list[str]:
            _stop_inside_a_swallowed_error()
            return clean(path)

        monkeypatch.setattr(job, "clean_leftovers", swallowing_clean)
    checked: list[Any] = []
    monkeypatch.setattr(M, "check_checkpoint", checked.append)  # the refresh checks each checkpoint it loads
    monkeypatch.setattr(A, "check_checkpoint", checked.append)  # build_artifact checks it again
    failed = RUNS.labels("failed", stage)
    before = failed._value.get()
    with pytest.raises(job.RefreshError) as err:
        job.run_now(_now_settings(root, ckpts), KafkaSettings(),
                    RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
    assert err.value.stage == stage and "stopped by SIGTERM" in str(err.value), str(err.value)
    assert failed._value.get() == before + 1
    assert checked == []  # no checkpoint was loaded after the stop
    assert V.current_version(root) == "v001" and V.list_versions(root) == ["v001"]


def test_a_stop_kept_pending_while_checkpoints_are_skipped_ends_the_run_before_the_next_older_one_is_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop comes while the newest checkpoint is refused (an exception in flight: kept pending). Before, the run
    went on loading and checking every older checkpoint (each one a whole model read from disk) and stopped only at
    the end of the checkpoint stage."""
    from learner import checkpoint_read
    from tests.unit.cache_refresh.test_stop_signal_now import save

    root, ckpts = _live_and_newer(tmp_path)  # the live v001 (512 samples) and a checkpoint of 1024
    newest = save(ckpts, 2048)
    loaded: list[str] = []
    load = checkpoint_read.load

    def counted_load(path: Path, *args: Any, **kwargs: Any) -> Any:
        loaded.append(Path(path).name)
        return load(path, *args, **kwargs)

    check = M.check_checkpoint

    def refusing_check(ckpt: Any) -> Any:  # the newest is refused, and the stop comes while it is
        if Path(ckpt.path) != newest:
            return check(ckpt)
        try:
            raise V.ArtifactError("the newest checkpoint diverged")
        except V.ArtifactError:
            signal.raise_signal(signal.SIGTERM)
            raise

    monkeypatch.setattr(checkpoint_read, "load", counted_load)
    monkeypatch.setattr(M, "check_checkpoint", refusing_check)  # the refresh checks each checkpoint it loads
    monkeypatch.setattr(A, "check_checkpoint", refusing_check)  # build_artifact checks it again
    with pytest.raises(job.RefreshError) as err:
        job.run_now(_now_settings(root, ckpts), KafkaSettings(),
                    RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
    assert err.value.stage == "checkpoint" and "stopped by SIGTERM" in str(err.value), str(err.value)
    assert loaded == [newest.name]  # the older checkpoint was not loaded after the stop
    assert V.current_version(root) == "v001"


class _Eof:
    def code(self) -> int:
        from confluent_kafka import KafkaError

        return KafkaError._PARTITION_EOF


class _EofMessage:
    def error(self) -> _Eof:
        return _Eof()

    def partition(self) -> int:
        return 0


class _SlowTopic:
    """A consumer of a one-partition topic whose end comes after ``polls`` empty polls (a broker slow to answer, up to
    holdout_timeout_s): pure loop logic, no broker."""

    def __init__(self, polls: int) -> None:
        self.polls, self.consumed = polls, 0

    def list_topics(self, topic: str, timeout: float) -> Any:
        class Md:
            error = None
            partitions = {0: None}

        class Topics:
            topics = {topic: Md()}

        return Topics()

    def assign(self, partitions: Any) -> None:
        pass

    def consume(self, batch: int, timeout: float) -> list[Any]:
        self.consumed += 1
        return [_EofMessage()] if self.consumed >= self.polls else []

    def close(self) -> None:
        pass


def test_a_stop_kept_pending_before_the_holdout_read_ends_the_read_at_its_next_poll(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop comes while the run swallows an error just before the holdout read (here: the live artifact does not
    load). Before, the read went on polling until every partition reached its end or holdout_timeout_s ran out, and
    the run stopped only at the end of the validate stage."""
    import dataclasses

    from cache_refresh import validate
    from stream import kafka

    root, ckpts = _live_and_newer(tmp_path)

    def swallowing_live_model(path: Path, key: Any = None) -> Any:
        try:
            raise V.ArtifactError("the live artifact is torn")
        except V.ArtifactError as exc:
            signal.raise_signal(signal.SIGTERM)
            return None, str(exc)

    topic = _SlowTopic(polls=50)
    monkeypatch.setattr(job, "_live_model", swallowing_live_model)
    monkeypatch.setattr(validate, "watermarks", lambda *a, **k: {0: (0, 10)})
    monkeypatch.setattr(kafka, "new_consumer", lambda *a, **k: topic)
    rs = dataclasses.replace(_now_settings(root, ckpts), holdout_messages=10, holdout_timeout_s=300.0)
    with pytest.raises(job.RefreshError) as err:
        job.run_now(rs, KafkaSettings(), RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
    assert err.value.stage == "validate" and "stopped by SIGTERM" in str(err.value), str(err.value)
    assert topic.consumed <= 1, topic.consumed  # not polled on to the partition's end
    assert V.current_version(root) == "v001"


def test_a_pending_stop_checked_while_an_exception_is_in_flight_stays_pending_and_raises_at_the_next_check() -> None:
    """The stop checks now run inside other packages' loops (load_latest, read_to_end): one called while an exception
    is in flight must not replace it, as the signal handler itself does not; the stop stays pending."""
    stop = job.StopSignals()
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        stop.arm()
        _stop_inside_a_swallowed_error()  # kept pending
        with pytest.raises(OSError, match="the failure"):
            try:
                raise OSError("the failure")
            except OSError:
                stop.check()
                raise
        with pytest.raises(job.RefreshTerminated):
            stop.check()
    finally:
        signal.signal(signal.SIGTERM, previous)
