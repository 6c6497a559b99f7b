"""The layered run's cleanup after a failed ``_store_rows`` (cache_refresh/job.py) deletes this run's own version only
when something of it may be in Redis: its write (``stored_versions.write_version``) began, so its writer marker may be
set. A stop raised in the cleanup of killed runs' versions, before the write began, ran ``delete_version`` of the
never-written version anyway: a keyspace SCAN for nothing (minutes on a large store) in a run being stopped.

The Redis is a dict stand-in (which commands are sent: SCANs counted); the real write and delete are tested against
Redis in tests/integration/test_layered_serving.py."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import redis

from cache_refresh import job, stored_rows
from cache_refresh.settings import RefreshSettings
from serving import row_codec, stored_versions
from stream.config import RedisSettings
from tests.unit.cache_refresh.test_stop_during_layered_write import _DictRedis

PREFIX = "p"
N = stored_versions._WRITE_CHUNK + 5  # two chunks


class _Counted(_DictRedis):
    """The dict Redis, with every SCAN's pattern kept."""

    def __init__(self) -> None:
        super().__init__()
        self.scans: list[str] = []

    def scan_iter(self, match: str, count: int = 0) -> Any:
        self.scans.append(match)
        return super().scan_iter(match, count)

    def exists(self, *keys: str) -> int:
        return sum(k in self.data for k in keys)


class _Model:
    version, table = "v004", np.zeros((N, 3), np.float32)

    def non_hot_rows(self) -> Any:
        return np.arange(N, dtype=np.int64)


def _with_killed_runs_version(monkeypatch: pytest.MonkeyPatch) -> tuple[_Counted, RefreshSettings]:
    """A Redis holding the writer marker of a version (v001) a killed run of this publish root began to write."""
    rs = RefreshSettings()
    client = _Counted()
    client.set(row_codec.writer_key(PREFIX, "v001"), json.dumps({"owner": stored_rows._owner(rs)}))
    monkeypatch.setattr(job, "_redis", lambda rds, rs: client)
    return client, rs


def _stop_at_check(n: int) -> Any:
    calls: list[int] = []

    def between() -> None:
        calls.append(1)
        if len(calls) == n:
            raise job.RefreshTerminated("stopped by SIGTERM before it published")
    return between


def _own_scans(client: _Counted) -> list[str]:
    return [m for m in client.scans if "v004" in m]


def test_a_stop_in_the_killed_runs_cleanup_before_the_write_sends_no_delete_of_the_never_written_version(
        monkeypatch: pytest.MonkeyPatch) -> None:
    client, rs = _with_killed_runs_version(monkeypatch)
    with pytest.raises(job.RefreshTerminated):  # the check after v001's delete: before anything of v004 is written
        job._store_rows(rs, RedisSettings(prefix=PREFIX), _Model(), between=_stop_at_check(1))  # type: ignore[arg-type]
    assert client.msets == 0 and client.data == {}  # v001 deleted, nothing of v004 written
    assert _own_scans(client) == []  # no SCAN for v004's rows
    assert len(client.scans) == 2  # the search for killed runs' versions, v001's delete


def test_a_stop_after_the_first_chunk_of_the_write_deletes_that_version(monkeypatch: pytest.MonkeyPatch) -> None:
    client, rs = _with_killed_runs_version(monkeypatch)
    with pytest.raises(job.RefreshTerminated):  # the check after v001's delete passes; the one after chunk 1 stops
        job._store_rows(rs, RedisSettings(prefix=PREFIX), _Model(), between=_stop_at_check(2))  # type: ignore[arg-type]
    assert client.msets == 1
    assert client.data == {}  # the chunk written and v004's writer marker are deleted
    assert len(_own_scans(client)) == 1


def test_a_write_whose_writer_marker_command_failed_still_deletes_that_version(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A timeout on the marker's SET may come after Redis applied it: the version may be there, so it is deleted."""
    client, rs = _with_killed_runs_version(monkeypatch)
    plain_set = client.set

    def set_then_time_out(key: str, value: Any, **kw: Any) -> None:
        plain_set(key, value, **kw)
        if "v004" in key:
            raise redis.TimeoutError("Timeout reading from socket")

    monkeypatch.setattr(client, "set", set_then_time_out)
    with pytest.raises(job.RefreshError):
        job._store_rows(rs, RedisSettings(prefix=PREFIX), _Model())  # type: ignore[arg-type]
    assert client.data == {}  # v004's marker deleted
    assert len(_own_scans(client)) == 1


def test_a_writer_marker_refused_by_redis_sends_no_delete_of_the_never_written_version(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis answered the marker's SET with an error (OOM at maxmemory, NOPERM): it applied nothing, and no row is
    written after a refused marker, so nothing of the version is there. Before, the cleanup SCANned the keyspace for
    its rows (minutes on a large store, every run while the ACL or the memory limit lasts)."""
    client, rs = _with_killed_runs_version(monkeypatch)
    plain_set = client.set

    def refuse_v004(key: str, value: Any, **kw: Any) -> None:
        if "v004" in key:
            raise redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'.")
        plain_set(key, value, **kw)

    monkeypatch.setattr(client, "set", refuse_v004)
    with pytest.raises(job.RefreshError, match="OOM"):
        job._store_rows(rs, RedisSettings(prefix=PREFIX), _Model())  # type: ignore[arg-type]
    assert client.msets == 0 and client.data == {}
    assert _own_scans(client) == []


def test_a_chunk_refused_by_redis_after_the_marker_still_deletes_that_version(monkeypatch: pytest.MonkeyPatch) -> None:
    client, rs = _with_killed_runs_version(monkeypatch)
    plain_mset = client.mset

    def second_refused(mapping: dict[str, Any]) -> None:
        if client.msets == 1:
            raise redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'.")
        plain_mset(mapping)

    monkeypatch.setattr(client, "mset", second_refused)
    with pytest.raises(job.RefreshError, match="OOM"):
        job._store_rows(rs, RedisSettings(prefix=PREFIX), _Model())  # type: ignore[arg-type]
    assert client.msets == 1 and client.data == {}  # the first chunk and the marker deleted
    assert len(_own_scans(client)) == 1
