"""serving/history_cache.py against a real Redis: users' histories kept in process, fresh by Redis's invalidations."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from serving.history import HistoryReader
from serving.history_cache import LISTENER_NAME, HistoryCache
from serving.metrics import ServingMetrics
from stream.config import RedisSettings
from stream.history import UserHistory
from stream.redis_client import connect
from tests.secure_redis import SecureRedis

HISTORY_LEN = 50


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.01)


def sample(metrics: ServingMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels or None) or 0.0


class Setup:
    """A reader with a cache over ``client`` (the request path's client), the cache's listener started."""

    def __init__(self, client: Any, prefix: str, max_users: int = 100, history: Any = None,
                 **cache_options: Any) -> None:
        self.metrics = ServingMetrics(lambda: None)
        self.user_history = UserHistory(client, prefix=prefix, max_len=4 * HISTORY_LEN)
        self.cache = HistoryCache(client, prefix, max_users, self.metrics, **cache_options)
        self.reader = HistoryReader(history or self.user_history, HISTORY_LEN, self.metrics, cache=self.cache,
                                    retry_after_s=3600)

    def hits(self) -> float:
        return sample(self.metrics, "streamrec_serving_history_cache_users_total", result="hit")

    def key_invalidations(self) -> float:
        return sample(self.metrics, "streamrec_serving_history_cache_invalidations_total", kind="key")

    def click(self, user: int, item: int, ts: int, settle: bool = True) -> None:
        """The joiner's append; ``settle``: and its invalidation processed (a read sent meanwhile is not cached)."""
        seen = self.key_invalidations()
        self.user_history.append_many([user], [item], [ts])
        if settle and self.cache.up:
            wait_until(lambda: self.key_invalidations() > seen, "the click's invalidation processed")


@pytest.fixture
def prefix(redis_client: redis.Redis) -> Iterator[str]:
    p = f"t{uuid.uuid4().hex[:8]}"
    yield p
    if keys := redis_client.keys(f"{p}:*"):
        redis_client.delete(*keys)


@pytest.fixture
def setup(stack: Any, prefix: str) -> Iterator[Setup]:
    client = redis.Redis.from_url(stack.redis_url)
    s = Setup(client, prefix)
    s.cache.start()
    try:
        wait_until(lambda: s.cache.up, "the listener up")
        yield s
    finally:
        s.cache.stop()
        client.close()


def test_a_repeat_users_history_is_read_from_redis_once(setup: Setup) -> None:
    setup.click(1, 11, 1000)
    assert setup.reader.read([1]) == [[11]]
    assert setup.reader.read([1]) == [[11]] and setup.reader.read([1, 2]) == [[11], []]
    assert setup.hits() == 2
    assert sample(setup.metrics, "streamrec_serving_history_cache_users_total", result="miss") == 2  # 1, then 2
    assert sample(setup.metrics, "streamrec_serving_history_cache_entries") == 2


WRITES: dict[str, Callable[[redis.Redis, str], None]] = {
    "lpush": lambda r, key: r.lpush(key, "3000:33"),
    "rpush": lambda r, key: r.rpush(key, "3000:33"),
    "del": lambda r, key: r.delete(key),
    "flushall": lambda r, key: r.flushall(),
}


@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_write_to_a_cached_users_list_is_read_after_its_invalidation(
        setup: Setup, redis_client: redis.Redis, write: str) -> None:
    setup.click(1, 11, 1000)
    assert setup.reader.read([1]) == [[11]] and 1 in setup.cache
    WRITES[write](redis_client, setup.user_history.key(1))
    wait_until(lambda: 1 not in setup.cache, "the user's entry invalidated")
    assert setup.reader.read([1]) == [[] if write in ("del", "flushall") else [11, 33]]


def test_the_joiners_append_invalidates_the_user_and_no_other(setup: Setup) -> None:
    setup.click(1, 11, 1000)
    setup.click(2, 22, 1000)
    assert setup.reader.read([1, 2]) == [[11], [22]]
    setup.click(1, 12, 2000)
    wait_until(lambda: 1 not in setup.cache, "user 1 invalidated")
    assert 2 in setup.cache
    assert setup.reader.read([2, 1]) == [[22], [11, 12]]


class ReadAtSend:
    """A history whose read is answered when it is sent (Redis answered it before the write that follows it)."""

    def __init__(self, history: UserHistory) -> None:
        self.history = history

    def as_of(self, users: list[int], ts: list[int]) -> list[list[int]]:
        return self.history.as_of(users, ts)

    def as_of_later(self, users: list[int], ts: list[int]) -> Callable[[], list[list[int]]]:
        got = self.history.as_of(users, ts)
        return lambda: got


def test_a_read_answered_before_a_write_invalidated_meanwhile_is_not_cached(stack: Any, prefix: str) -> None:
    client = redis.Redis.from_url(stack.redis_url)
    s = Setup(client, prefix, history=ReadAtSend(UserHistory(client, prefix=prefix, max_len=4 * HISTORY_LEN)))
    s.cache.start()
    try:
        wait_until(lambda: s.cache.up, "the listener up")
        s.click(1, 11, 1000)
        collect = s.reader.start([1])  # the read answered: [11]
        s.click(1, 12, 2000)  # then the click, its invalidation processed before the answer is collected
        assert collect() == [[11]]  # this request's history: as it was when read
        assert 1 not in s.cache  # not cached: it is stale
        assert s.reader.read([1]) == [[11, 12]]
    finally:
        s.cache.stop()
        client.close()


def test_a_read_answered_after_the_invalidation_of_another_user_is_cached(setup: Setup) -> None:
    setup.click(1, 11, 1000)
    collect = setup.reader.start([1])
    setup.click(2, 22, 1000)
    assert collect() == [[11]] and 1 in setup.cache


def listener_ids(admin: redis.Redis) -> list[int]:
    return [int(c["id"]) for c in admin.client_list() if c.get("name") == LISTENER_NAME]


def test_a_lost_listener_empties_the_cache_which_is_unused_until_it_is_back(
        setup: Setup, redis_client: redis.Redis) -> None:
    gate = threading.Event()
    real = setup.cache._connect

    def gated() -> Any:  # the reconnect waits for the test: the listener is down for as long as the test needs
        gate.wait(30)
        return real()

    setup.cache._connect = gated  # type: ignore[method-assign]
    setup.click(1, 11, 1000)
    assert setup.reader.read([1]) == [[11]] and 1 in setup.cache
    ids = listener_ids(redis_client)
    assert len(ids) == 1
    redis_client.client_kill_filter(_id=ids[0])
    wait_until(lambda: not setup.cache.up, "the listener down")
    assert sample(setup.metrics, "streamrec_serving_history_cache_listener_up") == 0
    assert len(setup.cache) == 0
    setup.click(1, 12, 2000, settle=False)  # no invalidation reaches this process now
    hits = setup.hits()
    assert setup.reader.read([1]) == [[11, 12]] and setup.reader.read([1]) == [[11, 12]]  # from Redis, not cached
    assert setup.hits() == hits and len(setup.cache) == 0
    gate.set()
    wait_until(lambda: setup.cache.up, "the listener back")
    setup.click(1, 13, 3000)  # waits for its invalidation: tracking is on again
    assert setup.reader.read([1]) == [[11, 12, 13]]


def test_an_entry_cached_before_the_listener_was_lost_is_not_served_after_it_is_back(
        setup: Setup, redis_client: redis.Redis) -> None:
    gate = threading.Event()
    real = setup.cache._connect

    def gated() -> Any:
        gate.wait(30)
        return real()

    setup.cache._connect = gated  # type: ignore[method-assign]
    setup.click(1, 11, 1000)
    assert setup.reader.read([1]) == [[11]]
    redis_client.client_kill_filter(_id=listener_ids(redis_client)[0])
    wait_until(lambda: not setup.cache.up, "the listener down")
    setup.click(1, 12, 2000, settle=False)  # missed by the listener
    gate.set()
    wait_until(lambda: setup.cache.up, "the listener back")
    assert setup.reader.read([1]) == [[11, 12]]


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[SecureRedis]:
    with SecureRedis(tmp_path / "redis", password=uuid.uuid4().hex, user="serve", user_password="pw") as srv:
        yield srv


def test_a_restarted_redis_is_listened_to_again_and_its_data_read(own_redis: SecureRedis, prefix: str) -> None:
    client = redis.Redis.from_url(own_redis.url, username="serve", password="pw", socket_timeout=2)
    s = Setup(client, prefix)
    s.cache.start()
    try:
        wait_until(lambda: s.cache.up, "the listener up")
        s.click(1, 11, 1000)
        assert s.reader.read([1]) == [[11]] and 1 in s.cache
        own_redis.stop()
        wait_until(lambda: not s.cache.up, "the listener down")
        own_redis.start()  # empty: no persistence
        admin = own_redis.admin()
        try:
            UserHistory(admin, prefix=prefix).append_many([1], [99], [5000])
        finally:
            admin.close()
        wait_until(lambda: s.cache.up, "the listener back")
        assert s.reader.read([1]) == [[99]]
    finally:
        s.cache.stop()
        client.close()


def test_a_listener_whose_redis_stops_answering_is_taken_as_lost(own_redis: SecureRedis, prefix: str) -> None:
    """A connection that stays open but silent (a frozen Redis, a partition) may miss invalidations: the PING the
    listener sends after ping_s without an answer within its timeout drops the cache until Redis answers again."""
    client = redis.Redis.from_url(own_redis.url, username="serve", password="pw", socket_timeout=2)
    s = Setup(client, prefix, ping_s=0.2, timeout_s=0.5, backoff_s=(0.05, 0.2))
    s.cache.start()
    assert own_redis.proc is not None
    pid = own_redis.proc.pid
    try:
        wait_until(lambda: s.cache.up, "the listener up")
        s.click(1, 11, 1000)
        assert s.reader.read([1]) == [[11]] and 1 in s.cache
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_until(lambda: not s.cache.up, "the listener taken as lost")
            assert len(s.cache) == 0
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_until(lambda: s.cache.up, "the listener back")
    finally:
        s.cache.stop()
        client.close()


def refused_pings(admin: redis.Redis, user: str) -> int:
    return sum(int(e["count"]) for e in admin.acl_log() if e.get("username") == user and e.get("object") == "ping")


def test_a_ping_the_acl_refuses_is_an_answer_the_listener_and_its_entries_stay(
        stack: Any, redis_client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """An ACL user without +ping (the grant the README lists names none): Redis answers the listener's PING with
    NOPERM, which proves the connection alive as a PONG does. It was taken as a lost listener: the cache emptied, the
    listener reconnected, and two WARNINGs said after every ping_s of silence, for ever."""
    user, password = f"{prefix}-noping", uuid.uuid4().hex
    redis_client.execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}", "~*", "&*", "+@all", "-ping")
    limited = redis.Redis.from_url(stack.redis_url, username=user, password=password)
    s = Setup(limited, prefix, ping_s=0.1)

    def own_listeners() -> list[str]:
        return [c["id"] for c in redis_client.client_list() if c.get("user") == user and c.get("name") == LISTENER_NAME]

    try:
        with caplog.at_level(logging.WARNING, logger="streamrec.serve"):
            s.cache.start()
            wait_until(lambda: s.cache.up, "the listener up")
            s.click(1, 11, 1000)
            assert s.reader.read([1]) == [[11]] and 1 in s.cache
            listeners, refused = own_listeners(), refused_pings(redis_client, user)
            # the second PING goes out only once the first one's answer (the refusal) has been read
            wait_until(lambda: refused_pings(redis_client, user) >= refused + 2, "two PINGs refused")
            assert s.cache.up and 1 in s.cache and own_listeners() == listeners and len(listeners) == 1
        assert not [r.getMessage() for r in caplog.records if "history cache" in r.getMessage()]
    finally:
        s.cache.stop()
        limited.close()
        redis_client.execute_command("ACL", "DELUSER", user)


def test_redis_down_reads_as_without_the_cache(own_redis: SecureRedis, prefix: str) -> None:
    client = redis.Redis.from_url(own_redis.url, username="serve", password="pw", socket_timeout=0.5)
    s = Setup(client, prefix)
    s.cache.start()
    try:
        wait_until(lambda: s.cache.up, "the listener up")
        s.click(1, 11, 1000)
        assert s.reader.read([1]) == [[11]] and 1 in s.cache
        own_redis.stop()
        wait_until(lambda: not s.cache.up, "the listener down")
        hits = s.hits()
        assert s.reader.read([1]) == [[]] and s.reader.read([1]) == [[]]  # the second: the breaker, no Redis
        assert s.hits() == hits
        assert sample(s.metrics, "streamrec_serving_history_unavailable_total") == 2
        assert sample(s.metrics, "streamrec_serving_history_errors_total") == 1
    finally:
        s.cache.stop()
        client.close()


@pytest.mark.parametrize("denied", ["client", "channel"])
def test_tracking_refused_by_an_acl_turns_the_cache_off_with_one_warning(
        stack: Any, redis_client: redis.Redis, prefix: str, denied: str, caplog: pytest.LogCaptureFixture) -> None:
    user, password = f"{prefix}-user", uuid.uuid4().hex
    rules = ["-client"] if denied == "client" else ["resetchannels", "&other"]
    redis_client.execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}", "~*", "&*", "+@all", *rules)
    limited = redis.Redis.from_url(stack.redis_url, username=user, password=password)
    s = Setup(limited, prefix)
    try:
        with caplog.at_level(logging.WARNING, logger="streamrec.serve"):
            s.cache.start()
            wait_until(lambda: s.cache.off, "the cache off")
            s.cache.stop()
        said = [r for r in caplog.records if "history cache off" in r.getMessage()]
        assert len(said) == 1 and "ACL" in said[0].getMessage()
        s.click(1, 11, 1000)
        assert s.reader.read([1]) == [[11]] and s.reader.read([1]) == [[11]]
        assert s.hits() == 0 and len(s.cache) == 0
    finally:
        s.cache.stop()
        limited.close()
        redis_client.execute_command("ACL", "DELUSER", user)


def test_a_redis_cluster_client_turns_the_cache_off_with_a_warning(stack: Any, prefix: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    cluster = connect(RedisSettings(url=stack.redis_url, cluster=True))  # made at its first use: never here
    with caplog.at_level(logging.WARNING, logger="streamrec.serve"):
        cache = HistoryCache(cluster, prefix, 100, ServingMetrics(lambda: None))
        cache.start()  # nothing to start
    said = [r for r in caplog.records if "history cache off" in r.getMessage()]
    assert cache.off and len(said) == 1 and "cluster" in said[0].getMessage()
    assert cache.lookup([1]) == ({}, None)


def test_at_most_max_users_are_cached_least_recently_used_out_first(stack: Any, prefix: str) -> None:
    client = redis.Redis.from_url(stack.redis_url)
    s = Setup(client, prefix, max_users=2)
    s.cache.start()
    try:
        wait_until(lambda: s.cache.up, "the listener up")
        for u in (1, 2, 3):
            s.click(u, 10 + u, 1000)
        s.reader.read([1])
        s.reader.read([2])
        s.reader.read([1])  # 2 is now the least recently used
        s.reader.read([3])
        assert len(s.cache) == 2 and 1 in s.cache and 3 in s.cache and 2 not in s.cache
        assert sample(s.metrics, "streamrec_serving_history_cache_entries") == 2
    finally:
        s.cache.stop()
        client.close()


def test_a_long_list_is_cached_as_the_read_returns_it_no_larger(setup: Setup, redis_client: redis.Redis) -> None:
    key = setup.user_history.key(1)
    redis_client.rpush(key, *[f"{1000 + i}:{i}" for i in range(500)])  # past the read's max_len (200)
    wait_until(lambda: setup.key_invalidations() >= 1, "the write's invalidation processed")
    first = setup.reader.read([1])
    assert len(first[0]) == HISTORY_LEN
    assert len(setup.cache._entries[1]) == HISTORY_LEN
    assert setup.reader.read([1]) == first and setup.hits() == 1


def test_the_service_builds_the_cache_from_its_setting_and_its_requests_use_it(stack: Any, prefix: str,
                                                                                tmp_path: Path) -> None:
    from serving.service import ScoringService
    from serving.settings import ServeSettings

    rs = RedisSettings(url=stack.redis_url, prefix=prefix)
    settings = ServeSettings(port=0, publish_root=tmp_path / "root", poll_s=3600, lookup_counts=False,
                             history_cache_users=10)
    with ScoringService(settings, rs) as svc:
        cache = svc.history_cache
        assert cache is not None and svc.app.history_reader.cache is cache
        wait_until(lambda: cache.up, "the listener up")
        UserHistory(svc.redis, prefix=prefix, max_len=4 * rs.history_len).append_many([1], [11], [1000])
        wait_until(lambda: sample(svc.metrics, "streamrec_serving_history_cache_invalidations_total", kind="key") == 1,
                   "the click's invalidation")
        assert svc.app.history_reader.read([1]) == [[11]] and svc.app.history_reader.read([1]) == [[11]]
        assert sample(svc.metrics, "streamrec_serving_history_cache_users_total", result="hit") == 1
    assert not cache.up and cache._thread is None  # stopped with the service
    with ScoringService(ServeSettings(port=0, publish_root=tmp_path / "root", poll_s=3600, lookup_counts=False),
                        rs) as svc:
        assert svc.history_cache is None and svc.app.history_reader.cache is None  # 0, the default: off
