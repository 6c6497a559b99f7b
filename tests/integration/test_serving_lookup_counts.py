"""Serving counts its own row lookups per id into Redis day counts, and the nightly hot set ranks by them (issue 17,
item 5), against the real Redis of the session stack.

* A scored request counts its user (``user``), its candidates and its user's history items (``item``) in today's
  ``{prefix}:counts:{item}:lookup:{day}`` (``{user}``) (stream/counts_keys.py), written by the background flush.
* Redis down: every request is still answered 200, and the lookups are kept for one retry, then dropped and counted.
* The hot set ranks by lookups; the joiner's impression counts fill what lookups leave empty, and without any lookup
  counts it is the impression-ranked hot set.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from cache_refresh import hot_set
from serving.lookup_counts import LookupCounts
from serving.metrics import ServingMetrics
from serving.service import ScoringService
from serving.settings import ServeSettings
from stream.config import RedisSettings
from stream.counts import DailyCounts
from stream.counts_keys import DAY_MS, day_of
from stream.features import hash_value
from stream.history import UserHistory
from stream.redis_client import connect as connect_redis
from streamrec.stack import LocalStack, free_port
from tests.integration.test_serving import CFG, HISTORY_READ_S, TinyLearner, connect, post, publish_version
from tests.trickle_proxy import TrickleProxy


@pytest.fixture
def prefix() -> str:
    return f"lc{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def learner() -> TinyLearner:
    return TinyLearner()


def lookups(client: redis.Redis, prefix: str, kind: str) -> dict[int, int]:
    key = DailyCounts(client, prefix=prefix).key(kind, "lookup", day_of(int(time.time() * 1000)))
    return {int(m): int(c) for m, c in client.zrange(key, 0, -1, withscores=True)}


def out_of_memory_for(client: redis.Redis, counts: DailyCounts, monkeypatch: pytest.MonkeyPatch, *kinds: str) -> None:
    """``counts``' writes of ``kinds`` refused by a full Redis (OOM: maxmemory 1 while each runs): an outage."""
    real_add, maxmemory = counts.add_counts, str(client.config_get("maxmemory")["maxmemory"])

    def add(kind: str, *args: Any, **kwargs: Any) -> None:
        if kind in kinds:
            client.config_set("maxmemory", "1")  # full: Redis refuses writes (OOM)
        try:
            real_add(kind, *args, **kwargs)
        finally:
            client.config_set("maxmemory", maxmemory)

    monkeypatch.setattr(counts, "add_counts", add)


def test_scored_requests_count_their_user_candidates_and_history_in_todays_lookup_keys(
        stack, redis_client: redis.Redis, learner: TinyLearner, tmp_path: Path, prefix: str) -> None:
    root = tmp_path / "serving"
    publish_version(learner, root, "v1")
    UserHistory(redis_client, prefix=prefix, max_len=200).append_many(
        [hash_value("alice")] * 2, [hash_value(100), hash_value(101)], [1, 2])
    settings = ServeSettings(port=0, publish_root=root, poll_s=0.1, lookup_counts_flush_s=3600,
                             redis_timeout_s=HISTORY_READ_S)
    with ScoringService(settings, RedisSettings(url=stack.redis_url, prefix=prefix)) as svc:
        conn = connect(svc)
        for body in ({"user_id": "alice", "items": [3, "x", 3]}, {"user_id": "alice", "items": [3]},
                     {"user_id": "bob", "items": [100]}):
            assert post(conn, "/v1/score", body)[0] == 200
        conn.close()
        assert svc.lookups is not None
        assert lookups(redis_client, prefix, "item") == {}  # nothing on the request path: only the flush writes
        assert svc.lookups.flush() == 12  # 3 users + 5 candidates + 2 x 2 history items of alice (bob has none)
    assert lookups(redis_client, prefix, "user") == {hash_value("alice"): 2, hash_value("bob"): 1}
    assert lookups(redis_client, prefix, "item") == {hash_value(3): 3, hash_value("x"): 1, hash_value(100): 3,
                                                     hash_value(101): 2}


def test_redis_down_answers_every_request_and_counts_the_lookups_dropped_after_their_retry(
        learner: TinyLearner, tmp_path: Path, prefix: str) -> None:
    root = tmp_path / "serving"
    publish_version(learner, root, "v1")
    nobody = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    settings = ServeSettings(port=0, publish_root=root, poll_s=0.1, lookup_counts_flush_s=3600)
    with ScoringService(settings, RedisSettings(url=nobody, prefix=prefix)) as svc:
        conn = connect(svc)
        statuses = [post(conn, "/v1/score", {"user_id": f"u{k}", "items": [1, 2]})[0] for k in range(5)]
        conn.close()
        assert svc.lookups is not None
        assert svc.lookups.flush() == 0  # kept for one retry
        reg = svc.metrics.registry
        assert reg.get_sample_value("streamrec_serving_lookup_counts_dropped_total", {"reason": "redis"}) == 0
        assert svc.lookups.flush() == 0  # the retry fails too: dropped
        assert statuses == [200] * 5
        assert reg.get_sample_value("streamrec_serving_lookup_counts_dropped_total", {"reason": "redis"}) == 15
        assert reg.get_sample_value("streamrec_serving_lookup_count_flushes_total", {"outcome": "error"}) == 2


def _members(ids: Sequence[object]) -> list[int]:
    return [hash_value(x) for x in ids]


def test_a_lookup_counts_write_trickled_past_its_timeout_fails_as_a_timeout_not_one_timeout_per_reply(
        stack: LocalStack, redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    """Redis trickles its replies (``tests/trickle_proxy.py``) under a lookup counts write of 120 chunks (one
    MULTI/EXEC): each reply (a QUEUED per chunk, the EXEC's array of ~490 bytes) arrives within
    ``lookup_counts_timeout_s``, the transaction's ~1,600 bytes in ~1.8 of it. Serving's counts client bounds the
    whole transaction: the write fails as a Redis timeout (the flush keeps it for its one retry) instead of holding the
    flush thread one timeout per reply."""
    timeout_s = ServeSettings().lookup_counts_timeout_s
    members, ones = np.arange(1, 121), np.ones(120, dtype=np.int64)
    day = int(time.time() * 1000) // DAY_MS
    with TrickleProxy(stack.s.redis_port, gap_s=timeout_s / 900) as proxy:
        svc = ScoringService(ServeSettings(port=0, publish_root=tmp_path, poll_s=3600),
                             RedisSettings(url=proxy.url, prefix=prefix))
        try:
            assert svc.lookups is not None
            counts = svc.lookups.counts
            counts.add_counts("item", "lookup", members, ones, day, chunk=1)  # healthy: the script loaded
            proxy.trickling = True
            try:
                with pytest.raises(redis.TimeoutError):
                    counts.add_counts("item", "lookup", members, ones, day, chunk=1)
            finally:
                proxy.trickling = False
        finally:
            svc.stop()


def test_the_hot_set_ranks_by_lookups_and_fills_from_impressions(redis_client: redis.Redis, prefix: str) -> None:
    counts = DailyCounts(redis_client, prefix=prefix)
    now_ms = int(time.time() * 1000)
    imp = _members(["a"] * 10 + ["b"] * 5 + ["c"])
    counts.record("item", "impression", imp, [now_ms - DAY_MS] * len(imp))  # the joiner's, event time yesterday
    impression_ranked = hot_set.compute(redis_client, prefix, 8, CFG, days=7, hot_items=3, hot_users=0,
                                        event="lookup")  # no lookup counts yet: the fallback is the whole ranking
    assert impression_ranked.stats["items_from_fallback"] == 3
    assert set(impression_ranked.rows) == set(hot_set.hot_rows(CFG, "item", [str(m) for m in _members("abc")]))

    looked_up = np.array(_members(["d", "e", "b"]), np.int64)
    counts.add_counts("item", "lookup", looked_up, np.array([100, 50, 1]), now_ms // DAY_MS)  # serving's, today
    hs = hot_set.compute(redis_client, prefix, 8, CFG, days=7, hot_items=4, hot_users=0, event="lookup")
    # by lookups d, e, b; then the top impression not already in: a
    assert hs.stats["items_from_fallback"] == 1
    assert set(hs.rows) == set(hot_set.hot_rows(CFG, "item", [str(m) for m in _members(["d", "e", "b", "a"])]))
    top, _, filled = hot_set.ranked_ids(counts, "item", "lookup", "impression", 7, 4)
    assert [int(m) for m, _ in top] == _members(["d", "e", "b", "a"]) and filled == 1
    # no fallback (fallback == event): only what serving looked up
    top, _, filled = hot_set.ranked_ids(counts, "item", "lookup", "lookup", 7, 4)
    assert [int(m) for m, _ in top] == _members(["d", "e", "b"]) and filled == 0
    # ranked by impressions, as before the lookups existed
    top, _, _ = hot_set.ranked_ids(counts, "item", "impression", "impression", 7, 3)
    assert [int(m) for m, _ in top] == _members(["a", "b", "c"])


def test_a_request_refused_for_an_unknown_dense_name_counts_no_lookups(
        stack, learner: TinyLearner, tmp_path: Path, prefix: str) -> None:
    root = tmp_path / "serving"
    publish_version(learner, root, "v1")
    settings = ServeSettings(port=0, publish_root=root, poll_s=0.1, lookup_counts_flush_s=3600)
    with ScoringService(settings, RedisSettings(url=stack.redis_url, prefix=prefix)) as svc:
        conn = connect(svc)
        bad = {"user_id": "alice", "items": [{"item_id": 3, "dense": {"no_such_feature": 1.0}}]}
        status, _ = post(conn, "/v1/score", bad)
        conn.close()
        assert status == 422
        assert svc.lookups is not None and svc.lookups.flush() == 0  # nothing was read for it


def test_lookups_that_stopped_days_before_the_impressions_do_not_rank_the_hot_set(
        redis_client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """Serving counted lookups six days ago, then stopped (counting switched off, flushes failing) while the joiner
    went on counting impressions up to today: the hot set is the impression-ranked one of today, not the lookups of
    six days ago (it was, with no sign but the day in the stats); a day behind is still ranked by lookups."""
    counts = DailyCounts(redis_client, prefix=prefix)
    now_ms = int(time.time() * 1000)
    today = now_ms // DAY_MS
    counts.add_counts("item", "lookup", np.array(_members(["old1", "old2"]), np.int64), np.array([9, 8]), today - 6)
    imp = _members(["a"] * 3 + ["b"] * 2)
    counts.record("item", "impression", imp, [now_ms] * len(imp))
    with caplog.at_level("WARNING", logger="streamrec.refresh"):
        hs = hot_set.compute(redis_client, prefix, 8, CFG, days=1, hot_items=2, hot_users=0, event="lookup")
    assert set(hs.rows) == set(hot_set.hot_rows(CFG, "item", [str(m) for m in _members(["a", "b"])]))
    assert hs.stats["item_stale_day"] == day_of((today - 6) * DAY_MS) and hs.stats["items_from_fallback"] == 2
    assert hs.stats["item_last_day"] == day_of(now_ms)
    assert "more than 1 day behind the impression counts" in caplog.text

    counts.add_counts("item", "lookup", np.array(_members(["new"]), np.int64), np.array([1]), today - 1)  # yesterday
    hs = hot_set.compute(redis_client, prefix, 8, CFG, days=1, hot_items=2, hot_users=0, event="lookup")
    assert hs.stats["item_stale_day"] is None and hs.stats["items_from_fallback"] == 1
    assert set(hs.rows) == set(hot_set.hot_rows(CFG, "item", [str(m) for m in _members(["new", "a"])]))


def _scans(client: redis.Redis) -> int:
    """SCAN commands Redis has run (INFO commandstats; what a wrapper of the client would miss: ``scan_iter``)."""
    return int(client.info("commandstats").get("cmdstat_scan", {}).get("calls", 0))


def test_one_hot_set_walks_the_keyspace_once_for_every_kind_and_event(redis_client: redis.Redis, prefix: str) -> None:
    """SCAN walks the whole keyspace whatever its MATCH (history has a key per user): the hot set of two kinds
    ranked by lookups, filled and checked for staleness by impressions, asked for the days of each kind and event
    again and again (16 walks here: 8 asks, each of the layout with hash tags and of the one before), where one walk
    lists them all."""
    counts = DailyCounts(redis_client, prefix=prefix)
    now_ms = int(time.time() * 1000)
    for kind in ("item", "user"):
        counts.record(kind, "impression", _members(["a", "b", "c"]), [now_ms] * 3)
        counts.add_counts(kind, "lookup", np.array(_members(["d"]), np.int64), np.array([5]), now_ms // DAY_MS)
    before = _scans(redis_client)
    list(redis_client.scan_iter(match=f"{prefix}:counts:*", count=1000))
    one_walk = _scans(redis_client) - before
    before = _scans(redis_client)
    hs = hot_set.compute(redis_client, prefix, 8, CFG, days=1, hot_items=2, hot_users=2, event="lookup")
    assert _scans(redis_client) - before == one_walk
    assert hs.stats["items_from_fallback"] == 1 and hs.stats["users_from_fallback"] == 1


def test_a_flush_that_fails_part_way_retries_only_the_lookups_it_did_not_write(
        redis_client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flush writes one (day, kind) at a time; Redis fills up (maxmemory) after the item lookups were written and
    refuses the user lookups: the item lookups are counted as flushed (all four were once counted as dropped, the
    items' in Redis all the same), and only the user lookup is kept and written by the next flush."""
    counts = DailyCounts(redis_client, prefix=prefix)
    lc = LookupCounts(counts, flush_s=60.0)
    lc.add("user", np.array(_members(["u1"]), np.int64))
    lc.add("item", np.array(_members(["i1", "i2", "i1"]), np.int64))
    out_of_memory_for(redis_client, counts, monkeypatch, "user")
    assert lc.flush() == 3  # sorted by (day, kind): the items, then the user
    assert (lc.flushed, lc.dropped) == (3, 0)
    assert lookups(redis_client, prefix, "item") == {_members(["i1"])[0]: 2, _members(["i2"])[0]: 1}
    assert lookups(redis_client, prefix, "user") == {}
    monkeypatch.undo()
    assert lc.flush() == 1
    assert (lc.flushed, lc.dropped) == (4, 0)
    assert lookups(redis_client, prefix, "user") == {_members(["u1"])[0]: 1}
    assert lookups(redis_client, prefix, "item") == {_members(["i1"])[0]: 2, _members(["i2"])[0]: 1}


def test_a_negative_item_in_a_users_history_costs_only_its_own_lookup_not_every_item_lookup_of_the_flush(
        stack, redis_client: redis.Redis, learner: TinyLearner, tmp_path: Path, prefix: str) -> None:
    """A history entry "ts:-7" (not the joiner's: its hashes are >= 0; any Redis client can write one) is read and
    scored as the learner saw it, but is no id the day counts take (``add_counts`` refuses a negative member): it once
    failed the whole item write of every flush holding it, every other item lookup then kept, retried and dropped as
    ``reason="redis"`` for as long as the user was scored."""
    root = tmp_path / "serving"
    publish_version(learner, root, "v1")
    redis_client.lpush(f"{prefix}:history:{hash_value('alice')}", f"1:{hash_value(100)}", "2:-7")
    settings = ServeSettings(port=0, publish_root=root, poll_s=0.1, lookup_counts_flush_s=3600,
                             redis_timeout_s=HISTORY_READ_S)
    with ScoringService(settings, RedisSettings(url=stack.redis_url, prefix=prefix)) as svc:
        conn = connect(svc)
        assert post(conn, "/v1/score", {"user_id": "alice", "items": [3, "x"]})[0] == 200
        conn.close()
        assert svc.lookups is not None
        assert svc.lookups.flush() == 4  # the user, both candidates, the history item 100
        reg = svc.metrics.registry
        assert reg.get_sample_value("streamrec_serving_lookup_counts_dropped_total", {"reason": "invalid"}) == 1
        assert reg.get_sample_value("streamrec_serving_lookup_counts_dropped_total", {"reason": "redis"}) == 0
        assert reg.get_sample_value("streamrec_serving_lookup_count_flushes_total", {"outcome": "error"}) == 0
    assert lookups(redis_client, prefix, "item") == {hash_value(3): 1, hash_value("x"): 1, hash_value(100): 1}
    assert lookups(redis_client, prefix, "user") == {hash_value("alice"): 1}


def test_a_lookup_day_key_of_another_redis_type_costs_only_its_own_kinds_lookups(
        redis_client: redis.Redis, prefix: str) -> None:
    """Today's item lookup key holds a string (another client's SET): Redis refuses that write (WRONGTYPE), the same
    at every try. Redis is up, so the user lookups behind it are still written: taken for a Redis that failed, they
    were skipped, kept, skipped again and dropped at every flush of the day."""
    counts = DailyCounts(redis_client, prefix=prefix)
    redis_client.set(counts.key("item", "lookup", day_of(int(time.time() * 1000))), "not a sorted set")
    lc = LookupCounts(counts, flush_s=60.0)
    lc.add("user", np.array(_members(["u1"]), np.int64))
    lc.add("item", np.array(_members(["i1", "i2"]), np.int64))
    assert lc.flush() == 1  # sorted by (day, kind): the refused items, then the user
    assert lookups(redis_client, prefix, "user") == {_members(["u1"])[0]: 1}
    lc.add("user", np.array(_members(["u1"]), np.int64))
    assert lc.flush() == 1
    assert lc.flush() == 0  # the items' second try, refused again: dropped
    assert (lc.flushed, lc.dropped) == (2, 2)
    assert lookups(redis_client, prefix, "user") == {_members(["u1"])[0]: 2}


def test_a_refused_day_key_is_dropped_as_refused_said_once_and_hides_no_later_outage_from_the_log(
        redis_client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A day key of another Redis type refuses every write of its kind all day: its lookups were dropped as
    ``reason="redis"`` (a Redis failure, which it is not), and the refusal's flush took the outage's one log line,
    so a real outage after it (Redis out of memory here) was never logged."""
    metrics = ServingMetrics(lambda: None)
    counts = DailyCounts(redis_client, prefix=prefix)
    key = counts.key("item", "lookup", day_of(int(time.time() * 1000)))
    redis_client.set(key, "not a sorted set")
    lc = LookupCounts(counts, metrics, flush_s=60.0)
    with caplog.at_level("INFO", logger="streamrec.serve"):
        for _ in range(3):  # the items' writes refused at each flush, each kept once and dropped at its second try
            lc.add("item", np.array(_members(["i1", "i2"]), np.int64))
            lc.flush()
        assert caplog.text.count("Redis refuses the writes to") == 1 and f"redis-cli DEL {key}" in caplog.text
        assert "a flush to Redis failed" not in caplog.text
        out_of_memory_for(redis_client, counts, monkeypatch, "user", "item")  # an outage
        lc.add("user", np.array(_members(["u1"]), np.int64))
        lc.flush()
        assert "a flush to Redis failed" in caplog.text
    dropped = {s.labels["reason"]: s.value for s in metrics.registry.collect() for s in s.samples
               if s.name == "streamrec_serving_lookup_counts_dropped_total"}
    assert dropped["refused"] == 6 and dropped["redis"] == 0  # (the third batch of items at its second try too)


def test_a_second_stop_after_a_last_flush_cut_off_by_a_trickling_redis_says_and_counts_nothing_more(
        stack: LocalStack, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """The first stop gives up on its last flush (Redis trickles past ``flush_timeout_s``); that flush ends on its own
    and counts its lookups dropped. A second stop (a caller's own ``stop`` inside ``with ScoringService``) found
    the failure of that flush and logged "the last flush to Redis failed ... before serving stopped", of a stop
    that made its last flush: it now returns, saying and counting nothing.

    The client's own deadline (each whole reply) is five times the stop's wait: with the two equal, the flush could
    fail on its own before a loaded machine woke the stop's wait, and the stop found no flush to abandon."""
    timeout_s, wait_s = 1.0, 0.2
    with TrickleProxy(stack.s.redis_port, gap_s=timeout_s / 20) as proxy:
        client = connect_redis(RedisSettings(url=proxy.url), timeout_s=timeout_s, retries=0, whole_reply=True)
        try:
            lc = LookupCounts(DailyCounts(client, prefix=prefix), flush_s=3600, flush_timeout_s=wait_s)
            lc.add("item", np.arange(1, 200, dtype=np.int64))
            proxy.trickling = True
            try:
                lc.stop()
                assert lc._abandoned is not None
                lc._abandoned.join()  # the cut-off flush ends: its lookups dropped and counted
            finally:
                proxy.trickling = False
            assert (lc.flushed, lc.dropped) == (0, 199)
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="streamrec.serve"):
                lc.stop()
            assert [r.getMessage() for r in caplog.records] == []
            assert (lc.flushed, lc.dropped) == (0, 199)
        finally:
            client.close()


def test_a_refused_write_whose_markers_key_is_of_another_type_names_that_key_not_the_lookup_counts_to_delete(
        redis_client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """The write's script also reads its markers hash (``stream/counts.py``, "Retries"): another client's string there
    refuses the write (WRONGTYPE) as a string under the day key does. The warning named the day key, whose counts are
    good, and told to DEL it: that lost the day's lookups and the refusals went on."""
    counts = DailyCounts(redis_client, prefix=prefix)
    day = day_of(int(time.time() * 1000))
    markers = counts._markers_key("item", "lookup", day)
    redis_client.set(markers, "not a hash")
    lc = LookupCounts(counts, flush_s=60.0)
    lc.add("item", np.array(_members(["i1"]), np.int64))
    with caplog.at_level("WARNING", logger="streamrec.serve"):
        assert lc.flush() == 0
    assert f"redis-cli DEL {markers}" in caplog.text
    assert f"redis-cli DEL {counts.key('item', 'lookup', day)}" not in caplog.text


def test_a_flush_with_a_refusal_and_an_outage_logs_the_outage_by_its_own_error(
        redis_client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One flush: the item day key is another client's string (refused, said on its own line), then Redis fills up
    (OOM) at the user write: an outage. Its one line named the refusal's WRONGTYPE as the failure, not the OOM."""
    counts = DailyCounts(redis_client, prefix=prefix)
    redis_client.set(counts.key("item", "lookup", day_of(int(time.time() * 1000))), "not a sorted set")
    lc = LookupCounts(counts, flush_s=60.0)
    lc.add("user", np.array(_members(["u1"]), np.int64))
    lc.add("item", np.array(_members(["i1"]), np.int64))
    out_of_memory_for(redis_client, counts, monkeypatch, "user")
    with caplog.at_level("WARNING", logger="streamrec.serve"):
        assert lc.flush() == 0
    failed = [r.getMessage() for r in caplog.records if "a flush to Redis failed" in r.getMessage()]
    assert len(failed) == 1 and "OutOfMemoryError" in failed[0] and "WRONGTYPE" not in failed[0], failed


def test_a_stop_just_after_an_outage_drops_the_refused_writes_it_kept_as_refused_not_as_redis(
        redis_client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flush: the item day key refused (another client's string), the user write failed (OOM), both kept. A stop
    just after it makes no last flush (Redis just failed) and drops what was kept: the refused items were counted as
    ``reason="redis"``, a Redis failure they are not."""
    metrics = ServingMetrics(lambda: None)
    counts = DailyCounts(redis_client, prefix=prefix)
    redis_client.set(counts.key("item", "lookup", day_of(int(time.time() * 1000))), "not a sorted set")
    lc = LookupCounts(counts, metrics, flush_s=60.0)
    lc.add("user", np.array(_members(["u1"]), np.int64))
    lc.add("item", np.array(_members(["i1", "i2"]), np.int64))
    out_of_memory_for(redis_client, counts, monkeypatch, "user")
    assert lc.flush() == 0
    lc.stop()
    dropped = {s.labels["reason"]: s.value for s in metrics.registry.collect() for s in s.samples
               if s.name == "streamrec_serving_lookup_counts_dropped_total"}
    assert (dropped["refused"], dropped["redis"]) == (2, 1)
    assert (lc.flushed, lc.dropped) == (0, 3)
