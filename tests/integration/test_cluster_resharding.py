"""A real Redis Cluster resharding under streamrec's commands (tests/redis_cluster.py: ``ClusterNodes.begin_move`` /
``finish_move`` move a hash slot between primaries as ``redis-cli --cluster reshard`` does): keys that change nodes
while a command runs are followed (MOVED, ASK) or refused (TRYAGAIN), never lost or left behind."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis
import redis.cluster
from redis.crc import key_slot

from serving import embedding_store, row_codec, stored_versions
from serving.metrics import ServingMetrics
from serving.settings import RowDtype
from stream.config import RedisSettings
from stream.counts import DailyCounts, new_write_id
from stream.counts_keys import DAY_MS, day_of
from stream.history import UserHistory
from stream.redis_client import connect
from stream.strikes import is_infrastructure
from tests.redis_cluster import SLOTS, ClusterNodes
from tests.redis_cluster import redis_cluster as start_cluster


@pytest.fixture
def prefix() -> str:
    return f"r{uuid.uuid4().hex[:10]}"


@contextlib.contextmanager
def cluster_client(nodes: ClusterNodes, prefix: str, **kw: Any) -> Iterator[Any]:
    """A streamrec cluster client of ``nodes`` (``connect``'s keywords), closed after the block."""
    client = connect(RedisSettings(url=nodes.url, prefix=prefix, cluster=True), **kw)
    try:
        yield client
    finally:
        client.close()


def keys_left(client: Any) -> int:
    return sum(n.redis_connection.dbsize() for n in client.get_primaries())


def test_a_version_deleted_while_a_resharding_moves_its_rows_leaves_no_key_on_any_node(
        cluster_nodes: ClusterNodes, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # delete_version found a version's rows by SCAN, one walk per primary: the keys a resharding moved from a node not
    # yet walked to one walked already were never seen, and were left with neither meta nor writer marker, so no prune
    # or cleanup ever found them again (10,000 rows, 200 slots moved mid-delete: ~30 keys left on the cluster).
    with cluster_client(cluster_nodes, prefix, timeout_s=5.0) as client:
        n_rows = 10_000
        table = np.zeros((n_rows, 3), np.float32)  # (N, D + 1)
        stored_versions.write_version(client, prefix, "v1", table, np.arange(n_rows), RowDtype.FLOAT32,
                                     owner="root")
        client.mset_nonatomic(dict.fromkeys(row_codec.overlay_keys(prefix, "v1", np.arange(0, n_rows, 7)), b"x"))
        share = SLOTS // 3 + 1
        # one slot of node 2 half-moved to node 0 for the whole delete: a command on several of its keys gets TRYAGAIN
        per_slot = Counter(key_slot(k.encode()) for k in row_codec.row_keys(prefix, "v1", np.arange(n_rows)))
        split = next(s for s, n in per_slot.items() if n >= 2 and s >= 2 * share)  # (hundreds to choose from)
        cluster_nodes.begin_move(split, 2, 0, keys=1)
        moved: list[int] = []

        def reshard() -> None:  # node 1's first 200 slots to node 0, once, while the delete runs
            if not moved:
                moved.extend(range(share, share + 200))
                for s in moved:
                    cluster_nodes.move(s, 1, 0)

        real_scan, real_unlink = client.scan_iter, client.unlink

        def scan_iter(**kwargs: Any) -> Iterator[Any]:
            for i, key in enumerate(real_scan(**kwargs)):
                if i == 1:  # every primary answered the walk's first SCAN
                    reshard()
                yield key

        def unlink(*keys: Any) -> int:  # the rows' first UNLINK
            reshard()
            return int(real_unlink(*keys))

        monkeypatch.setattr(client, "scan_iter", scan_iter)
        monkeypatch.setattr(client, "unlink", unlink)
        stored_versions.delete_version(client, prefix, "v1", batch=5_000)
        assert moved
        cluster_nodes.finish_move(split, 2, 0)
        assert keys_left(client) == 0


def _retried(call: Any, tries: int = 5) -> Any:
    """``call()`` as the callers retry it (README "Counts and history on Redis Cluster", Resharding): a failure that is
    an outage (redis-py's redirections run out while the nodes' slot tables settle, under load) is tried again, any
    other raised."""
    for left in range(tries - 1, -1, -1):
        try:
            return call()
        except redis.RedisError as exc:
            if not left or not is_infrastructure(exc):
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


def test_history_and_counts_on_a_slot_a_resharding_splits_or_moved_fail_as_outages_and_count_once_when_retried(
        cluster_nodes: ClusterNodes, prefix: str) -> None:
    # README "Counts and history on Redis Cluster", Resharding: never a wrong answer, a failure the callers retry
    with cluster_client(cluster_nodes, prefix, timeout_s=5.0) as client:
        history = UserHistory(client, prefix=prefix, max_len=8)
        by_slot: dict[int, list[int]] = {}
        for u in range(100_000):
            users = by_slot.setdefault(key_slot(history.key(u).encode()), [])
            users.append(u)
            if len(users) == 2:
                break
        slot, (a, b) = next((s, us) for s, us in by_slot.items() if len(us) == 2)
        history.append_many([a, b], [11, 12], [100, 100])
        src = cluster_nodes.index_of(history.key(a))
        cluster_nodes.begin_move(slot, src, (src + 1) % 3, keys=1)  # a's or b's list on the other node now
        with pytest.raises(redis.RedisError) as refused:  # TRYAGAIN until redis-py's redirections run out
            history.as_of([a, b], [1000, 1000])
        assert is_infrastructure(refused.value)
        assert history.as_of([a], [1000]) == [[11]] and history.as_of([b], [1000]) == [[12]]  # one key: ASK
        cluster_nodes.finish_move(slot, src, (src + 1) % 3)
        assert _retried(lambda: history.as_of([a, b], [1000, 1000])) == [[11], [12]]

        counts = DailyCounts(client, prefix=prefix)
        now = int(time.time() * 1000)
        counts.record("item", "impression", [1], [now])
        key = counts.key("item", "impression", day_of(now))
        src = cluster_nodes.index_of(key)
        cluster_nodes.move(key_slot(key.encode()), src, (src + 1) % 3)
        write = new_write_id()
        try:  # MOVED: the MULTI/EXEC ran nothing (redis-py learns the slot's new node from it)
            counts.record("item", "impression", [1], [now], write_id=write)
        except redis.RedisError as exc:
            assert is_infrastructure(exc)
            counts.record("item", "impression", [1], [now], write_id=write)  # the retry, as the joiner's
        assert counts.top("item", k=5) == [("1", 2.0)]


def test_the_days_of_a_kinds_counts_are_all_found_while_a_resharding_moves_its_slot(
        cluster_nodes: ClusterNodes, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # days_available walked every primary with SCAN: the day keys a resharding moved from a primary not walked yet to
    # one walked already were not found (200 days, 40,000 other keys, the item slot's keys moved mid-walk: 13-18
    # days missing each try; in a probe once the latest, which the hot set takes as its window's last day)
    with cluster_client(cluster_nodes, prefix, timeout_s=5.0) as client:
        client.mset_nonatomic({f"{prefix}:other:{i}": b"x" for i in range(40_000)})  # a SCAN of several rounds
        counts = DailyCounts(client, prefix=prefix, ttl_days=400)
        now = int(time.time() * 1000)
        counts.record("item", "impression", [1] * 200, [now - d * DAY_MS for d in range(200)])
        want = counts.days_available("item", "impression")
        assert len(want) == 200
        key = counts.key("item", "impression", want[-1])
        slot, src = key_slot(key.encode()), cluster_nodes.index_of(key)
        cluster_nodes.begin_move(slot, src, (src + 1) % 3)  # the move begun: no key moved yet
        finished: list[bool] = []

        def finish() -> None:
            if not finished:
                finished.append(True)
                cluster_nodes.finish_move(slot, src, (src + 1) % 3)

        real_scan, real_exists = client.scan_iter, client.exists

        def scan_iter(**kwargs: Any) -> Iterator[Any]:
            for i, k in enumerate(real_scan(**kwargs)):
                if i == 1:  # every primary answered the walk's first SCAN
                    finish()
                yield k

        asked: list[Any] = []

        def exists(*keys: Any) -> int:  # a command on the slot: its second finds the move finished
            if asked:
                finish()
            asked.append(keys)
            return int(real_exists(*keys))

        monkeypatch.setattr(client, "scan_iter", scan_iter)
        monkeypatch.setattr(client, "exists", exists)
        assert counts.days_available("item", "impression") == want
        assert finished


def rows_sharing_a_slot(prefix: str) -> tuple[int, np.ndarray, list[str], dict[int, list[int]], int]:
    """A table of more rows than hash slots (N, D + 1), its version v1 keys, the rows of each slot, and a slot holding
    at least two of them (the one a test splits between two nodes mid-move)."""
    n_rows = SLOTS + 1  # more rows than slots: some slot holds two of them
    table = np.arange(n_rows * 3, dtype=np.float32).reshape(n_rows, 3)  # (N, D + 1)
    keys = row_codec.row_keys(prefix, "v1", np.arange(n_rows))
    per_slot: dict[int, list[int]] = {}
    for row, k in enumerate(keys):
        per_slot.setdefault(key_slot(k.encode()), []).append(row)
    return n_rows, table, keys, per_slot, next(s for s, rs in per_slot.items() if len(rs) >= 2)


def stored_rows_sharing_a_slot(client: Any, prefix: str
                               ) -> tuple[np.ndarray, list[str], dict[int, list[int]], int, np.ndarray, dict[str, Any]]:
    """:func:`rows_sharing_a_slot`'s table written as version v1: the split slot's rows and every 701st row besides,
    ``(table, keys, per_slot, slot, rows (M,), the version's meta)``."""
    n_rows, table, keys, per_slot, slot = rows_sharing_a_slot(prefix)
    rows = np.array(per_slot[slot] + [r for r in range(0, n_rows, 701) if r not in per_slot[slot]], np.int64)
    meta = stored_versions.write_version(client, prefix, "v1", table, rows, RowDtype.FLOAT32)
    return table, keys, per_slot, slot, rows, meta


@pytest.fixture(scope="module")
def moving_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterNodes]:
    """One cluster for the tests below, each moving slots of its own (its own prefix: keys of other slots)."""
    with start_cluster(tmp_path_factory.mktemp("moving")) as nodes:
        yield nodes


def test_a_request_whose_rows_live_in_a_slot_a_resharding_split_gets_its_rows_not_fallbacks(
        moving_cluster: ClusterNodes, prefix: str) -> None:
    # a multi-key MGET on a slot split between two nodes mid-move is refused (TRYAGAIN, redis-py's ClusterError once
    # its redirections run out): the whole round trip failed and every request's misses fell back for retry_after_s
    with cluster_client(moving_cluster, prefix, timeout_s=1.0, retries=0) as client:
        table, keys, per_slot, slot, rows, meta = stored_rows_sharing_a_slot(client, prefix)
        src = moving_cluster.index_of(keys[per_slot[slot][0]])
        moving_cluster.begin_move(slot, src, (src + 1) % 3, keys=[keys[per_slot[slot][0]]])  # one row moved
        store = embedding_store.RedisEmbeddingStore(client, prefix, retry_after_s=60.0, cluster=True)
        key = row_codec.tag_key("v1", RowDtype.FLOAT32) if meta.get("row_check") else None
        got, bad = store.fetch("v1", rows, 3, RowDtype.FLOAT32, key)
        assert not bad.any() and store.available and store.last_error is None
        np.testing.assert_array_equal(got, table[rows])
        moving_cluster.finish_move(slot, src, (src + 1) % 3)


def test_a_row_key_of_another_redis_type_in_a_split_slot_falls_back_alone_and_keeps_the_store_in_use(
        moving_cluster: ClusterNodes, prefix: str) -> None:
    # an MGET answers nil for a key of another type (that row alone falls back), but a split slot's rows are read
    # again one GET each, and a GET answers WRONGTYPE: the whole round trip failed and every request's rows fell back
    # for retry_after_s
    with cluster_client(moving_cluster, prefix, timeout_s=1.0, retries=0) as client:
        table, keys, per_slot, slot, rows, meta = stored_rows_sharing_a_slot(client, prefix)
        hashed, moved = per_slot[slot][:2]
        client.delete(keys[hashed])
        client.hset(keys[hashed], "a", "b")  # another client's hash under the row's key
        src, dst = moving_cluster.index_of(keys[moved]), (moving_cluster.index_of(keys[moved]) + 1) % 3
        moving_cluster.begin_move(slot, src, dst)
        with contextlib.closing(redis.Redis(port=moving_cluster.ports[src])) as node:
            moving_cluster._migrate(node, dst, [keys[moved].encode()])  # the hash stays: the slot is split
        store = embedding_store.RedisEmbeddingStore(client, prefix, retry_after_s=60.0, cluster=True)
        key = row_codec.tag_key("v1", RowDtype.FLOAT32) if meta.get("row_check") else None
        got, bad = store.fetch("v1", rows, 3, RowDtype.FLOAT32, key)
        np.testing.assert_array_equal(bad, rows == hashed)
        np.testing.assert_array_equal(got[~bad], table[rows[~bad]])
        assert store.available
        moving_cluster.finish_move(slot, src, dst)


def test_rows_of_a_split_slot_not_read_by_the_fetch_deadline_fall_back_without_redis_py_sleeping_on_tryagain(
        moving_cluster: ClusterNodes, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # redis-py followed the split slot's MGET itself: ASK, TRYAGAIN, ... 16 tries, sleeping 50 ms before each of the
    # last TRYAGAINs (measured: ~0.10 s, two sleeps, for a request whose embedding_store_timeout_s is 0.05 s)
    with cluster_client(moving_cluster, prefix, timeout_s=1.0, retries=0) as client:
        table, keys, per_slot, slot, rows, _ = stored_rows_sharing_a_slot(client, prefix)
        src = moving_cluster.index_of(keys[per_slot[slot][0]])
        moving_cluster.begin_move(slot, src, (src + 1) % 3, keys=[keys[per_slot[slot][0]]])  # one row moved
        sleeps: list[float] = []
        monkeypatch.setattr(redis.cluster.time, "sleep", sleeps.append)
        ticks = iter(range(10**6))  # a clock a second later at every reading: past any deadline once it is set
        metrics = ServingMetrics(lambda: None)
        store = embedding_store.RedisEmbeddingStore(client, prefix, retry_after_s=60.0, cluster=True, timeout_s=0.05,
                                                    clock=lambda: float(next(ticks)), metrics=metrics)
        layered = embedding_store.LayeredRows(store, "v1", np.zeros_like(table), [], None)
        started = time.perf_counter()
        got, failed = layered.gather(rows)
        print(f"gather took {time.perf_counter() - started:.3f} s")  # a diagnostic, not asserted
        assert sleeps == []
        split = np.isin(rows, per_slot[slot])
        np.testing.assert_array_equal(failed, split)  # those fall back (model.py counts them), the rest read
        np.testing.assert_array_equal(got[~split], table[rows[~split]])
        assert store.available and metrics.embedding_store_errors._value.get() == 1
        assert not any(r in layered.cache for r in rows[split])  # not cached: read from Redis once the move ends
        moving_cluster.finish_move(slot, src, (src + 1) % 3)


def test_a_fetch_with_rows_late_at_a_split_slot_and_a_missing_row_is_one_error_of_one_round_trip(
        moving_cluster: ClusterNodes, prefix: str) -> None:
    # late rows (a split slot past the deadline) and a missing key in one fetch each counted an error: one round trip
    # read as two in errors_total ("failed round trips, round trips with bad rows"; late_rows: "once per fetch")
    with cluster_client(moving_cluster, prefix, timeout_s=1.0, retries=0) as client:
        n_rows, table, keys, per_slot, slot = rows_sharing_a_slot(prefix)
        gone = next(r for r in range(0, n_rows, 701) if r not in per_slot[slot])  # its key deleted: missing
        rows = np.array(per_slot[slot] + [gone], np.int64)
        stored_versions.write_version(client, prefix, "v1", table, rows, RowDtype.FLOAT32)
        client.delete(keys[gone])
        src = moving_cluster.index_of(keys[per_slot[slot][0]])
        moving_cluster.begin_move(slot, src, (src + 1) % 3, keys=[keys[per_slot[slot][0]]])  # one row moved
        ticks = iter(range(10**6))  # a clock a second later at every reading: past any deadline once it is set
        metrics = ServingMetrics(lambda: None)
        store = embedding_store.RedisEmbeddingStore(client, prefix, retry_after_s=60.0, cluster=True, timeout_s=0.05,
                                                    clock=lambda: float(next(ticks)), metrics=metrics)
        _, bad = store.fetch("v1", rows, 3, RowDtype.FLOAT32)
        assert bad.all()  # the split slot's rows late, the other missing: all fall back
        assert metrics.embedding_store_errors._value.get() == 1
        moving_cluster.finish_move(slot, src, (src + 1) % 3)


def test_a_cluster_row_read_routes_each_slots_mget_itself_as_mget_nonatomic_does(
        moving_cluster: ClusterNodes, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the store's per-slot MGETs named no node: redis-py found every key's slot again to route each (MGET is split by
    # slot client-side), about 1 ms more than mget_nonatomic for a request of 300 rows. Same values, same order
    with cluster_client(moving_cluster, prefix, timeout_s=5.0) as client:
        keys = list(row_codec.row_keys(prefix, "v1", np.arange(300)))
        client.mset_nonatomic({k: k.encode() for k in keys[::2]})  # every other row missing
        keys += keys[:10]  # (a duplicate reads the same)
        store = embedding_store.RedisEmbeddingStore(client, prefix, cluster=True)
        found: list[Any] = []
        keyslot = redis.RedisCluster.keyslot  # (its pipeline's too)
        monkeypatch.setattr(redis.RedisCluster, "keyslot", lambda self, key: found.append(key) or keyslot(self, key))
        assert store._mget(keys) == [k.encode() if i % 2 == 0 else None
                                     for i, k in enumerate(keys[:300] + keys[:10])]
        client.mget_nonatomic(keys)
        assert found == []  # as mget_nonatomic: each slot's MGET is sent to its node, no key's slot found again
        assert store._mget([]) == []


def test_the_first_counts_write_after_its_kinds_slot_moved_succeeds_at_once_and_counts_once(
        moving_cluster: ClusterNodes, prefix: str) -> None:
    # the MULTI/EXEC went to the slot's old node, which refused its commands with MOVED (EXECABORT: nothing ran) and
    # the write failed: the joiner rewound its whole batch and waited >= 1 s, serving's lookup counts logged a failed
    # flush. It is sent again once, at once, under the same write id.
    with cluster_client(moving_cluster, prefix, timeout_s=5.0) as client:
        counts = DailyCounts(client, prefix=prefix)
        now = int(time.time() * 1000)
        counts.record("user", "click", [7], [now])
        key = counts.key("user", "click", day_of(now))
        src = moving_cluster.index_of(key)
        moving_cluster.move(key_slot(key.encode()), src, (src + 1) % 3)
        counts.record("user", "click", [7, 8], [now, now], write_id=new_write_id())
        assert counts.top("user", k=5, event="click") == [("7", 2.0), ("8", 1.0)]


def test_a_counts_write_to_a_slot_migrating_with_its_keys_moved_succeeds_once_on_the_importing_node(
        cluster_nodes: ClusterNodes, prefix: str) -> None:
    # the source answered ASK to the MULTI/EXEC's commands; the one retry went to the importing node without ASKING,
    # which answered MOVED back: every counts write to the kind's slot failed until the migration ended
    with cluster_client(cluster_nodes, prefix, timeout_s=5.0) as client:
        counts = DailyCounts(client, prefix=prefix)
        now = int(time.time() * 1000)
        counts.record("user", "click", [7], [now], names={7: "u7"})  # the counts, names and markers keys
        key = counts.key("user", "click", day_of(now))
        slot, src = key_slot(key.encode()), cluster_nodes.index_of(key)
        cluster_nodes.begin_move(slot, src, (src + 1) % 3, keys=100)  # all of the slot's keys on the target now
        counts.record("user", "click", [7, 8], [now, now], names={8: "u8"}, write_id=new_write_id())
        cluster_nodes.finish_move(slot, src, (src + 1) % 3)
        assert counts.top("user", k=5, event="click") == [("7", 2.0), ("8", 1.0)]
        assert counts.names("user", ["7", "8"], day_of(now)) == {"7": "u7", "8": "u8"}


def test_a_counts_write_to_a_slot_whose_keys_a_migration_split_fails_as_an_outage_and_counts_once_when_retried(
        cluster_nodes: ClusterNodes, prefix: str) -> None:
    # some of the script's keys on each node: the importing node, asked with ASKING, refuses them (TRYAGAIN)
    with cluster_client(cluster_nodes, prefix, timeout_s=5.0) as client:
        counts = DailyCounts(client, prefix=prefix)
        now = int(time.time() * 1000)
        counts.record("user", "click", [7], [now], names={7: "u7"})
        key = counts.key("user", "click", day_of(now))
        slot, src = key_slot(key.encode()), cluster_nodes.index_of(key)
        cluster_nodes.begin_move(slot, src, (src + 1) % 3, keys=1)  # one of its three keys on the target
        write = new_write_id()
        with pytest.raises(redis.RedisError) as refused:
            counts.record("user", "click", [7, 8], [now, now], write_id=write)
        assert is_infrastructure(refused.value)
        cluster_nodes.finish_move(slot, src, (src + 1) % 3)
        counts.record("user", "click", [7, 8], [now, now], write_id=write)  # the retry, as the joiner's
        assert counts.top("user", k=5, event="click") == [("7", 2.0), ("8", 1.0)]
