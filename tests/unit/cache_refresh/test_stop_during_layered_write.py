"""A stop signal to ``streamrec refresh --now`` while the layered run writes its rows to the embedding store
(cache_refresh/job.py ``_store_rows``): the rows written so far must be deleted, as for any other failure of the
write. Since the stop became a ``BaseException`` (b4339ca) the write's ``except Exception`` cleanup no longer saw it,
and half a table stayed in Redis (never served, no meta) until a later layered run found it.

The Redis client is a stand-in here (pure logic: which cleanup runs); the real write and delete are tested against
Redis in tests/integration/test_layered_serving.py."""

from __future__ import annotations

from typing import Any

import pytest

from cache_refresh import job
from cache_refresh.settings import RefreshSettings
from serving import stored_versions
from stream.config import RedisSettings


class _Client:
    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _Model:
    version, table = "v002", None

    def non_hot_rows(self) -> Any:
        return []


def test_a_stop_during_the_layered_write_deletes_the_rows_written_so_far(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _Client()

    def write_then_stopped(c: _Client, prefix: str, version: str, *a: Any, **k: Any) -> Any:
        c.keys.add(f"{prefix}:{version}:row:0")  # part of the table is in Redis when the signal arrives
        raise job.RefreshTerminated("stopped by SIGTERM before it published")

    def delete_version(c: _Client, prefix: str, version: str) -> int:
        gone = {k for k in c.keys if k.startswith(f"{prefix}:{version}:")}
        c.keys -= gone
        return len(gone)

    monkeypatch.setattr(job, "_redis", lambda rds, rs: client)
    monkeypatch.setattr(stored_versions, "unfinished_versions", lambda *a, **k: set())
    monkeypatch.setattr(stored_versions, "write_version", write_then_stopped)
    monkeypatch.setattr(stored_versions, "delete_version", delete_version)
    with pytest.raises(job.RefreshTerminated):
        job._store_rows(RefreshSettings(), RedisSettings(prefix="p"), _Model())  # type: ignore[arg-type]
    assert client.keys == set()  # nothing of the unpublished version is left behind
    assert client.closed


class _DictRedis:
    """Just what write_version and delete_version send to a single Redis node, over a dict."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.msets = 0

    def set(self, key: str, value: Any, nx: bool = False) -> bool | None:
        if nx and key in self.data:
            return None
        self.data[key] = value
        return True

    def get(self, key: str) -> Any:
        return self.data.get(key)

    def mset(self, mapping: dict[str, Any]) -> None:
        self.msets += 1
        self.data.update(mapping)

    def delete(self, *keys: str) -> int:
        return sum(self.data.pop(k, None) is not None for k in keys)

    unlink = delete

    def scan_iter(self, match: str, count: int = 0) -> Any:
        import fnmatch
        return [k for k in list(self.data) if fnmatch.fnmatchcase(k, match)]

    def close(self) -> None:
        pass


def test_a_stop_checked_in_the_layered_write_ends_it_after_the_chunk_being_written_and_deletes_that_version(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, write_version wrote every chunk of the table (20,000 rows an MSET; 500 at 10 M rows) and its meta
    before the run's next stop check: a stop waited for the whole table. Now the run's check comes after each chunk,
    and the stop raised there deletes what was written, as a failed write's rows are."""
    import numpy as np

    client = _DictRedis()
    n = 2 * stored_versions._WRITE_CHUNK + 5  # three chunks

    class Model:
        version, table = "v002", np.zeros((n, 3), np.float32)

        def non_hot_rows(self) -> Any:
            return np.arange(n, dtype=np.int64)

    def stop_at_first_check() -> None:
        raise job.RefreshTerminated("stopped by SIGTERM before it published")

    monkeypatch.setattr(job, "_redis", lambda rds, rs: client)
    with pytest.raises(job.RefreshTerminated):
        job._store_rows(RefreshSettings(), RedisSettings(prefix="p"), Model(),  # type: ignore[arg-type]
                        between=stop_at_first_check)
    assert client.msets == 1  # no chunk written after the stop
    assert client.data == {}  # the chunk written, and the writer marker, are deleted
