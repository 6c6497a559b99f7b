"""Counts, history, strikes and pub/sub on a real Redis Cluster (``[redis] cluster = true``): the same results as on
a single node, each script call and MULTI/EXEC in one hash slot (one kind's counts in one slot, users' histories
spread over the nodes), the nightly hot set built from a cluster's counts, and a delta notification published
through the cluster reaching a subscriber. The cluster is three real primaries (tests/redis_cluster.py); the single
node is the session's Redis."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from cache_refresh import hot_set
from learner.delta_writer import redis_notifier
from learner.features import FeatureConfig, FieldSpec
from stream import redis_client
from stream.config import RedisSettings
from stream.counts import DailyCounts
from stream.counts_keys import DAY_MS, day_of
from stream.history import ENTRY_MAX_BYTES, UserHistory
from stream.redis_client import connect, is_cluster, wait_until_up
from stream.strikes import RedisStrikes, is_infrastructure
from streamrec.stack import LocalStack, redis_binary
from tests import redis_cluster as rc
from tests.bounded_teardown import Reaper
from tests.trickle_proxy import TrickleProxy

CFG = FeatureConfig((FieldSpec("user_id", "single", 50), FieldSpec("item_id", "single", 40)), embedding_dim=4)


def ms(y: int, mo: int, d: int, h: int = 0) -> int:
    return int(dt.datetime(y, mo, d, h, tzinfo=dt.timezone.utc).timestamp()) * 1000


@pytest.fixture
def prefix() -> str:
    return f"c{uuid.uuid4().hex[:10]}"


@pytest.fixture
def clients(redis_cluster: str, stack: LocalStack, prefix: str) -> Iterator[tuple[Any, redis.Redis]]:
    """(a cluster client as connect() builds it for [redis] cluster = true, a single node's client)."""
    cluster = connect(RedisSettings(url=redis_cluster, prefix=prefix, cluster=True), timeout_s=5.0)
    single = connect(RedisSettings(url=stack.redis_url, prefix=prefix), timeout_s=5.0)
    try:
        yield cluster, single
    finally:
        for key in single.scan_iter(match=f"{prefix}:*"):
            single.delete(key)
        cluster.close()
        single.close()


def node_of(client: Any, key: str) -> str:
    return str(client.get_node_from_key(key).name)


def write_counts(counts: DailyCounts) -> None:
    """Three days of impressions and clicks with names, and serving's pre-aggregated lookups in several chunks."""
    days = [ms(2001, 3, 1, 5), ms(2001, 3, 2, 23), ms(2001, 3, 3)]
    ids = [1, 2, 2, 3, 3, 3, 4, 5, 5, 1]
    ts = [days[i % 3] for i in range(len(ids))]
    counts.record("item", "impression", ids, ts, names={i: f"item-{i}" for i in ids})
    counts.record("user", "impression", ["u1", "u2", "u2"], ts[:3], names={"u1": "alice", "u2": "bob"})
    counts.record("item", "click", [3, 5], [days[0], days[2]])
    counts.add_counts("item", "lookup", np.arange(10, 40, dtype=np.int64), np.arange(1, 31, dtype=np.int64),
                      days[2] // DAY_MS, chunk=7)


def read_counts(counts: DailyCounts) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("item", "user"):
        for event in ("impression", "click", "lookup"):
            out[f"{kind} {event} days"] = counts.days_available(kind, event)
            out[f"{kind} {event} top"] = counts.top(kind, event, k=20) if out[f"{kind} {event} days"] else []
            out[f"{kind} {event} top3"] = counts.top(kind, event, day="20010303", days=3, k=20)
    out["item names"] = counts.names("item", ["1", "2", "3", "4", "5", "99"], day="20010303", days=3)
    out["user names"] = counts.names("user", ["u1", "u2"], day="20010303", days=3)
    return out


def test_counts_on_a_cluster_equal_a_single_nodes_and_each_write_stays_in_its_kinds_slot(
        clients: tuple[Any, redis.Redis], prefix: str) -> None:
    cluster, single = clients
    assert is_cluster(cluster) and not is_cluster(single)
    on_cluster, on_node = DailyCounts(cluster, prefix=prefix), DailyCounts(single, prefix=prefix)
    write_counts(on_cluster)
    write_counts(on_node)
    got = read_counts(on_cluster)
    assert got == read_counts(on_node)
    assert got["item impression days"] == ["20010301", "20010302", "20010303"]
    assert got["item impression top3"][0] == ("3", 3.0) and got["item names"]["3"] == "item-3"
    assert "99" not in got["item names"] and got["user names"] == {"u1": "alice", "u2": "bob"}
    # one kind's keys (every event, day and its names) share one slot: record()'s MULTI/EXEC needs it
    for kind in ("item", "user"):
        keys = [on_cluster.key(kind, e, d) for e in ("impression", "click", "lookup")
                for d in ("20010301", "20010302", "20010303")] + [on_cluster.names_key(kind, "20010301")]
        assert len({key_slot(k.encode()) for k in keys}) == 1
        assert all(k.startswith(f"{prefix}:") for k in keys)  # the ACLs grant ~{prefix}:*
    # the temporary union keys are gone from every node
    assert not [k for k in cluster.scan_iter(match=f"{prefix}:*tmp*")]


def test_counts_recover_from_a_cluster_that_forgot_the_script(clients: tuple[Any, redis.Redis], prefix: str) -> None:
    # redis-py's cluster pipeline sends EVALSHA without loading the script; a node whose script cache was flushed
    # (restart, failover) answers NOSCRIPT, and the write must load it and go through, once.
    cluster, _ = clients
    counts = DailyCounts(cluster, prefix=prefix)
    now_ms = int(time.time() * 1000)
    counts.record("item", "impression", [1, 2], [now_ms - DAY_MS, now_ms])
    cluster.script_flush()
    counts.record("item", "impression", [1, 2], [now_ms - DAY_MS, now_ms])
    assert counts.top("item", days=2, k=5) == [("2", 2.0), ("1", 2.0)]


def test_history_on_a_cluster_equals_a_single_nodes_and_spreads_users_over_the_nodes(
        clients: tuple[Any, redis.Redis], prefix: str) -> None:
    cluster, single = clients
    rng = np.random.default_rng(0)
    users, items = rng.integers(0, 300, 2000), rng.integers(-2**40, 2**40, 2000)
    times = rng.integers(1_000_000, 2_000_000, 2000)
    on_cluster = UserHistory(cluster, prefix=prefix, max_len=8)
    on_node = UserHistory(single, prefix=prefix, max_len=8)
    for h in (on_cluster, on_node):
        for part in range(0, 2000, 500):  # batches, as the joiner appends them
            h.append_many(users[part:part + 500], items[part:part + 500], times[part:part + 500])
    asked_users, asked_ts = rng.integers(0, 320, 1000), rng.integers(1_000_000, 2_100_000, 1000)  # unknown users too
    assert on_cluster.as_of(asked_users, asked_ts) == on_node.as_of(asked_users, asked_ts)
    flat_c, off_c = on_cluster.as_of_flat(asked_users, asked_ts, limit=3)
    flat_n, off_n = on_node.as_of_flat(asked_users, asked_ts, limit=3)
    assert np.array_equal(flat_c, flat_n) and np.array_equal(off_c, off_n)
    assert on_cluster.as_of_later([7, 8], [2**41, 2**41])() == on_node.as_of_later([7, 8], [2**41, 2**41])()
    assert on_cluster.recent(5) == on_node.recent(5) != []
    # a huge entry (another client's) is sent back as one malformed entry by every slot's script call, as on a node
    for client, h in ((cluster, on_cluster), (single, on_node)):
        client.lpush(h.key(7), b"1:" + b"5" * 2_000_000)
    assert on_cluster.as_of_later([7, 8], [2**41, 2**41])() == on_node.as_of_later([7, 8], [2**41, 2**41])()
    stored = on_cluster._lrange(list(dict.fromkeys([int(u) for u in users[:500] if u != 7] + [7])))  # many slots
    assert stored[-1][0] == b"!toolong" and max(len(e) for got in stored for e in got) <= ENTRY_MAX_BYTES
    # one batch's users live on every node (a key per user, no hash tag)
    assert len({node_of(cluster, on_cluster.key(int(u))) for u in users[:500]}) == 3
    # a key of the wrong type fails its own append only, as on a single node
    cluster.set(on_cluster.key(9999), "not a list")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        on_cluster.append_many([9999, 5000], [1, 2], [3, 4])
    assert on_cluster.recent(5000) == [2]


def test_a_batch_appended_again_on_a_cluster_is_stored_once_as_on_a_single_node(
        clients: tuple[Any, redis.Redis], prefix: str) -> None:
    """A joiner batch done again appends its clicks again; on a cluster (a script call per hash slot) as on a single
    node, the copies are not pushed, so the users' older clicks stay in their lists."""
    cluster, _ = clients
    hist = UserHistory(cluster, prefix=prefix, max_len=4)
    users = list(range(60))
    hist.append_many(users * 3, users * 3, [1] * 60 + [2] * 60 + [3] * 60)  # each user's item u at 1, 2 and 3
    batch = (users, [u + 1000 for u in users], [4] * 60)
    for _ in range(3):
        hist.append_many(*batch)
    assert len({node_of(cluster, hist.key(u)) for u in users}) == 3
    assert hist.as_of(users, [10] * 60) == [[u, u, u, u + 1000] for u in users]
    assert {cluster.llen(hist.key(u)) for u in users} == {4}


def test_history_appends_on_a_cluster_expire_every_users_list_ttl_days_from_now(
        clients: tuple[Any, redis.Redis], prefix: str) -> None:
    """The script call of each hash slot sets its own keys' expiry, as on a single node (used to be none: -1)."""
    cluster, _ = clients
    hist = UserHistory(cluster, prefix=prefix, max_len=8, ttl_days=2)
    users = list(range(300))
    hist.append_many(users, [u + 1 for u in users], [ms(2000, 1, 1)] * len(users))
    assert len({node_of(cluster, hist.key(u)) for u in users}) == 3  # several slots on every node
    ttls = [cluster.ttl(hist.key(u)) for u in users]
    assert all(2 * 86_400 - 60 < t <= 2 * 86_400 for t in ttls), sorted(set(ttls))[:5]
    UserHistory(cluster, prefix=prefix, max_len=8, ttl_days=0).append_many(users, users, [1] * len(users))
    assert {cluster.ttl(hist.key(u)) for u in users} == {-1}


def _one_node_via(monkeypatch: pytest.MonkeyPatch, cluster_nodes: Any, slow: int, proxy: TrickleProxy) -> Any:
    """:func:`connect`'s cluster client as the joiner's and the refresh's (whole-reply, 1 s, no retries), node ``slow``
    reached through ``proxy``: redis-py's ``address_remap`` (the cluster's own replies name the node's real port)."""
    via = ("127.0.0.1", int(proxy.url.rsplit(":", 1)[1].split("/")[0]))

    class Remapped(RedisCluster):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, address_remap=lambda a: via if a[1] == cluster_nodes.ports[slow] else a, **kwargs)

    monkeypatch.setattr(redis_client, "RedisCluster", Remapped)
    return connect(RedisSettings(url=cluster_nodes.url, cluster=True), timeout_s=1.0, retries=0, whole_reply=True)


def test_a_history_read_on_a_cluster_with_a_trickling_node_fails_as_a_timeout_not_one_timeout_per_hash_slot(
        cluster_nodes: Any, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's history read is a script call per hash slot, pipelined, one batch of replies per node. One node's
    replies trickle (``tests/trickle_proxy.py`` in front of it) a byte per 20 ms: each slot's reply (8 bytes) arrives
    well within the whole-reply timeout, the node's 40 in ~6 of it. The read fails once the timeout has passed, as a
    timeout (the joiner's batch then rewinds). Bounded reply by reply the trickle held the batch one timeout per slot
    of that node, and the read succeeded."""
    slow = 1
    with TrickleProxy(cluster_nodes.ports[slow]) as proxy:
        cluster = _one_node_via(monkeypatch, cluster_nodes, slow, proxy)
        try:
            hist = UserHistory(cluster, prefix=prefix)
            slots: dict[int, int] = {}  # slot -> a user whose list is there, on the slow node
            for u in range(100_000):
                if len(slots) < 40 and cluster_nodes.index_of(hist.key(u)) == slow:
                    slots.setdefault(key_slot(hist.key(u).encode()), u)
            users = list(slots.values())
            assert hist.as_of(users, [1] * len(users)) == [[] for _ in users]  # healthy: the script loaded
            proxy.trickling = True
            with pytest.raises(redis.TimeoutError) as failed:
                hist.as_of(users, [1] * len(users))
            assert is_infrastructure(failed.value)  # the joiner's rewind and retry
        finally:
            proxy.trickling = False
            cluster.close()


def test_a_trickling_nodes_timeout_on_a_cluster_fails_as_that_nodes_timeout_not_as_a_cluster_that_cannot_be_reached(
        cluster_nodes: Any, prefix: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A day window's names (8 HMGETs, one node: the kind's hash slot) are one round trip of the client's timeout. The
    node holding them trickles its replies a byte per 20 ms (each in ~0.2 s, the 8 in ~1.5 timeouts): the read fails
    as a timeout naming the node it reached. redis-py then refreshes the topology inside the command that timed out;
    within the spent deadline every node's CLUSTER SLOTS failed at once, the refresh reached no node, and the timeout
    surfaced as ClusterUnavailable ("Redis Cluster cannot be connected": every node, to an operator). The refresh now
    reads outside the deadline (no failed refresh logged) and the healthy nodes serve the next command."""
    counts = DailyCounts(redis.Redis(), prefix=prefix)  # only for its keys
    slow = cluster_nodes.index_of(counts.names_key("item", "20030228"))
    healthy_key = next(f"{prefix}:{i}" for i in range(1000) if cluster_nodes.index_of(f"{prefix}:{i}") != slow)
    with TrickleProxy(cluster_nodes.ports[slow]) as proxy:
        cluster = _one_node_via(monkeypatch, cluster_nodes, slow, proxy)
        try:
            counts = DailyCounts(cluster, prefix=prefix)
            assert counts.names("item", ["123"], "20030228", days=7) == {}  # healthy: connected to the node
            proxy.trickling = True
            with caplog.at_level(logging.ERROR, logger="redis.cluster"), pytest.raises(redis.RedisError) as failed:
                counts.names("item", ["123"], "20030228", days=7)
            proxy.trickling = False
            assert type(failed.value) is redis.TimeoutError, repr(failed.value)
            assert str(failed.value) == f"Timeout reading from {proxy.url.split('/')[2]}"
            assert "Topology refresh failed" not in caplog.text
            assert cluster.set(healthy_key, "1") and cluster.get(healthy_key) == b"1"
        finally:
            proxy.trickling = False
            cluster.close()


def test_strikes_on_a_cluster_round_trip(clients: tuple[Any, redis.Redis], prefix: str) -> None:
    cluster, _ = clients
    store = RedisStrikes(cluster, f"{prefix}:strikes:g")
    store.save({("t", 0, 5): (2, "boom")}, [])
    assert store.load() == {("t", 0, 5): (2, "boom")}
    store.save({}, [("t", 0, 5)])
    assert store.load() == {}


def test_the_hot_set_from_a_clusters_counts_equals_the_one_from_a_single_nodes(
        clients: tuple[Any, redis.Redis], prefix: str) -> None:
    cluster, single = clients
    now_ms = int(time.time() * 1000)
    for client in (cluster, single):
        counts = DailyCounts(client, prefix=prefix)
        counts.record("item", "impression", [1000 + k for k in range(30) for _ in range(30 - k)],
                      [now_ms - (k % 2) * DAY_MS for k in range(30) for _ in range(30 - k)])
        counts.record("user", "impression", [2000 + k for k in range(20) for _ in range(20 - k)],
                      [now_ms] * sum(range(1, 21)))
    got = [hot_set.compute(c, prefix, 8, CFG, days=2, hot_items=5, hot_users=3, event="impression",
                           sleep=lambda s: None) for c in (cluster, single)]
    assert np.array_equal(got[0].rows, got[1].rows) and len(got[0].rows) > 0
    assert got[0].stats == got[1].stats and got[0].stats["items"] == 5


def test_a_delta_notification_published_through_the_cluster_reaches_a_subscriber_on_another_node(
        redis_cluster: str, prefix: str) -> None:
    rds = RedisSettings(url=redis_cluster, prefix=prefix, cluster=True)
    listener = connect(rds, connect_timeout_s=2.0)
    sub = listener.pubsub(ignore_subscribe_messages=True)
    try:
        sub.subscribe(rds.deltas_channel)
        sub.get_message(timeout=0.5)  # the subscription is made
        notify = redis_notifier(rds, rds.deltas_channel)
        deadline, msg = time.monotonic() + 10, None
        while msg is None and time.monotonic() < deadline:
            notify(42)
            msg = sub.get_message(timeout=0.2)
        assert msg is not None and msg["data"] == b"42"
    finally:
        sub.close()
        listener.close()


def test_redis_cluster_setting_from_the_environment_makes_every_client_a_cluster_client(redis_cluster: str,
                                                                                       prefix: str) -> None:
    from stream.errors import ConfigError
    from streamrec.settings import build

    rds = build(RedisSettings, "redis", environ={"STREAMREC_REDIS_URL": redis_cluster, "STREAMREC_REDIS_CLUSTER": "1",
                                                "STREAMREC_REDIS_PREFIX": prefix})
    assert rds.cluster and not RedisSettings(url=redis_cluster).cluster
    assert RedisSettings(url=redis_cluster).clustered(True) == RedisSettings(url=redis_cluster, cluster=True)
    client = connect(rds, timeout_s=5.0, check=True)
    try:
        assert is_cluster(client)
        DailyCounts(client, prefix=prefix).record("user", "click", [1, 2, 2], [int(time.time() * 1000)] * 3)
        assert DailyCounts(client, prefix=prefix).top("user", "click", k=2) == [("2", 2.0), ("1", 1.0)]
    finally:
        client.close()
    with pytest.raises(ConfigError, match="database 0 only"):
        RedisSettings(url=redis_cluster.replace("/0", "/3"), cluster=True)
    with pytest.raises(ConfigError, match="over TCP"):
        RedisSettings(url="unix:///tmp/redis.sock", cluster=True)


# -- a cluster that cannot serve: every failure a redis.ConnectionError (stream.redis_client.ClusterUnavailable) ---
def failures_until_unreachable(call: Any, tries: int = 100) -> list[BaseException]:
    """``call()``'s failures while every node is down, until one comes from redis-py's ``RedisClusterUnreachableError``
    (a topology refresh found no node; the first failures are plain connection errors); fails after ``tries``."""
    seen: list[BaseException] = []
    for _ in range(tries):
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - collected, checked by the caller
            seen.append(exc)
            if "RedisClusterUnreachableError" in f"{type(exc).__name__} {exc}":
                return seen
        time.sleep(0.1)
    raise AssertionError(f"no RedisClusterUnreachableError after {tries} tries: {seen[-3:]}")


def test_a_cluster_with_every_node_down_fails_commands_pipelines_scripts_and_pubsub_with_connection_errors(
        cluster_nodes: Any, prefix: str) -> None:
    from stream.redis_client import ClusterUnavailable

    rds = RedisSettings(url=cluster_nodes.url, prefix=prefix, cluster=True)
    client = connect(rds, timeout_s=1.0, retries=0)
    try:
        history = UserHistory(client, prefix=prefix, max_len=8)
        history.append_many([1, 2, 3], [10, 20, 30], [100, 200, 300])
        cluster_nodes.stop_all()

        def pipeline() -> None:
            pipe = client.pipeline(transaction=False)
            for u in range(20):
                pipe.get(history.key(u))
            pipe.execute()

        for call in (lambda: client.get(history.key(1)), pipeline,
                     lambda: history.append_many([1, 2, 3], [10, 20, 30], [100, 200, 300]),
                     lambda: history.as_of([1, 2, 3], [10**6] * 3), lambda: client.publish(rds.deltas_channel, "1")):
            seen = failures_until_unreachable(call)
            assert all(isinstance(e, redis.ConnectionError) for e in seen), [type(e) for e in seen]
            assert isinstance(seen[-1], ClusterUnavailable)
        cluster_nodes.start_all()
        history.append_many([1], [11], [400])  # the same client works again
        assert history.recent(1) == [11]
    finally:
        client.close()


def test_the_refreshs_counts_read_is_retried_through_a_clusterdown_and_answers_once_the_node_is_back(
        cluster_nodes: Any, prefix: str) -> None:
    # A primary with no replica fails: once the others mark it failed every node answers CLUSTERDOWN (a ResponseError
    # to redis-py) also for the counts they hold. The refresh's retries (hot_set.with_retries, around every read of
    # the hot set) must wait it out as they wait out a Redis that is down.
    client = connect(RedisSettings(url=cluster_nodes.url, prefix=prefix, cluster=True), timeout_s=2.0)
    try:
        counts = DailyCounts(client, prefix=prefix)
        now_ms = int(time.time() * 1000)
        counts.record("item", "impression", [1000 + k for k in range(10) for _ in range(10 - k)], [now_ms] * 55)
        day = counts.days_available("item", "impression")[-1]
        want = counts.top("item", "impression", day=day, days=1, k=5)
        idle = next(k for k in range(3) if k != cluster_nodes.index_of(counts.key("item", "impression", day)))
        cluster_nodes.stop(idle)  # a node without the counts: its restart loses none
        cluster_nodes.wait_down()
        waits: list[float] = []

        def sleep(s: float) -> None:
            waits.append(s)
            if len(waits) == 1:
                cluster_nodes.start(idle)

        got = hot_set.with_retries("top items", lambda: counts.top("item", "impression", day=day, days=1, k=5),
                                   attempts=3, backoff_s=0.0, sleep=sleep)
        assert waits and got == want
    finally:
        client.close()


def test_the_hot_set_of_a_cluster_with_every_node_down_fails_as_redis_unavailable_after_its_retries(
        cluster_nodes: Any, prefix: str) -> None:
    client = connect(RedisSettings(url=cluster_nodes.url, prefix=prefix, cluster=True), timeout_s=1.0)
    try:
        DailyCounts(client, prefix=prefix).record("item", "impression", [1, 2], [int(time.time() * 1000)] * 2)
        cluster_nodes.stop_all()
        waits: list[float] = []

        def sleep(s: float) -> None:
            waits.append(s)
            time.sleep(s)  # redis-py paces its topology refreshes: the later attempts see it give up

        with pytest.raises(hot_set.RedisUnavailable, match="unreachable after 5 attempt") as err:
            hot_set.compute(client, prefix, 8, CFG, days=2, hot_items=5, hot_users=3, event="impression",
                            attempts=5, backoff_s=0.4, sleep=sleep)
        assert len(waits) == 4 and "RedisClusterUnreachableError" in str(err.value)
    finally:
        client.close()


def test_days_on_a_cluster_are_only_this_prefixs_not_those_of_another_prefix_of_the_same_length(
        clients: tuple[Any, redis.Redis], prefix: str) -> None:
    # Every prefix's counts of a kind share its {item}/{user} hash slot, which the cluster read lists whole: a second
    # deployment on the same cluster (prefix of the same length, e.g. prod1/prod2) must not add its days to this one's.
    cluster, _ = clients
    other = f"d{prefix[1:]}"
    assert len(other) == len(prefix) and other != prefix
    mine, theirs = DailyCounts(cluster, prefix=prefix), DailyCounts(cluster, prefix=other)
    try:
        mine.record("item", "impression", [1], [ms(2001, 3, 1)])
        theirs.record("item", "impression", [2], [ms(2001, 3, 5)])
        theirs.add_counts("user", "lookup", np.array([3]), np.array([1]), ms(2001, 3, 6) // DAY_MS)
        assert mine.all_days_available() == {("item", "impression"): ["20010301"]}
        assert mine.top("item") == [("1", 1.0)]
    finally:
        for key in cluster.scan_iter(match=f"{other}:*"):
            cluster.delete(key)


def test_a_cluster_node_restarted_empty_of_one_kinds_counts_publishes_with_a_warning_naming_that_kind(
        cluster_nodes: Any, prefix: str) -> None:
    # each kind's counts live on one node ({item} / {user} hash tags): a node restarted empty (no persistence) loses
    # one kind's counts while the other's remain, and the hot-set warning summed the kinds' ids: the hot set published
    # with no item counted and nothing told
    from cache_refresh import job
    from cache_refresh.settings import RefreshSettings

    client = connect(RedisSettings(url=cluster_nodes.url, prefix=prefix, cluster=True), timeout_s=5.0)
    try:
        counts = DailyCounts(client, prefix=prefix)
        item_node = cluster_nodes.index_of(counts.key("item", "impression", "20010101"))
        user_slot = key_slot(counts.key("user", "impression", "20010101").encode())
        if cluster_nodes.index_of(counts.key("user", "impression", "20010101")) == item_node:
            cluster_nodes.move(user_slot, item_node, (item_node + 1) % 3)  # the kinds on two nodes
        now_ms = int(time.time() * 1000)
        counts.record("item", "impression", [1, 2, 2], [now_ms] * 3)
        counts.record("user", "impression", [2001, 2002], [now_ms] * 2)
        cluster_nodes.restart(item_node)  # back empty: the item counts are gone, the user counts are not
        hs = hot_set.compute(client, prefix, 8, CFG, days=2, hot_items=5, hot_users=3, event="impression",
                             sleep=lambda s: None)
    finally:
        client.close()
    assert hs.stats["items"] == 0 and hs.stats["users"] == 2
    rs = RefreshSettings(hot_items=5, hot_users=3)
    found = job._published_warnings(rs, "v2", {"path": "ckpt-1.pt"}, [], {}, hs.stats)
    [(stage, message)] = found
    assert stage == "hot_set" and "no counted item" in message and "user" not in message.split("lost")[0]


def _serving_partial_coverage(cluster_nodes: Any, prefix: str) -> Any:
    """A client of ``cluster_nodes`` after each node was told to serve its slots with another node down
    (``cluster-require-full-coverage no``), no retries."""
    for k in range(3):
        with contextlib.closing(cluster_nodes._admin(k)) as node:
            node.config_set("cluster-require-full-coverage", "no")
    return connect(RedisSettings(url=cluster_nodes.url, prefix=prefix, cluster=True), timeout_s=5.0, retries=0)


def test_lookup_counts_on_a_cluster_with_one_node_down_write_the_kinds_on_the_healthy_nodes(
        cluster_nodes: Any, prefix: str) -> None:
    # the item and user lookups on two nodes, the item node down (killed) while the cluster keeps serving the other
    # slots (cluster-require-full-coverage no): a flush wrote the items first, failed, and kept the users behind them,
    # so the users' lookups (a healthy node's) were tried again behind the items and dropped with them
    from serving.lookup_counts import LookupCounts

    client = _serving_partial_coverage(cluster_nodes, prefix)
    try:
        counts = DailyCounts(client, prefix=prefix)
        item_node = cluster_nodes.index_of(counts.key("item", "lookup", "20010101"))
        user_key = counts.key("user", "lookup", "20010101")
        if cluster_nodes.index_of(user_key) == item_node:
            cluster_nodes.move(key_slot(user_key.encode()), item_node, (item_node + 1) % 3)  # the kinds on two nodes
        lookups = LookupCounts(counts, flush_s=60.0)
        lookups.add("user", np.array([2001], np.int64))
        assert lookups.flush() == 1  # the counts script loaded while every node is up
        cluster_nodes.stop(item_node)
        for _ in range(3):  # each flush: its own items' first try, the last flush's items' retry (then dropped)
            lookups.add("item", np.array([7, 8, 7], np.int64))
            lookups.add("user", np.array([2001, 2002], np.int64))
            assert lookups.flush() == 2  # the users land; only the item node's lookups wait or are dropped
        today = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d")
        written = {int(m): int(c) for m, c in client.zrange(counts.key("user", "lookup", today), 0, -1,
                                                            withscores=True)}
    finally:
        client.close()
    assert (lookups.flushed, lookups.dropped) == (7, 6)  # two flushes' items dropped after their retry, one's kept
    assert written == {2001: 4, 2002: 3}



def test_lookup_counts_on_a_cluster_with_one_kind_refused_on_a_node_and_the_other_kinds_node_down_count_each_apart(
        cluster_nodes: Any, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    # the user day key another client's string on one node (WRONGTYPE: refused), the item node down: every flush
    # tries both, and each kind's lookups are dropped after their retry by their own reason; the outage is said once,
    # by its own error, the refusal once, and a stop just after drops what was kept by the same reasons
    from serving.lookup_counts import LookupCounts
    from serving.metrics import ServingMetrics

    client = _serving_partial_coverage(cluster_nodes, prefix)
    metrics = ServingMetrics(lambda: None)
    try:
        counts = DailyCounts(client, prefix=prefix)
        item_node = cluster_nodes.index_of(counts.key("item", "lookup", "20010101"))
        user_key = counts.key("user", "lookup", "20010101")
        if cluster_nodes.index_of(user_key) == item_node:
            cluster_nodes.move(key_slot(user_key.encode()), item_node, (item_node + 1) % 3)  # the kinds on two nodes
        lookups = LookupCounts(counts, metrics, flush_s=60.0)
        lookups.add("user", np.array([2001], np.int64))
        assert lookups.flush() == 1  # the counts script loaded while every node is up
        client.set(counts.key("user", "lookup", day_of(int(time.time() * 1000))), "not a sorted set")
        cluster_nodes.stop(item_node)
        with caplog.at_level(logging.INFO, logger="streamrec.serve"):
            for _ in range(3):
                lookups.add("item", np.array([7, 8, 7], np.int64))
                lookups.add("user", np.array([2001, 2002], np.int64))
                assert lookups.flush() == 0
            lookups.stop()
    finally:
        client.close()
    said = [r.getMessage() for r in caplog.records]
    failed = [m for m in said if "a flush to Redis failed" in m]
    assert len(failed) == 1 and "WRONGTYPE" not in failed[0], said
    assert len([m for m in said if "Redis refuses the writes to" in m]) == 1, said
    assert not [m for m in said if "flushing to Redis again" in m], said
    dropped = {s.labels["reason"]: s.value for s in metrics.registry.collect() for s in s.samples
               if s.name == "streamrec_serving_lookup_counts_dropped_total"}
    assert (dropped["redis"], dropped["refused"]) == (9, 6)  # two flushes' at their retry, the third's at the stop
    assert (lookups.flushed, lookups.dropped) == (1, 15)

def test_counts_written_by_a_client_made_while_a_node_holding_no_counts_is_down_land(
        cluster_nodes: Any, prefix: str) -> None:
    # the counts script was loaded on every primary before its first use: with one node down (the cluster serving
    # the other slots, cluster-require-full-coverage no) a process started meanwhile wrote no counts at all
    client = _serving_partial_coverage(cluster_nodes, prefix)
    try:
        counts = DailyCounts(client, prefix=prefix)
        held = {cluster_nodes.index_of(counts.key(kind, "impression", "20010101")) for kind in ("item", "user")}
        cluster_nodes.stop(next(k for k in range(3) if k not in held and k != 0))  # node 0: the url clients start at
        now_ms = int(time.time() * 1000)
        counts.record("item", "impression", [1, 2, 2], [now_ms] * 3)
        counts.record("user", "impression", [2001], [now_ms])
        assert counts.top("item", "impression", k=5) == [("2", 2.0), ("1", 1.0)]
        assert counts.top("user", "impression", k=5) == [("2001", 1.0)]
        assert counts.names("item", ["1", "2"], day_of(now_ms), days=2) == {}  # (its read is a script too)
    finally:
        client.close()


def test_a_users_history_is_written_and_read_by_a_client_made_while_a_node_holding_none_of_it_is_down(
        cluster_nodes: Any, prefix: str) -> None:
    # one user's append and read are one script call each (one hash slot), which took redis-py's own path: NOSCRIPT,
    # then SCRIPT LOAD on every primary, which the node down failed; serving's history read and the joiner's appends
    # of a process started during the outage failed for the users of the healthy nodes too
    client = _serving_partial_coverage(cluster_nodes, prefix)
    try:
        history = UserHistory(client, prefix=prefix, max_len=8)
        user = 2001
        cluster_nodes.stop(next(k for k in (1, 2) if k != cluster_nodes.index_of(history.key(user))))  # 0: the url's
        history.append_many([user, user], [7, 8], [1_000, 2_000])
        assert history.as_of([user], [1_500]) == [[7]]
        assert history.as_of_later([user], [3_000])() == [[7, 8]]
        with contextlib.closing(cluster_nodes._admin(cluster_nodes.index_of(history.key(user)))) as node:
            node.script_flush()  # the user's node forgot the scripts (a restart): loaded again there only
        history.append_many([user], [9], [2_500])
        assert history.recent(user) == [7, 8, 9]
    finally:
        client.close()


def test_a_clusters_ports_are_distinct_and_none_the_bus_port_of_another_when_free_port_hands_one_out_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # free_port closes its probe socket, so the kernel may hand the same port out again: two nodes were spawned on
    # one port, the second's redis-server failed to bind and the first answered for it (its slots added twice)
    a, b, c = rc.cluster_ports(3)
    handed = iter([a, a, a + rc.BUS_OFFSET, b, a, b, c])
    monkeypatch.setattr(rc, "free_port", lambda: next(handed))
    assert rc.ClusterNodes(tmp_path).ports == [a, b, c]


def test_a_cluster_forms_on_another_port_when_another_clusters_node_took_one_of_its_ports_and_leaves_that_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reaper: Reaper) -> None:
    # the CI flake "I'm already the owner of hash slot 5474" (pytest -n 3): a port found free was bound by another
    # worker's cluster node before this cluster's node bound it; that node answered in its place (it failed to bind
    # and exited), so this cluster's CLUSTER ADDSLOTS and MEET reached the other cluster
    found, taken = rc.cluster_port, []

    def raced(busy: Any = ()) -> int:  # the other worker's node binds the first port found, before this node does
        port = found(busy)
        if not taken:
            taken.append(port)
            other = reaper.add(subprocess.Popen(
                [str(redis_binary()), "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--cluster-enabled",
                 "yes", "--dir", str(tmp_path), "--cluster-config-file", "other.conf"], stdout=subprocess.DEVNULL))
            with contextlib.closing(redis.Redis(port=port, socket_timeout=2)) as c:
                assert wait_until_up(c, 10, lambda: other.poll() is None)
                c.execute_command("CLUSTER ADDSLOTS", *range(5462, 10924))  # its node 1's third of the slots
        return port

    monkeypatch.setattr(rc, "cluster_port", raced)
    (tmp_path / "mine").mkdir()
    with rc.redis_cluster(tmp_path / "mine") as nodes:
        assert taken[0] not in nodes.ports
        for k, port in enumerate(nodes.ports):
            with contextlib.closing(redis.Redis(port=port, socket_timeout=2)) as c:
                assert c.info("server")["process_id"] == nodes.procs[k].pid  # type: ignore[union-attr]
                assert c.cluster("info")["cluster_known_nodes"] == "3"
        assert "Address already in use" in (tmp_path / "mine" / f"redis-{taken[0]}.log").read_text()
    with contextlib.closing(redis.Redis(port=taken[0], socket_timeout=2)) as c:  # the other cluster untouched
        info = c.cluster("info")
        assert (info["cluster_known_nodes"], info["cluster_slots_assigned"]) == ("1", "5462")


def test_a_stopped_node_whose_port_was_taken_meanwhile_fails_to_start_naming_its_log(
        cluster_nodes: Any, reaper: Reaper) -> None:
    cluster_nodes.stop(2)
    port = cluster_nodes.ports[2]
    other = reaper.add(subprocess.Popen([str(redis_binary()), "--bind", "127.0.0.1", "--port", str(port), "--save",
                                         ""], stdout=subprocess.DEVNULL))
    with contextlib.closing(redis.Redis(port=port, socket_timeout=2)) as c:
        assert wait_until_up(c, 10, lambda: other.poll() is None)
    with pytest.raises(rc.NodeNotStarted, match=rf"(?s)cluster node 2.*127\.0\.0\.1:{port}.*redis-{port}\.log.*"
                                                r"Address already in use"):
        cluster_nodes.start(2)
    assert not cluster_nodes.running(2) and other.poll() is None


def test_the_start_check_of_a_cluster_with_one_node_down_passes_as_its_ping_did(
        cluster_nodes: Any, prefix: str) -> None:
    # the start's check (connect(check=True): the joiner) loaded its scripting probe with SCRIPT LOAD on every primary:
    # one primary down (the cluster serving the other slots) refused the joiner's start, which its PING alone had let
    # start, as the stages' own scripts (loaded where they run, _call, run_script) do
    _serving_partial_coverage(cluster_nodes, prefix).close()
    cluster_nodes.stop(2)  # node 0: the url clients start at
    rs = RedisSettings(url=cluster_nodes.url, prefix=prefix, cluster=True)
    client = connect(rs, timeout_s=5.0, retries=0, check=True)
    try:
        assert redis_client.verify(client, rs, reachable=False) is True  # serving's and the refresh's check
    finally:
        client.close()
