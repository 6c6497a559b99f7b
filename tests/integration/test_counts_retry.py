"""Day counts written again after a failure are counted once, against the real Redis of the session stack (and a
real Redis Cluster where said).

The joiner (stream/joiner/pipeline.py) writes a flush as one DailyCounts.record per kind and event and, when the
write fails, retries it as it was, under its write id, with the next flush; serving's lookup counts
(serving/lookup_counts.py) write each day and kind with add_counts and retry a failed one once at the next flush. What
reached Redis before the failure must not be written twice, including a write Redis ran whose reply was lost.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from serving.lookup_counts import LookupCounts
from stream import counts as counts_module
from stream.config import KafkaSettings, RedisSettings
from stream.counts import DailyCounts, new_write_id
from stream.counts_keys import DAY_MS, DAY_S, day_of
from stream.errors import ConfigError
from stream.joiner.config import JoinerSettings
from stream.joiner.day_counts import DayCountsWriter, add_counts
from stream.joiner.pipeline import JoinPipeline, _redis_timeout_s
from stream.keyspace import KeyspaceWatch
from stream.strikes import is_infrastructure
from streamrec.stack import LocalStack
from tests.trickle_proxy import TrickleProxy


@pytest.fixture
def prefix(redis_client: redis.Redis) -> Iterator[str]:
    p = f"test-{uuid.uuid4().hex[:12]}"
    yield p
    keys = list(redis_client.scan_iter(match=f"{p}:*", count=1000))
    if keys:
        redis_client.delete(*keys)


def joiner_counting(counts: DailyCounts) -> DayCountsWriter:
    """The counting part of a joiner pipeline (its writer thread and buffers), on ``counts``."""
    return DayCountsWriter(counts, KeyspaceWatch(counts.client, counts.prefix), flush_s=3600)


def test_a_flush_retried_after_redis_refused_part_of_it_counts_what_was_written_once(
        redis_client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis fills up (maxmemory, noeviction) after the flush wrote the item counts and refuses the user counts:
    the retry writes the user counts, and the item counts not again (they were counted twice, and once more for
    each further failed flush)."""
    counts = DailyCounts(redis_client, prefix=prefix)
    p = joiner_counting(counts)
    now_ms = int(time.time() * 1000)
    for kind in ("item", "user"):
        p.buffered[(kind, "impression")] = ([1, 2, 2], [now_ms] * 3)
    real_record, maxmemory = counts.record, str(redis_client.config_get("maxmemory")["maxmemory"])

    def record_refused_for_users(kind: str, event: str, ids: Any, ts: Any, **kwargs: Any) -> None:
        if kind != "user":
            return real_record(kind, event, ids, ts, **kwargs)
        redis_client.config_set("maxmemory", "1")  # full: Redis refuses writes (OOM)
        try:
            return real_record(kind, event, ids, ts, **kwargs)
        finally:
            redis_client.config_set("maxmemory", maxmemory)

    try:
        monkeypatch.setattr(counts, "record", record_refused_for_users)
        for _ in range(2):  # two flushes fail (the joiner's batches that find them fail and are done again)
            with pytest.raises(redis.ResponseError, match="maxmemory"):
                p.flush()
        assert p.failed_write is not None  # only what was not written is retried
        assert p.failed_write.counts == {("user", "impression"): ([1, 2, 2], [now_ms] * 3)}
        monkeypatch.undo()
        p.flush()
    finally:
        redis_client.config_set("maxmemory", maxmemory)
        p.shutdown()
    day = day_of(now_ms)
    for kind in ("item", "user"):
        assert counts.top(kind, day=day, k=10) == [("2", 2.0), ("1", 1.0)], kind


class ResetAfterFirstDay(redis.Connection):
    """A connection that, when armed, sends a pipeline only up to its second script call (EVALSHA), waits for
    Redis's replies to what it sent (so Redis has run or queued it), then loses the connection: a network reset
    in the middle of a pipeline."""

    armed = False

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        data = command if isinstance(command, bytes) else b"".join(map(bytes, command))
        second = data.find(b"EVALSHA", data.find(b"EVALSHA") + 1)
        if not type(self).armed or second < 0:
            return super().send_packed_command(command, check_health)
        type(self).armed = False
        head = data[:data.rfind(b"*", 0, second)]
        super().send_packed_command([head], check_health)
        for _ in range(head.count(b"\r\n*") + 1):  # one reply per command sent (MULTI: +OK, then QUEUED)
            self.read_response()
        self.disconnect()
        raise redis.ConnectionError("connection reset by peer (test: after the first day's script call)")


def test_a_record_cut_off_mid_pipeline_writes_no_day_so_writing_it_again_counts_each_day_once(
        stack: LocalStack, redis_client: redis.Redis, prefix: str) -> None:
    """One record that spans two days is one pipeline of two script calls; the connection breaks after the first:
    nothing may be written, so that the caller's retry counts both days once (the first day was counted twice)."""
    pool = redis.ConnectionPool.from_url(stack.redis_url, connection_class=ResetAfterFirstDay,
                                         retry=Retry(NoBackoff(), 0))  # as the joiner's client: no retries
    client = redis.Redis(connection_pool=pool)
    try:
        counts = DailyCounts(client, prefix=prefix)
        now_ms = int(time.time() * 1000)
        ids, ts = [7, 8], [now_ms - DAY_MS, now_ms]  # yesterday and today: two day keys
        ResetAfterFirstDay.armed = True
        with pytest.raises(redis.ConnectionError, match="reset"):
            counts.record("item", "impression", ids, ts)
        assert not ResetAfterFirstDay.armed  # the reset did happen mid-pipeline
        counts.record("item", "impression", ids, ts)  # the retry
        ResetAfterFirstDay.armed = True  # add_counts (serving's lookups): two chunks of one member each
        with pytest.raises(redis.ConnectionError, match="reset"):
            counts.add_counts("item", "lookup", np.array([9, 10]), np.array([3, 4]), now_ms // DAY_MS, chunk=1)
    finally:
        ResetAfterFirstDay.armed = False
        client.close()
    assert redis_client.zscore(counts.key("item", "impression", day_of(now_ms - DAY_MS)), "7") == 1.0
    assert redis_client.zscore(counts.key("item", "impression", day_of(now_ms)), "8") == 1.0
    assert not redis_client.exists(counts.key("item", "lookup", day_of(now_ms)))  # neither chunk written


def test_a_joiner_counts_write_trickled_past_its_redis_timeout_fails_the_flush_and_its_retry_counts_once(
        stack: LocalStack, kafka: KafkaSettings, redis_client: redis.Redis, prefix: str, group_id: str) -> None:
    """Redis trickles its replies (``tests/trickle_proxy.py``) while the joiner writes a flush of 60 days (after one of
    60 days: 60 markers to forget too), one MULTI/EXEC of 120 script calls: each reply (+OK, a QUEUED per call, the
    EXEC's array) arrives within the joiner's Redis timeout, the whole transaction in ~1.8 of it. The flush fails as a
    Redis timeout once the timeout has passed (the batch that finds it rewinds); the write bounded reply by reply waited
    out the whole trickle, one timeout per reply at most. Once Redis is healthy the retry counts every day once."""
    days = 60
    timeout_s = _redis_timeout_s(JoinerSettings().batch_max, 4 * RedisSettings().history_len)
    now_ms = int(time.time() * 1000)
    ts = [now_ms - d * DAY_MS for d in range(days)]
    # the EXEC's reply (*120 and 120 x ":0") is ~490 bytes, the transaction's replies ~1,590: at timeout_s / 900 a byte
    # the EXEC's takes ~0.54 x timeout_s and the whole ~1.77 x
    with TrickleProxy(stack.s.redis_port, gap_s=timeout_s / 900) as proxy:
        p = JoinPipeline(kafka, RedisSettings(url=proxy.url, prefix=prefix), JoinerSettings(app_id=group_id))
        try:
            p.day_counts.buffered[("item", "impression")] = ([5] * days, ts)
            p.day_counts.flush()  # healthy: the script loaded, the keyspace markers set
            p.day_counts.buffered[("item", "impression")] = ([7] * days, ts)
            proxy.trickling = True
            try:
                with pytest.raises(redis.TimeoutError):
                    p.day_counts.flush()
            finally:
                proxy.trickling = False
            assert p.day_counts.failed_write is not None  # kept, under its write id, for the retry
            p.day_counts.flush()  # the retry: Redis may have run the EXEC whose reply trickled
        finally:
            p.close()
    for day in {day_of(t) for t in ts}:
        assert scores(redis_client, p.day_counts.counts.key("item", "impression", day)) == {"5": 1.0, "7": 1.0}, day


class LoseExecReply(redis.Connection):
    """A connection that, while armed (``lose`` > 0), sends a MULTI/EXEC transaction whole, reads every reply to it
    (so Redis has run the EXEC), then drops the connection instead of handing the EXEC's reply on: a reply lost after
    Redis ran the write (a timeout, a reset), which the caller sees as a ConnectionError."""

    lose = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        super().send_packed_command(command, check_health)
        data = command if isinstance(command, bytes) else b"".join(map(bytes, command))
        if not type(self).lose or not data.endswith(b"$4\r\nEXEC\r\n"):
            return
        type(self).lose -= 1
        for _ in range(data.count(b"\r\n*") + 1):  # one reply per command (MULTI: +OK, QUEUED..., the EXEC's)
            self.read_response()
        self.disconnect()
        raise redis.ConnectionError("connection lost before the reply (test: after Redis ran the EXEC)")


@pytest.fixture
def losing_client(stack: LocalStack) -> Iterator[redis.Redis]:
    """A client of the session's Redis on LoseExecReply connections, retrying nothing itself (as the joiner's and
    serving's clients)."""
    pool = redis.ConnectionPool.from_url(stack.redis_url, connection_class=LoseExecReply, retry=Retry(NoBackoff(), 0))
    client = redis.Redis(connection_pool=pool)
    try:
        yield client
    finally:
        LoseExecReply.lose = 0
        client.close()


def scores(client: Any, key: str) -> dict[str, float]:
    return {m.decode(): s for m, s in client.zrange(key, 0, -1, withscores=True)}


def test_a_joiner_flush_whose_reply_was_lost_after_redis_ran_it_counts_once_when_retried(
        losing_client: redis.Redis, redis_client: redis.Redis, prefix: str) -> None:
    """The flush's first write (item impressions, two days) runs in Redis and its reply is lost; the joiner's retry
    writes it again as it was with the user clicks it had not reached, then the counts buffered since: each counted
    once (the retry counted the lost-reply write twice)."""
    counts = DailyCounts(losing_client, prefix=prefix)
    p = joiner_counting(counts)
    now_ms = int(time.time() * 1000)
    yesterday, today = now_ms - DAY_MS, now_ms
    p.buffered[("item", "impression")] = ([1, 2, 2, 3], [yesterday, yesterday, today, today])
    p.buffered[("user", "click")] = ([7], [today])
    LoseExecReply.lose = 1
    try:
        with pytest.raises(redis.ConnectionError, match="lost before the reply"):
            p.flush()
        assert not LoseExecReply.lose  # the reply was lost
        item_key = counts.key("item", "impression", day_of(today))
        assert scores(redis_client, item_key) == {"2": 1.0, "3": 1.0}  # Redis ran it
        add_counts(p.buffered, {("item", "impression"): ([3], [today])})  # counted since the failed flush
        p.flush()  # the retry, then the new counts
    finally:
        p.shutdown()
    assert scores(redis_client, counts.key("item", "impression", day_of(yesterday))) == {"1": 1.0, "2": 1.0}
    assert scores(redis_client, item_key) == {"2": 1.0, "3": 2.0}
    assert scores(redis_client, counts.key("user", "click", day_of(today))) == {"7": 1.0}


def test_a_lookup_counts_flush_whose_reply_was_lost_after_redis_ran_it_counts_once_when_retried(
        losing_client: redis.Redis, redis_client: redis.Redis, prefix: str) -> None:
    """Serving's flush writes the item lookups, Redis runs them and the reply is lost: the next flush retries them
    under the same write id (counted once) and writes the user lookups it had not reached and the lookups made since;
    every lookup is counted as flushed, none as dropped."""
    counts = DailyCounts(losing_client, prefix=prefix)
    lc = LookupCounts(counts, flush_s=60.0)
    lc.add("item", np.array([11, 12, 11], np.int64))
    lc.add("user", np.array([5], np.int64))
    LoseExecReply.lose = 1
    assert lc.flush() == 0  # sorted by (day, kind): the items first, their reply lost
    assert not LoseExecReply.lose
    day = day_of(int(time.time() * 1000))
    item_key, user_key = counts.key("item", "lookup", day), counts.key("user", "lookup", day)
    assert scores(redis_client, item_key) == {"11": 2.0, "12": 1.0}  # Redis ran it
    lc.add("item", np.array([12], np.int64))  # made since
    assert lc.flush() == 5
    assert scores(redis_client, item_key) == {"11": 2.0, "12": 2.0}
    assert scores(redis_client, user_key) == {"5": 1.0}
    assert (lc.flushed, lc.dropped) == (5, 0)


@pytest.mark.parametrize("where", ["single node", "cluster"])
def test_a_record_over_several_days_whose_reply_was_lost_counts_each_day_once_when_sent_again_with_its_write_id(
        where: str, request: pytest.FixtureRequest, prefix: str) -> None:
    """One record of three days is one MULTI/EXEC of three script calls; Redis runs it and the reply is lost. The
    same record again under the same write id writes nothing (every day counted once, none skipped by another day's
    marker in the first run); under a new write id it is a new write and counts again."""
    if where == "cluster":
        url = request.getfixturevalue("redis_cluster")
        client: Any = redis.RedisCluster.from_url(url, connection_class=LoseExecReply, retry=Retry(NoBackoff(), 0))
    else:
        url = request.getfixturevalue("stack").redis_url
        client = redis.Redis(connection_pool=redis.ConnectionPool.from_url(
            url, connection_class=LoseExecReply, retry=Retry(NoBackoff(), 0)))
    try:
        counts = DailyCounts(client, prefix=prefix)
        now_ms = int(time.time() * 1000)
        times = [now_ms - 2 * DAY_MS, now_ms - DAY_MS, now_ms, now_ms]
        ids, write_id = [4, 5, 6, 6], new_write_id()
        LoseExecReply.lose = 1
        with pytest.raises(redis.ConnectionError, match="lost before the reply"):
            counts.record("user", "impression", ids, times, write_id=write_id)
        assert not LoseExecReply.lose
        keys = [counts.key("user", "impression", day_of(t)) for t in times[:3]]
        ran = [scores(client, k) for k in keys]
        assert ran == [{"4": 1.0}, {"5": 1.0}, {"6": 2.0}]  # Redis ran every day
        counts.record("user", "impression", ids, times, write_id=write_id)  # the retry
        assert [scores(client, k) for k in keys] == ran
        counts.record("user", "impression", ids, times, write_id=new_write_id())  # another write
        assert [scores(client, k) for k in keys] == [{"4": 2.0}, {"5": 2.0}, {"6": 4.0}]
    finally:
        LoseExecReply.lose = 0
        for key in client.scan_iter(match=f"{prefix}:*"):
            client.delete(key)
        client.close()


@contextmanager
def redis_full(redis_client: redis.Redis) -> Iterator[None]:
    """Redis refuses every write (maxmemory 1 byte, noeviction: OOM) until the block ends: Redis down for writes."""
    maxmemory = str(redis_client.config_get("maxmemory")["maxmemory"])
    redis_client.config_set("maxmemory", "1")
    try:
        yield
    finally:
        redis_client.config_set("maxmemory", maxmemory)


def test_an_event_dropped_as_future_is_counted_once_however_often_the_joiner_retries_its_write(
        redis_client: redis.Redis, prefix: str) -> None:
    """A flush holding one event a month ahead of the clock fails three times (Redis refuses writes) and is retried
    as it was each time: future_dropped says 1 throughout and after the write succeeds (it said 1, 2, 3, then 4: the
    filter ran again on every retry of the same counts)."""
    counts = DailyCounts(redis_client, prefix=prefix, future_s=3600)
    p = joiner_counting(counts)
    now_ms = int(time.time() * 1000)
    p.buffered[("item", "impression")] = ([1, 2], [now_ms, now_ms + 30 * DAY_MS])
    try:
        for _ in range(3):
            with redis_full(redis_client), pytest.raises(redis.ResponseError, match="maxmemory"):
                p.flush()
            assert counts.future_dropped == 1
        p.flush()
    finally:
        p.shutdown()
    assert counts.future_dropped == 1
    assert scores(redis_client, counts.key("item", "impression", day_of(now_ms))) == {"1": 1.0}
    assert not redis_client.exists(counts.key("item", "impression", day_of(now_ms + 30 * DAY_MS)))


@pytest.mark.parametrize("failure", ["refused", "reply lost"])
@pytest.mark.parametrize("clock_moved_s", [120, -200], ids=["clock on", "clock stepped back"])
def test_a_retried_record_drops_as_future_exactly_the_events_its_first_attempt_dropped(
        failure: str, clock_moved_s: int, losing_client: redis.Redis, redis_client: redis.Redis, prefix: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Event 2 is 3660 s ahead of the first attempt's clock (dropped), event 3 3500 s ahead (counted; a day earlier
    than 2: the first attempt is at 23:00 UTC). The write fails (Redis refuses it, or runs it and the reply is lost)
    and is retried under its write id after the clock moved. The retry decided again at its own clock: 120 s on, it
    wrote event 2 (counted in Redis, and as dropped); 200 s back, it dropped event 3 (counted in Redis and as dropped
    after a lost reply, in neither after a refusal). Now the retry keeps the first attempt's cut-off: 1 and 3 counted
    once, 2 dropped and counted as dropped once."""
    clock = [float(int(time.time()) // DAY_S * DAY_S + 23 * 3600)]  # 23:00 UTC today
    monkeypatch.setattr(counts_module, "time", SimpleNamespace(time=lambda: clock[0]))
    counts = DailyCounts(losing_client, prefix=prefix, future_s=3600)
    t0 = int(clock[0] * 1000)
    ids, times = [1, 2, 3], [t0 - 2 * DAY_MS, t0 + 3_660_000, t0 + 3_500_000]
    write_id = new_write_id()
    if failure == "refused":
        with redis_full(redis_client), pytest.raises(redis.ResponseError, match="maxmemory"):
            counts.record("item", "impression", ids, times, write_id=write_id)
    else:
        LoseExecReply.lose = 1
        with pytest.raises(redis.ConnectionError, match="lost before the reply"):
            counts.record("item", "impression", ids, times, write_id=write_id)
        assert not LoseExecReply.lose
    assert counts.future_dropped == 1
    clock[0] += clock_moved_s
    counts.record("item", "impression", ids, times, write_id=write_id)  # the retry
    assert counts.future_dropped == 1
    assert scores(redis_client, counts.key("item", "impression", day_of(times[0]))) == {"1": 1.0}
    assert scores(redis_client, counts.key("item", "impression", day_of(times[2]))) == {"3": 1.0}
    assert day_of(times[1]) != day_of(times[2])
    assert not redis_client.exists(counts.key("item", "impression", day_of(times[1])))


def expire_all_but_the_last_minute_of(client: redis.Redis, prefix: str, key: str) -> None:
    """Time passes until a minute before ``key`` expires: every key of ``prefix`` that would have expired by then is
    deleted (Redis's clock cannot be moved; what each key's TTL says it would be gone by is)."""
    until = client.pttl(key) - 60_000
    for other in client.scan_iter(match=f"{prefix}:*", count=1000):
        if 0 <= client.pttl(other) <= until:
            client.delete(other)


@pytest.mark.parametrize("call", ["record", "add_counts"])
def test_a_write_whose_reply_was_lost_is_counted_once_when_retried_any_time_while_its_counts_live(
        call: str, losing_client: redis.Redis, redis_client: redis.Redis, prefix: str) -> None:
    """Redis runs a write and its reply is lost; the retry comes days later (a long Redis outage, the joiner's batches
    failing all along), a minute before the day's counts expire. It is still recognised: counted once (its markers
    expired a day after the write, and the retry counted it twice)."""
    counts = DailyCounts(losing_client, prefix=prefix, ttl_days=8)
    now_ms = int(time.time() * 1000)
    write_id = new_write_id()

    def write() -> None:
        if call == "record":
            counts.record("item", "impression", [1, 2, 2], [now_ms - 3 * DAY_MS] * 3, write_id=write_id)
        else:
            counts.add_counts("item", "impression", np.array([1, 2]), np.array([1, 2]), now_ms // DAY_MS - 3,
                              write_id=write_id)

    LoseExecReply.lose = 1
    with pytest.raises(redis.ConnectionError, match="lost before the reply"):
        write()
    key = counts.key("item", "impression", day_of(now_ms - 3 * DAY_MS))
    assert scores(redis_client, key) == {"1": 1.0, "2": 2.0}  # Redis ran it
    expire_all_but_the_last_minute_of(redis_client, prefix, key)
    write()  # the retry, 8 days later
    assert scores(redis_client, key) == {"1": 1.0, "2": 2.0}


def test_the_markers_of_writes_that_succeeded_do_not_pile_up_and_a_lost_reply_keeps_its_own_for_its_retry(
        losing_client: redis.Redis, redis_client: redis.Redis, prefix: str) -> None:
    """Markers live as long as the day's counts (days, not one), so those of the writes that succeeded (never retried)
    are forgotten by the kind's next write: after a write whose reply was lost and 60 that succeeded, two markers are
    left (the lost one's, kept for its retry, and the last one's), where 61 piled up; the retry still counts once."""
    counts = DailyCounts(losing_client, prefix=prefix)
    now_ms = int(time.time() * 1000)
    lost_id = new_write_id()
    LoseExecReply.lose = 1
    with pytest.raises(redis.ConnectionError, match="lost before the reply"):
        counts.record("item", "impression", [1], [now_ms], write_id=lost_id)
    for _ in range(30):
        counts.record("item", "impression", [2], [now_ms], write_id=new_write_id())
        counts.add_counts("item", "lookup", np.array([2]), np.array([1]), now_ms // DAY_MS)
    day = day_of(now_ms)
    assert redis_client.hlen(counts._markers_key("item", "impression", day)) == 1  # the lost one's
    assert redis_client.hlen(counts._markers_key("item", "lookup", day)) == 1  # the item kind's last write
    counts.record("item", "impression", [1], [now_ms], write_id=lost_id)  # the retry
    assert scores(redis_client, counts.key("item", "impression", day)) == {"1": 1.0, "2": 30.0}


def test_a_day_counts_key_holding_another_type_stops_the_joiner_with_a_config_error_not_strikes_for_its_batch(
        redis_client: redis.Redis, prefix: str) -> None:
    """A WRONGTYPE from the counts write is no message's fault (the write sums many batches' counts): counted as the
    batch's, it struck and in the end dead-lettered good messages one after the other."""
    counts = DailyCounts(redis_client, prefix=prefix)
    p = joiner_counting(counts)
    now_ms = int(time.time() * 1000)
    p.buffered[("item", "impression")] = ([1, 2], [now_ms] * 2)
    redis_client.set(counts.key("item", "impression", day_of(now_ms)), "someone else's")
    try:
        with pytest.raises(ConfigError, match=f"prefix '{prefix}'.*WRONGTYPE") as info:
            p.flush()
    finally:
        p.shutdown()
    assert not is_infrastructure(info.value)  # the worker stops (exit 2); the pipeline gives ConfigErrors no strikes


def test_a_record_refused_for_a_names_key_of_another_type_writes_no_count_so_its_retry_counts_once(
        redis_client: redis.Redis, prefix: str) -> None:
    """The names key of the day holds a string (another client's): the script call failed at its HSETNX after its
    ZINCRBYs had run, without its marker, so the write, retried under its id once the key was deleted, counted the
    day twice. Every key's type is checked before the first write: refused, the call writes nothing."""
    counts = DailyCounts(redis_client, prefix=prefix)
    now_ms = int(time.time() * 1000)
    day = day_of(now_ms)
    redis_client.set(counts.names_key("item", day), "someone else's")
    write_id = new_write_id()
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        counts.record("item", "impression", [1, 2], [now_ms] * 2, names={1: "a", 2: "b"}, write_id=write_id)
    assert not redis_client.exists(counts.key("item", "impression", day))  # refused whole: nothing counted
    redis_client.delete(counts.names_key("item", day))
    counts.record("item", "impression", [1, 2], [now_ms] * 2, names={1: "a", 2: "b"}, write_id=write_id)
    assert scores(redis_client, counts.key("item", "impression", day)) == {"1": 1.0, "2": 1.0}


def test_a_write_without_names_leaves_the_names_keys_expiry_to_the_writer_of_the_names(
        redis_client: redis.Redis, prefix: str) -> None:
    """Serving's lookup counts (add_counts, no names, its own ``counts_ttl_days``) set the expiry of the joiner's names
    key of the day too: with a shorter TTL than the joiner's the names went before the counts they name (shown by
    hash), with a longer one they outlived them. A call that writes no names leaves that key's expiry alone."""
    joiner, serving = DailyCounts(redis_client, prefix=prefix, ttl_days=8), DailyCounts(redis_client, prefix=prefix,
                                                                                          ttl_days=2)
    now_ms = int(time.time() * 1000)
    day = day_of(now_ms)
    joiner.record("item", "impression", [1, 2], [now_ms] * 2, names={1: "a", 2: "b"})
    names_key, lookups_key = joiner.names_key("item", day), serving.key("item", "lookup", day)
    serving.add_counts("item", "lookup", np.array([1, 2], np.int64), np.array([5, 3], np.int64), int(now_ms // DAY_MS))
    # (this Redis has no EXPIRETIME: the TTLs, 6 days apart, say whose expiry each key has)
    assert redis_client.ttl(names_key) - redis_client.ttl(lookups_key) > 5 * DAY_S  # was equal: serving's


def test_a_write_without_names_never_leaves_the_names_key_to_expire_before_its_counts(
        redis_client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A day older than yesterday (a replay of old data; yesterday after midnight) expires ``ttl_days`` after its last
    write. The joiner's later writes of that day carry no names (a click, or impressions of ids this process named
    already): the counts keys moved on, the names key kept the first write's expiry and went a day before the counts
    it names (shown by hash). Serving's lookups under a longer TTL: the names went before the lookup counts that
    ``counts top --event lookup`` names with them. Serving's shorter TTL still does not cut the names short."""
    joiner = DailyCounts(redis_client, prefix=prefix, ttl_days=8)
    old_ms = 946_684_800_000  # 2000-01-01 (MovieLens' years)
    day = day_of(old_ms)
    real = time.time
    monkeypatch.setattr(counts_module.time, "time", lambda: real() - DAY_S)  # the first write, a day ago
    joiner.record("item", "impression", [1, 2], [old_ms] * 2, names={1: "a", 2: "b"})
    monkeypatch.setattr(counts_module.time, "time", real)
    joiner.record("item", "impression", [1], [old_ms], names={1: "a"})  # named already: no names sent
    joiner.record("item", "click", [2], [old_ms])
    names_key = joiner.names_key("item", day)
    for event in ("impression", "click"):
        assert redis_client.ttl(names_key) >= redis_client.ttl(joiner.key("item", event, day)) - 1, event
    shorter = DailyCounts(redis_client, prefix=prefix, ttl_days=2)
    shorter.add_counts("item", "lookup", np.array([1], np.int64), np.array([3], np.int64), old_ms // DAY_MS)
    assert redis_client.ttl(names_key) > 7 * DAY_S  # not serving's 2 days
    longer = DailyCounts(redis_client, prefix=prefix, ttl_days=30)
    longer.add_counts("item", "lookup", np.array([1], np.int64), np.array([3], np.int64), old_ms // DAY_MS)
    assert redis_client.ttl(names_key) >= redis_client.ttl(longer.key("item", "lookup", day)) - 1


def test_a_cluster_that_refuses_to_list_a_slot_finds_the_days_by_scan(
        redis_client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """On a cluster the days are listed from each kind's hash slot (CLUSTER GETKEYSINSLOT, CLUSTER NODES); an ACL user
    without those commands, or a managed service that hides them, failed every read of the days (the hot set, counts
    top). It falls back to the SCAN of every primary, with a warning."""
    counts = DailyCounts(redis_client, prefix=prefix)
    now_ms = int(time.time() * 1000)
    counts.record("item", "impression", [1], [now_ms])

    def refused(_self: DailyCounts, _kind: str) -> list:
        raise redis.ResponseError("NOPERM User streamrec has no permissions to run the 'cluster|getkeysinslot' command")

    monkeypatch.setattr(counts_module, "is_cluster", lambda _client: True)
    monkeypatch.setattr(DailyCounts, "_slot_keys", refused)
    assert counts.days_available("item", "impression") == [day_of(now_ms)]
    assert counts.days_available("item", "impression") == [day_of(now_ms)]
    assert sum("cannot be listed" in r.message for r in caplog.records) == 1  # logged once


def test_a_cluster_down_while_listing_a_slot_is_an_outage_not_a_fallback_to_scan(
        redis_client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Only a refusal of the slot-listing commands falls back to SCAN: a cluster that is down (CLUSTERDOWN, a
    ResponseError too) was logged as "cannot be listed" and scanned; it is the outage the callers retry."""
    counts = DailyCounts(redis_client, prefix=prefix)

    def down(_self: DailyCounts, _kind: str) -> list:
        raise redis.exceptions.ClusterDownError("CLUSTERDOWN The cluster is down")

    monkeypatch.setattr(counts_module, "is_cluster", lambda _client: True)
    monkeypatch.setattr(DailyCounts, "_slot_keys", down)
    with pytest.raises(redis.exceptions.ClusterDownError):
        counts.days_available("item", "impression")
    assert not any("cannot be listed" in r.message for r in caplog.records)
