"""A stop (SIGTERM) of ``streamrec refresh --now`` kept pending by ``job.StopSignals`` (it came while an exception was
in flight: redis-py handles connection errors of its own, and ``hot_set.with_retries`` catches each outage) must end
the hot set stage at its next Redis read or retry, and the layered run's cleanup of killed runs' versions at the next
version: not after every read, every backoff sleep (~0.5, 1, 2, 4 s) or every version's delete.
Counted in units of work done after the stop; no broker, no Redis (the reads are a stand-in's)."""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from cache_refresh import hot_set, job
from cache_refresh.settings import RefreshSettings
from learner.features import default_config
from serving import stored_versions
from stream.config import KafkaSettings, RedisSettings
from streamrec.stack import free_port
from tests.unit.cache_refresh.test_stop_pending_stage_end import _stop_inside_a_swallowed_error
from tests.unit.cache_refresh.test_stop_signal_now import _live_and_newer, _now_settings


@pytest.fixture
def armed() -> Iterator[job.StopSignals]:
    """run_now's handler, installed for SIGTERM and armed (the run is past its lock)."""
    stop = job.StopSignals()
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        stop.arm()
        yield stop
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_stop_kept_pending_by_a_redis_error_ends_with_retries_before_its_backoff_sleep(
        armed: job.StopSignals) -> None:
    """Before, the pending stop waited out every backoff sleep and attempt (with the defaults ~0.5 + 1 + 2 + 4 s and 5
    reads of up to redis_timeout_s) before the next stage raised it."""
    calls: list[int] = []
    slept: list[float] = []

    def down() -> None:
        calls.append(1)
        _stop_inside_a_swallowed_error()  # the stop lands while redis-py handles the error
        raise redis.ConnectionError("Connection refused")

    with pytest.raises(job.RefreshTerminated):
        hot_set.with_retries("days with counts", down, attempts=5, backoff_s=0.5, sleep=slept.append,
                             between=armed.check)
    assert calls == [1] and slept == []  # no backoff sleep and no attempt after the stop


def test_a_redis_outage_without_a_stop_still_retries_every_attempt_with_the_check_given(
        armed: job.StopSignals) -> None:
    slept: list[float] = []

    def down() -> None:
        raise redis.ConnectionError("Connection refused")

    with pytest.raises(hot_set.RedisUnavailable):
        hot_set.with_retries("days with counts", down, attempts=3, backoff_s=0.5, sleep=slept.append,
                             between=armed.check)
    assert slept == [0.5, 1.0]


class _Counts:
    """Just the reads hot_set.compute makes of DailyCounts: one day of counts for every kind and event."""

    reads: list[str] = []
    stop_at = 1  # the read the stop lands in (0: none)

    def __init__(self, client: Any, prefix: str, ttl_days: int) -> None:
        pass

    def _read(self, what: str) -> None:
        _Counts.reads.append(what)
        if len(_Counts.reads) == _Counts.stop_at:
            _stop_inside_a_swallowed_error()

    def all_days_available(self) -> dict[tuple[str, str], list[str]]:
        self._read("days")
        return {(kind, event): ["20260101"] for kind in ("item", "user") for event in ("lookup", "impression")}

    def top(self, kind: str, event: str, day: str, days: int, k: int) -> list[tuple[str, float]]:
        self._read(f"top {kind}s")
        return [(str(i + 1), float(10 - i)) for i in range(k)]

    def day_counts(self, kind: str, event: str, members: Any, day: str, days: int, at_most: Any = None) -> Any:
        self._read(f"day counts {kind}s")
        return {}

    def names(self, kind: str, members: Any, day: str, days: int) -> dict[str, str]:
        self._read(f"names {kind}s")
        return {}


def test_a_stop_kept_pending_at_the_hot_sets_first_read_ends_the_stage_before_its_next_read(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, hot_set.compute had no stop check: the pending stop waited for every read (the top items and users,
    their per-day check, their names) and was raised only where the build stage began."""
    root, ckpts = _live_and_newer(tmp_path)
    _Counts.reads, _Counts.stop_at = [], 1

    class Pinger:
        def close(self) -> None:
            pass

    monkeypatch.setattr(hot_set, "DailyCounts", _Counts)
    monkeypatch.setattr(job, "connect", lambda *a, **k: Pinger())
    monkeypatch.setattr(job, "verify", lambda *a, **k: None)
    rs = dataclasses.replace(_now_settings(root, ckpts), hot_items=2, hot_users=2)
    with pytest.raises(job.RefreshError) as err:
        job.run_now(rs, KafkaSettings(), RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
    assert err.value.stage == "hot_set" and "stopped by SIGTERM" in str(err.value), str(err.value)
    assert _Counts.reads == ["days"]  # no Redis read after the stop


READS = ["days", "top items", "day counts items", "names items", "top users", "day counts users", "names users"]


def _compute(between: Any) -> hot_set.HotSet:
    cfg = default_config({"device": "single"}, buckets=100, ctx_buckets=5, embedding_dim=4)
    return hot_set.compute(None, "p", 8, cfg, days=1, hot_items=2, hot_users=2, between=between)  # type: ignore[arg-type]


def test_the_hot_set_reads_are_the_ones_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hot_set, "DailyCounts", _Counts)
    _Counts.reads, _Counts.stop_at = [], 0
    _compute(lambda: None)
    assert _Counts.reads == READS


@pytest.mark.parametrize("at", range(1, len(READS)), ids=READS[:-1])
def test_a_stop_kept_pending_in_any_hot_set_read_ends_compute_before_the_next_read(
        monkeypatch: pytest.MonkeyPatch, armed: job.StopSignals, at: int) -> None:
    monkeypatch.setattr(hot_set, "DailyCounts", _Counts)
    _Counts.reads, _Counts.stop_at = [], at
    with pytest.raises(job.RefreshTerminated):
        _compute(armed.check)
    assert _Counts.reads == READS[:at]


class _Markers:
    """A Redis holding the writer markers of versions killed runs left, each delete counted."""

    def __init__(self, versions: list[str]) -> None:
        self.left = set(versions)
        self.deleted: list[str] = []
        self.written: list[str] = []

    def close(self) -> None:
        pass


def test_a_stop_kept_pending_while_a_killed_runs_version_is_deleted_ends_the_cleanup_before_the_next_version(
        monkeypatch: pytest.MonkeyPatch, armed: job.StopSignals) -> None:
    """Before, _delete_abandoned deleted every version killed runs left (a table each) with no stop check between
    them; the pending stop was raised only after the last one (in the write's first chunk)."""
    client = _Markers(["v001", "v002", "v003"])

    def delete_version(c: _Markers, prefix: str, version: str) -> int:
        c.deleted.append(version)
        c.left.discard(version)
        if len(c.deleted) == 1:
            _stop_inside_a_swallowed_error()  # the stop lands in a best-effort except of the delete
        return 1

    monkeypatch.setattr(job, "_redis", lambda rds, rs: client)
    monkeypatch.setattr(stored_versions, "unfinished_versions", lambda c, prefix, owner: set(c.left))
    monkeypatch.setattr(stored_versions, "delete_version", delete_version)
    monkeypatch.setattr(stored_versions, "write_version", lambda c, prefix, version, *a, **k: c.written.append(version))

    class Model:
        version, table = "v004", None

        def non_hot_rows(self) -> Any:
            return []

    with pytest.raises(job.RefreshTerminated):
        job._store_rows(RefreshSettings(), RedisSettings(prefix="p"), Model(),  # type: ignore[arg-type]
                        between=armed.check)
    assert client.deleted == ["v001"]  # the version being deleted finished; not this run's own (never written)
    assert client.written == []
