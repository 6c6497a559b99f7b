"""A Redis that loses its keys under the system (a single node restarted empty, no persistence) is reported by the
joiner, which writes the day counts and histories everything else reads (``stream/keyspace.py``): once per loss, a
warning and ``streamrec_join_redis_emptied_total{tag}``. Against a redis-server of the test's own, started with
``--save "" --appendonly no`` and restarted, and against a real Redis Cluster (tests/redis_cluster.py) whose node of one
kind's counts is restarted empty: that kind's marker alone is gone."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client import REGISTRY
from redis.crc import key_slot

from serving.history import EmptiedRedisWatch
from serving.metrics import ServingMetrics
from serving.service import ScoringService
from serving.settings import ServeSettings
from stream.config import RedisSettings
from stream.counts import DailyCounts
from stream.joiner.day_counts import DayCountsWriter
from stream.keyspace import KeyspaceWatch
from stream.redis_client import connect
from streamrec.stack import free_port, redis_binary
from tests.integration.test_counts_retry import joiner_counting
from tests.integration.test_faults import Service


@pytest.fixture
def empty_on_restart(tmp_path: Path) -> Iterator[Service]:
    """A single Redis node without persistence: stopped and started again, it comes back with no keys."""
    port = free_port()
    svc = Service([str(redis_binary()), "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                   "--dir", str(tmp_path)], port)
    svc.start()
    try:
        yield svc
    finally:
        svc.stop()


def emptied(tag: str) -> float:
    return REGISTRY.get_sample_value("streamrec_join_redis_emptied_total", {"tag": tag}) or 0.0


def flush(p: DayCountsWriter) -> None:
    """One counts flush of ``p`` with an item and a user count."""
    now_ms = int(time.time() * 1000)
    for kind in ("item", "user"):
        p.buffered[(kind, "impression")] = ([1, 2], [now_ms] * 2)
    p.flush()


def test_a_joiner_flush_after_its_redis_restarted_empty_warns_and_counts_the_loss_once_per_tag(
        empty_on_restart: Service, caplog: pytest.LogCaptureFixture) -> None:
    prefix = f"e{uuid.uuid4().hex[:8]}"
    with contextlib.closing(redis.Redis(port=empty_on_restart.port)) as client:
        counts = DailyCounts(client, prefix=prefix)
        p = joiner_counting(counts)
        before = {tag: emptied(tag) for tag in ("item", "user")}
        try:
            flush(p)  # the first: the markers set, nothing lost
            flush(p)
            assert {tag: emptied(tag) for tag in before} == before
            empty_on_restart.stop()
            empty_on_restart.start()  # back with no keys: the counts and histories written so far are gone
            with caplog.at_level(logging.WARNING, logger="streamrec.join"):
                flush(p)
            flush(p)  # counted once: the markers are set again
        finally:
            p.shutdown()
    assert {tag: emptied(tag) - before[tag] for tag in before} == {"item": 1.0, "user": 1.0}
    lost = [r.getMessage() for r in caplog.records if "lost the keys" in r.getMessage()]
    assert len(lost) == 2 and all(prefix in m and "click histories" in m for m in lost), lost


def test_serving_says_once_per_loss_that_the_redis_it_reads_histories_from_restarted_empty(
        empty_on_restart: Service, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Serving reads the click histories the joiner writes: after Redis restarted empty every user reads as cold. Its
    keyspace watch (``serving.history.EmptiedRedisWatch``, on the service's history client) reads the joiner's markers
    without setting them: a marker gone (serving looked first) or set anew (the joiner did) is one loss, said once with
    a WARNING and ``streamrec_serving_redis_emptied_total{tag}``; the joiner still says it too (serving's look does
    not hide it from the joiner's SET NX)."""
    prefix = f"e{uuid.uuid4().hex[:8]}"
    url = f"redis://127.0.0.1:{empty_on_restart.port}/0"
    svc = ScoringService(ServeSettings(port=0, publish_root=tmp_path, poll_s=3600, lookup_counts=False),
                         RedisSettings(url=url, prefix=prefix))
    with contextlib.closing(redis.Redis(port=empty_on_restart.port)) as client:
        p = joiner_counting(DailyCounts(client, prefix=prefix))
        before = {tag: emptied(tag) for tag in ("item", "user")}
        try:
            assert svc.emptied is not None
            flush(p)  # the joiner sets the markers
            assert svc.emptied.check() == []  # serving's first look
            empty_on_restart.stop()
            empty_on_restart.start()
            with caplog.at_level(logging.WARNING, logger="streamrec.serve"):
                assert sorted(svc.emptied.check()) == ["item", "user"]  # gone, before the joiner wrote again
            flush(p)  # the joiner finds them gone and sets them anew: the same loss, for serving
            assert svc.emptied.check() == []
            assert {tag: emptied(tag) - before[tag] for tag in before} == {"item": 1.0, "user": 1.0}
            empty_on_restart.stop()
            empty_on_restart.start()
            flush(p)  # the joiner first, this time: serving finds the markers set anew
            assert sorted(svc.emptied.check()) == ["item", "user"]
            assert svc.emptied.check() == []
        finally:
            p.shutdown()
            svc.stop()
    # two losses, each said once per tag
    said = [r.getMessage() for r in caplog.records if "lost the keys" in r.getMessage() and r.name == "streamrec.serve"]
    assert len(said) == 4 and all(prefix in m and "scored as if cold" in m for m in said), said
    assert [svc.metrics.redis_emptied.labels(tag)._value.get() for tag in ("item", "user")] == [2.0, 2.0]  # 2 losses


def test_a_joiner_flush_after_the_cluster_node_of_one_kinds_counts_restarted_empty_reports_that_kind_alone(
        cluster_nodes: Any, caplog: pytest.LogCaptureFixture) -> None:
    prefix = f"e{uuid.uuid4().hex[:8]}"
    client = connect(RedisSettings(url=cluster_nodes.url, prefix=prefix, cluster=True), timeout_s=5.0)
    counts = DailyCounts(client, prefix=prefix)
    p = joiner_counting(counts)
    before = {tag: emptied(tag) for tag in ("item", "user")}
    try:
        item_node = cluster_nodes.index_of(counts.key("item", "impression", "20010101"))
        user_key = counts.key("user", "impression", "20010101")
        if cluster_nodes.index_of(user_key) == item_node:
            cluster_nodes.move(key_slot(user_key.encode()), item_node, (item_node + 1) % 3)  # the kinds on two nodes
        flush(p)  # the first: the markers set, nothing lost
        cluster_nodes.restart(item_node)  # back empty: the item counts are gone, the user counts are not
        with caplog.at_level(logging.WARNING, logger="streamrec.join"):
            flush(p)
        flush(p)
    finally:
        p.shutdown()
        client.close()
    assert {tag: emptied(tag) - before[tag] for tag in before} == {"item": 1.0, "user": 0.0}
    assert sum("lost the keys" in r.getMessage() for r in caplog.records) == 1


def test_a_marker_of_another_redis_type_is_said_and_does_not_hide_the_other_tags_loss_from_serving(
        redis_client: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    """Another client left a hash under the item marker: serving's look failed as a whole (WRONGTYPE, logged at
    debug), so the user keys' loss went unseen too. Now the item marker reads as missing (it is gone: a loss, like a
    deleted marker), the key is named once in a WARNING, and the user marker's loss is reported."""
    prefix = f"e{uuid.uuid4().hex[:8]}"
    joiner = KeyspaceWatch(redis_client, prefix)
    serving = EmptiedRedisWatch(redis_client, prefix, ServingMetrics(lambda: None))
    try:
        joiner.check()
        assert serving.check() == []
        redis_client.delete(joiner.keys["item"])
        redis_client.hset(joiner.keys["item"], "a", "b")
        redis_client.delete(joiner.keys["user"])  # the user keys lost
        with caplog.at_level(logging.WARNING, logger="streamrec.serve"):
            assert sorted(serving.check()) == ["item", "user"]
            assert serving.check() == []
        said = [r.getMessage() for r in caplog.records if "not a keyspace marker" in r.getMessage()]
        assert len(said) == 1 and f"redis-cli DEL {joiner.keys['item']}" in said[0], said
    finally:
        redis_client.delete(*joiner.keys.values())
