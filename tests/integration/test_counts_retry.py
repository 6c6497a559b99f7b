"""Day counts written again after a failure are counted once, against the real Redis of the session stack.

The joiner (stream/joiner/pipeline.py) writes a flush as one DailyCounts.record per kind and event and, when the
write fails, hands its counts back to the buffer for the next flush; serving's lookup counts use add_counts. Both are
retried from scratch, so what reached Redis before the failure must not be written twice.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from stream.counts import DAY_MS, DailyCounts, day_of
from stream.joiner.pipeline import JoinPipeline
from streamrec.stack import LocalStack


@pytest.fixture
def prefix(redis_client: redis.Redis) -> Iterator[str]:
    p = f"test-{uuid.uuid4().hex[:12]}"
    yield p
    keys = list(redis_client.scan_iter(match=f"{p}:*", count=1000))
    if keys:
        redis_client.delete(*keys)


def joiner_counting(counts: DailyCounts) -> JoinPipeline:
    """Only the counting part of a joiner pipeline (its writer thread and buffers), on ``counts``."""
    p = JoinPipeline.__new__(JoinPipeline)
    p.counts = counts
    p._counts_buffer, p._names_buffer = {}, {"item": set(), "user": set()}
    p._counts_flushed = time.monotonic()
    p._counts_writer = ThreadPoolExecutor(max_workers=1)
    p._flushing = None
    return p


def test_a_flush_retried_after_redis_refused_part_of_it_counts_what_was_written_once(
        redis_client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis fills up (maxmemory, noeviction) after the flush wrote the item counts and refuses the user counts:
    the retry writes the user counts, and the item counts not again (they were counted twice, and once more for
    each further failed flush)."""
    counts = DailyCounts(redis_client, prefix=prefix)
    p = joiner_counting(counts)
    now_ms = int(time.time() * 1000)
    for kind in ("item", "user"):
        p._counts_buffer[(kind, "impression")] = ([1, 2, 2], [now_ms] * 3)
    real_record, maxmemory = counts.record, str(redis_client.config_get("maxmemory")["maxmemory"])

    def record_refused_for_users(kind: str, event: str, ids: Any, ts: Any, names: Any = None) -> None:
        if kind != "user":
            return real_record(kind, event, ids, ts, names=names)
        redis_client.config_set("maxmemory", "1")  # full: Redis refuses writes (OOM)
        try:
            return real_record(kind, event, ids, ts, names=names)
        finally:
            redis_client.config_set("maxmemory", maxmemory)

    try:
        monkeypatch.setattr(counts, "record", record_refused_for_users)
        for _ in range(2):  # two flushes fail (the joiner's batches that find them fail and are done again)
            with pytest.raises(redis.ResponseError, match="maxmemory"):
                p.flush_counts()
        assert p._counts_buffer == {("user", "impression"): ([1, 2, 2], [now_ms] * 3)}  # only what was not written
        monkeypatch.undo()
        p.flush_counts()
    finally:
        redis_client.config_set("maxmemory", maxmemory)
        p._counts_writer.shutdown(wait=True)
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
