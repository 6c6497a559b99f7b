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
from serving import embedding_store
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
    monkeypatch.setattr(embedding_store, "unfinished_versions", lambda *a, **k: set())
    monkeypatch.setattr(embedding_store, "write_version", write_then_stopped)
    monkeypatch.setattr(embedding_store, "delete_version", delete_version)
    with pytest.raises(job.RefreshTerminated):
        job._store_rows(RefreshSettings(), RedisSettings(prefix="p"), _Model())  # type: ignore[arg-type]
    assert client.keys == set()  # nothing of the unpublished version is left behind
    assert client.closed
