"""Serving tells the refresh which version it serves (serving/served_versions.py):
``<prefix>:serving:<host>:<pid>:<instance>`` in the session stack's Redis (a key per service), written with a TTL at
start and at each swap, deleted at a clean stop; a Redis that fails the write is one WARNING and a metric, never an
error; the refresh's read of those keys."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path

import pytest
import redis

from serving.metrics import ServingMetrics
from serving.served_versions import TTL_S, ServedVersionBeacon, served_key, served_versions
from serving.service import ScoringService
from serving.settings import ServeSettings
from serving.swap import ModelHolder, ModelUpdater
from streamrec.stack import free_port
from tests.integration.test_serving import TinyLearner, publish_version, redis_settings


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


def this_process(prefix: str) -> str:
    """What every key a service of this process writes begins with (its instance's hex follows)."""
    return served_key(prefix, f"{socket.gethostname()}:{os.getpid()}:")


def until(cond: object, what: str, timeout_s: float = 60.0) -> None:
    """Wait for ``cond()`` (a thread's write): a bound on a hang, not an assert of timing."""
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"still not {what} after {timeout_s:.0f}s"
        time.sleep(0.05)


def test_serving_writes_the_version_it_serves_with_a_ttl_and_deletes_it_at_a_clean_stop(
        stack, redis_client: redis.Redis, tmp_path: Path, prefix: str) -> None:
    root = tmp_path / "serving"
    publish_version(TinyLearner(), root, "v001")
    with ScoringService(ServeSettings(port=0, publish_root=root, poll_s=3600), redis_settings(stack, prefix)) as svc:
        assert svc.served is not None
        key = svc.served.key
        assert key.startswith(this_process(prefix)) and key != this_process(prefix)
        until(lambda: redis_client.exists(key), f"written: {key}")
        held = json.loads(redis_client.get(key))
        assert held["version"] == "v001" and held["host"] == socket.gethostname() and held["pid"] == os.getpid()
        assert 0 < redis_client.ttl(key) <= TTL_S  # a process killed stops holding v001 back when it expires
        assert served_versions(redis_client, prefix) == {"v001": [f"{socket.gethostname()}:{os.getpid()}"]}
    assert not redis_client.exists(key)  # a clean stop: this process serves nothing any more


def test_a_swap_wakes_the_beacon_and_its_next_write_names_the_new_version_with_its_own_since(
        stack, redis_client: redis.Redis, tmp_path: Path, prefix: str) -> None:
    root = tmp_path / "serving"
    learner = TinyLearner()
    publish_version(learner, root, "v001")
    holder = ModelHolder()
    metrics = ServingMetrics(holder.model)
    beacon = ServedVersionBeacon(redis_client, prefix, lambda: (m.version if (m := holder.model()) else None), metrics)
    swaps: list[str | None] = []
    updater = ModelUpdater(holder, metrics, root, None, poll_s=3600,
                           on_swap=lambda: swaps.append(holder.model().version))  # type: ignore[union-attr]
    beacon.beat()
    assert not redis_client.exists(beacon.key)  # no model yet: nothing to hold back
    updater.check_now()
    beacon.beat()
    first = json.loads(redis_client.get(beacon.key))
    publish_version(learner, root, "v002")
    updater.check_now()
    updater.check_now()  # no swap: on_swap is not called again
    assert swaps == ["v001", "v002"]  # the service's on_swap is the beacon's wake: written at once, not a beat later
    beacon.beat()
    second = json.loads(redis_client.get(beacon.key))
    assert (first["version"], second["version"]) == ("v001", "v002") and second["since"] >= first["since"]
    beacon.stop()
    assert not redis_client.exists(beacon.key)


def test_two_services_in_one_process_keep_a_key_each_and_the_first_to_stop_deletes_only_its_own(
        stack, redis_client: redis.Redis, prefix: str) -> None:
    """Two beacons in one process (an embedder's services, tests) shared <prefix>:serving:<host>:<pid>: the second's
    write replaced the first's version, and the first to stop deleted the key the other still served under (a
    refresh could then prune the version it serves)."""
    metrics = ServingMetrics(ModelHolder().model)
    first = ServedVersionBeacon(redis_client, prefix, lambda: "v001", metrics)
    second = ServedVersionBeacon(redis_client, prefix, lambda: "v002", metrics)
    first.beat()
    second.beat()
    me = f"{socket.gethostname()}:{os.getpid()}"
    assert served_versions(redis_client, prefix) == {"v001": [me], "v002": [me]}
    first.stop()
    assert served_versions(redis_client, prefix) == {"v002": [me]}  # the other service's key is still there
    second.stop()
    assert served_versions(redis_client, prefix) == {}


def test_a_process_serving_one_version_from_two_services_is_named_once(
        stack, redis_client: redis.Redis, prefix: str) -> None:
    metrics = ServingMetrics(ModelHolder().model)
    beacons = [ServedVersionBeacon(redis_client, prefix, lambda: "v001", metrics) for _ in range(2)]
    for beacon in beacons:
        beacon.beat()
    assert served_versions(redis_client, prefix) == {"v001": [f"{socket.gethostname()}:{os.getpid()}"]}
    for beacon in beacons:
        beacon.stop()


def test_a_redis_that_fails_the_write_is_one_warning_and_a_metric_never_an_error(
        caplog: pytest.LogCaptureFixture) -> None:
    down = redis.Redis(port=free_port(), socket_connect_timeout=1.0)
    holder = ModelHolder()
    metrics = ServingMetrics(holder.model)
    beacon = ServedVersionBeacon(down, "p", lambda: "v001", metrics)
    with caplog.at_level(logging.WARNING, logger="streamrec.serve"):
        beacon.beat()
        beacon.beat()
        beacon.stop()  # no delete: the last write failed (Redis down), the key expires by its TTL
    down.close()
    warned = [r for r in caplog.records if r.levelname == "WARNING" and beacon.key in r.getMessage()]
    assert len(warned) == 1 and "reachable" in warned[0].getMessage()
    assert metrics.registry.get_sample_value("streamrec_serving_served_version_errors_total") == 2


class _Refusing:
    """A client whose every command the ACL refuses (NOPERM), or that cannot reach Redis (a ConnectionError)."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def set(self, *args: object, **kwargs: object) -> None:
        raise self.exc

    def delete(self, *args: object) -> None:
        raise self.exc


@pytest.mark.parametrize(("exc", "fix", "not_fix"), [
    (redis.exceptions.NoPermissionError("this user has no permissions to access one of the keys used as arguments"),
     "grant serving +set +del on ~p:serving:*", "reachable"),
    (redis.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused."), "reachable", "grant"),
])
def test_the_write_warning_names_the_fix_for_its_error_a_grant_only_for_an_acl_refusal(
        caplog: pytest.LogCaptureFixture, exc: Exception, fix: str, not_fix: str) -> None:
    """A Redis that was down was told to grant serving SET and DEL, an ACL change that fixes nothing; an ACL
    refusal named the one key of this process (host:pid), not the pattern every process's key needs."""
    beacon = ServedVersionBeacon(_Refusing(exc), "p", lambda: "v001", ServingMetrics(ModelHolder().model))
    with caplog.at_level(logging.WARNING, logger="streamrec.serve"):
        beacon.beat()
    [warned] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert fix in warned and not_fix not in warned, warned


def test_the_refresh_reads_each_process_version_and_skips_keys_that_are_not_one(
        stack, redis_client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    for host, pid, version in (("a", 1, "v003"), ("b", 2, "v003"), ("c", 3, "v001")):
        redis_client.set(served_key(prefix, f"{host}:{pid}:0a1b2c3d"),
                         json.dumps({"version": version, "host": host, "pid": pid, "since": 0.0}), ex=30)
    redis_client.set(served_key(prefix, "d:4"), b"not json", ex=30)
    redis_client.hset(served_key(prefix, "e:5"), "version", "v002")  # another type: skipped, not a Redis failure
    redis_client.expire(served_key(prefix, "e:5"), 30)
    redis_client.set(served_key(prefix + "x", "f:6"), json.dumps({"version": "v009", "host": "f", "pid": 6}), ex=30)
    got = served_versions(redis_client, prefix)
    assert {v: sorted(who) for v, who in got.items()} == {"v003": ["a:1", "b:2"], "v001": ["c:3"]}
    assert len([r for r in caplog.records if "skipped" in r.getMessage()]) == 2
