"""A Redis that evicts keys at its memory limit drops counts, histories, strikes and serving's rows without an error,
against real redis-servers: ``eviction_advice`` names the policy and the limit where a server has both (and says
nothing under ``noeviction``, without a limit, or where Redis will not tell), and the joiner warns at start."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest
import redis

from serving.service import ScoringService
from serving.settings import ServeSettings
from stream.config import KafkaSettings, RedisSettings
from stream.joiner.config import JoinerSettings
from stream.joiner.pipeline import JoinPipeline
from stream.redis_client import connect, eviction_advice
from tests.integration.test_redis_latency import PASSWORD, redis_server
from tests.redis_cluster import ClusterNodes

HOLDS = "the test's keys"


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl"])
def test_advice_names_an_evicting_policy_and_its_limit_without_the_password(policy: str) -> None:
    with redis_server("--requirepass", PASSWORD, "--maxmemory", "64mb", "--maxmemory-policy", policy) as url:
        settings = RedisSettings(url=url)
        client = connect(settings, timeout_s=1.0, retries=0)
        try:
            advice = eviction_advice(client, settings, HOLDS)
            assert advice is not None and f"maxmemory-policy {policy}" in advice and str(64 * 2**20) in advice
            assert HOLDS in advice and "noeviction" in advice and PASSWORD not in advice
            client.config_set("maxmemory-policy", "noeviction")
            assert eviction_advice(client, settings, HOLDS) is None
        finally:
            client.close()


@pytest.mark.parametrize("args", [
    ("--maxmemory-policy", "allkeys-lru"),  # maxmemory 0: no limit, nothing is evicted
    ("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru", "--rename-command", "CONFIG", ""),  # hidden CONFIG
], ids=["no-limit", "config-hidden"])
def test_no_advice_without_a_memory_limit_or_where_redis_will_not_say(args: tuple[str, ...]) -> None:
    with redis_server(*args) as url:
        settings = RedisSettings(url=url)
        client = connect(settings, timeout_s=1.0, retries=0)
        try:
            assert eviction_advice(client, settings, HOLDS) is None
        finally:
            client.close()


def test_the_joiner_warns_at_start_on_a_redis_that_evicts(kafka: KafkaSettings, group_id: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    with redis_server("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lfu") as url:
        with caplog.at_level(logging.WARNING, logger="streamrec.join"):
            JoinPipeline(kafka, RedisSettings(url=url), JoinerSettings(app_id=group_id)).close()
    warned = [r.getMessage() for r in caplog.records if "evicts keys" in r.getMessage()]
    assert len(warned) == 1 and "maxmemory-policy allkeys-lfu" in warned[0] and "user click histories" in warned[0]


@pytest.mark.parametrize("policy", ["allkeys-lru", "noeviction"])
def test_serving_warns_at_start_only_when_its_redis_evicts(tmp_path: Path, policy: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    with redis_server("--maxmemory", "64mb", "--maxmemory-policy", policy) as url:
        settings = ServeSettings(port=0, publish_root=tmp_path / "serving", poll_s=3600)
        with caplog.at_level(logging.WARNING, logger="streamrec.serve"):
            with ScoringService(settings, RedisSettings(url=url)):
                pass
    warned = [r.getMessage() for r in caplog.records if "evicts keys" in r.getMessage()]
    assert len(warned) == (1 if policy == "allkeys-lru" else 0)
    assert all("embedding rows" in w for w in warned)


def test_advice_asks_every_node_of_a_cluster(cluster_nodes: ClusterNodes) -> None:
    """A cluster client sends CONFIG GET to one node unless told otherwise: a node that evicts went unnamed."""
    settings = RedisSettings(url=cluster_nodes.url, cluster=True)
    client = connect(settings, timeout_s=2.0, retries=0)
    try:
        assert eviction_advice(client, settings, HOLDS) is None
        with contextlib.closing(redis.Redis(port=cluster_nodes.ports[2])) as node:
            node.config_set("maxmemory", str(64 * 2**20))
            node.config_set("maxmemory-policy", "volatile-lru")
        advice = eviction_advice(client, settings, HOLDS)
        assert advice is not None and "maxmemory-policy volatile-lru" in advice
    finally:
        client.close()
