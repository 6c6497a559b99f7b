"""Per-day counts and user click history against the real Redis of the session stack."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import redis

from stream.counts import DailyCounts
from stream.counts_keys import DAY_S, day_of
from stream.history import ENTRY_MAX_BYTES, REDO_SLACK, UserHistory
from stream.metrics import HISTORY_MALFORMED


def ms(y: int, mo: int, d: int, h: int = 0, mi: int = 0, s: int = 0, milli: int = 0) -> int:
    return int(dt.datetime(y, mo, d, h, mi, s, tzinfo=dt.timezone.utc).timestamp()) * 1000 + milli


@pytest.fixture
def prefix(redis_client: redis.Redis) -> Iterator[str]:
    p = f"test-{uuid.uuid4().hex[:12]}"
    yield p
    keys = list(redis_client.scan_iter(match=f"{p}:*", count=1000))
    if keys:
        redis_client.delete(*keys)


class PipelineSpy:
    """Wraps ``client.pipeline`` (the real one: commands still go to Redis) and records, per executed
    pipeline, the command names it sent; direct (non-pipelined) commands are counted too."""

    def __init__(self, client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pipelines: list[list[str]] = []
        self.direct: list[str] = []
        real_pipeline, real_execute_command = client.pipeline, client.execute_command

        def pipeline(*args, **kwargs):
            pipe = real_pipeline(*args, **kwargs)
            real_execute = pipe.execute

            def execute(*a, **kw):
                self.pipelines.append([str(cmd[0][0]).upper() for cmd in pipe.command_stack])
                return real_execute(*a, **kw)

            pipe.execute = execute
            return pipe

        def execute_command(*args, **kwargs):
            self.direct.append(str(args[0]).upper())
            return real_execute_command(*args, **kwargs)

        monkeypatch.setattr(client, "pipeline", pipeline)
        monkeypatch.setattr(client, "execute_command", execute_command)


# -- counts ----------------------------------------------------------------------------------------
def test_counts_split_on_the_utc_day_of_each_event(redis_client: redis.Redis, prefix: str) -> None:
    counts = DailyCounts(redis_client, prefix=prefix)
    before, midnight = ms(2000, 12, 31, 23, 59, 59, 999), ms(2001, 1, 1)
    assert (day_of(before), day_of(midnight)) == ("20001231", "20010101")
    counts.record("item", "impression", [7, "7", 8, 7, "x"], [before, before, before, midnight, midnight])

    assert counts.days_available("item", "impression") == ["20001231", "20010101"]
    assert counts.days_available("item", "click") == []
    assert counts.days_available("user", "impression") == []
    old = counts.key("item", "impression", "20001231")
    new = counts.key("item", "impression", "20010101")
    assert old == f"{prefix}:counts:{{item}}:impression:20001231"  # {item}: the kind's Redis Cluster hash tag
    # 7 and "7" are the same id (the canonical text stream.ids hashes)
    assert {m.decode(): s for m, s in redis_client.zrange(old, 0, -1, withscores=True)} == {"7": 2.0, "8": 1.0}
    assert {m.decode(): s for m, s in redis_client.zrange(new, 0, -1, withscores=True)} == {"7": 1.0, "x": 1.0}

    # a second batch adds to the same keys
    counts.record("item", "impression", np.array([8, 8]), np.array([before, before], dtype=np.int64))
    assert redis_client.zscore(old, "8") == 3.0


def test_top_orders_by_count_and_honours_k(redis_client: redis.Redis, prefix: str) -> None:
    counts = DailyCounts(redis_client, prefix=prefix)
    t = ms(2000, 6, 1, 12)
    counts.record("user", "click", ["a"] * 5 + ["b"] * 3 + ["c"], [t] * 9)
    counts.record("user", "click", ["old"] * 50, [t - DAY_S * 1000] * 50)  # an earlier day

    assert counts.top("user", "click", k=2) == [("a", 5.0), ("b", 3.0)]  # day defaults to the latest day
    assert counts.top("user", "click", day="20000601", k=10) == [("a", 5.0), ("b", 3.0), ("c", 1.0)]
    assert counts.top("user", "click", day="20000531", k=1) == [("old", 50.0)]
    assert counts.top("user", "click", day="19990101") == []
    assert counts.top("user", "impression") == []  # nothing recorded at all
    assert counts.top("item", "click") == []


def test_top_merges_consecutive_days(redis_client: redis.Redis, prefix: str) -> None:
    counts = DailyCounts(redis_client, prefix=prefix)
    d1, d2, d3, d5 = ms(2000, 2, 28, 5), ms(2000, 2, 29, 5), ms(2000, 3, 1, 5), ms(2000, 3, 3, 5)
    counts.record("item", "impression", ["a", "b", "b", "b", "b", "b"], [d1] * 6)
    counts.record("item", "impression", ["a", "a", "a", "c", "c"], [d2] * 5)
    counts.record("item", "impression", ["z"] * 100, [d3] * 100)
    counts.record("item", "impression", ["a"], [d5])

    assert counts.days_available("item", "impression") == ["20000228", "20000229", "20000301", "20000303"]
    # Feb 29 of a leap year and the day before it; Mar 1 (z) is outside the window
    assert counts.top("item", day="20000229", days=2) == [("b", 5.0), ("a", 4.0), ("c", 2.0)]
    assert counts.top("item", day="20000229", days=1) == [("a", 3.0), ("c", 2.0)]
    # missing days inside the window count as empty
    assert counts.top("item", day="20000229", days=30, k=2) == [("b", 5.0), ("a", 4.0)]
    # default day = the latest (Mar 3); Mar 2 is missing, Mar 1 is in a 3-day window
    assert counts.top("item", days=3) == [("z", 100.0), ("a", 1.0)]
    assert counts.top("item", days=5) == [("z", 100.0), ("b", 5.0), ("a", 5.0), ("c", 2.0)]
    # the temporary union keys are gone
    assert list(redis_client.scan_iter(match=f"{prefix}:counts:*tmp*")) == []


def test_keys_expire_relative_to_their_day_but_never_in_the_past(redis_client: redis.Redis, prefix: str) -> None:
    ttl_days = 3
    counts = DailyCounts(redis_client, prefix=prefix, ttl_days=ttl_days)
    counts.record("item", "impression", [1], [ms(2000, 1, 1, 12)])  # MovieLens era: own-day expiry is long past
    now = time.time()
    counts.record("item", "click", [1], [int(now * 1000)])  # today: ttl_days after the end of today

    old_ttl = redis_client.ttl(counts.key("item", "impression", "20000101"))
    assert ttl_days * DAY_S - 10 <= old_ttl <= ttl_days * DAY_S
    today = day_of(int(now * 1000))
    new_ttl = redis_client.ttl(counts.key("item", "click", today))
    end_of_today = (int(now) // DAY_S + 1) * DAY_S
    expected = end_of_today + ttl_days * DAY_S - now
    assert ttl_days * DAY_S < new_ttl <= (ttl_days + 1) * DAY_S
    assert abs(new_ttl - expected) <= 10
    # the rule itself, with a fixed clock: yesterday's key still ends ttl_days after yesterday ended
    day_index = int(now) // DAY_S
    assert counts.expire_at(day_index - 1, now_s=now) == max((day_index + ttl_days) * DAY_S,
                                                             int(now) + ttl_days * DAY_S)
    assert counts.expire_at(day_index + 10, now_s=now) == (day_index + 10 + ttl_days + 1) * DAY_S


def test_record_is_one_pipeline_of_aggregated_commands(
    redis_client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = DailyCounts(redis_client, prefix=prefix)
    t = ms(2000, 5, 5, 23, 59)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 3, size=1000)  # 3 distinct ids
    ts = np.where(rng.random(1000) < 0.5, t, t + 120_000)  # 2 days
    spy = PipelineSpy(redis_client, monkeypatch)
    counts.record("item", "impression", ids, ts)
    counts.record("item", "impression", [], [])  # empty batch: no round trip at all
    monkeypatch.undo()

    # one pipeline, one script call per day key (the ZINCRBYs of the 3 aggregated ids run inside it)
    assert [c for c in spy.direct if c not in ("SCRIPT LOAD", "SCRIPT")] == []
    assert len(spy.pipelines) == 1 and spy.pipelines[0] == ["EVALSHA"] * 2
    assert sorted(n for _, n in counts.top("item", day="20000506", k=10)) == sorted(
        Counter(ids[ts == t + 120_000].tolist()).values())
    total = sum(s for _, s in counts.top("item", day="20000506", days=2, k=10))
    assert total == 1000.0


def test_bad_arguments_name_the_argument(redis_client: redis.Redis, prefix: str) -> None:
    counts = DailyCounts(redis_client, prefix=prefix)
    t = ms(2000, 1, 1)
    cases = [
        ("'kind'", lambda: counts.record("movie", "impression", [1], [t])),
        ("'event'", lambda: counts.record("item", "view", [1], [t])),
        ("'ts_ms'", lambda: counts.record("item", "click", [1, 2], [t])),
        ("'ts_ms'", lambda: counts.record("item", "click", [1], [-5])),
        ("'ts_ms'", lambda: counts.record("item", "click", [1], [1.5])),
        ("'ids'", lambda: counts.record("item", "click", [1, None], [t, t])),
        ("'ids'", lambda: counts.record("item", "click", [""], [t])),
        ("'ids'", lambda: counts.record("item", "click", [-1], [t])),
        ("'kind'", lambda: counts.top("items")),
        ("'event'", lambda: counts.top("item", "clicks")),
        ("'day'", lambda: counts.top("item", day="2000-01-01")),
        ("'day'", lambda: counts.top("item", day="20001332")),
        ("'days'", lambda: counts.top("item", day="20000101", days=0)),
        ("'k'", lambda: counts.top("item", k=0)),
        ("'k'", lambda: counts.top("item", k=2.5)),
        ("'kind'", lambda: counts.days_available("users", "click")),
        ("'ttl_days'", lambda: DailyCounts(redis_client, ttl_days=0)),
        ("'prefix'", lambda: DailyCounts(redis_client, prefix="")),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=name):
            call()
    assert list(redis_client.scan_iter(match=f"{prefix}:*")) == []  # nothing was half-written


# -- history ---------------------------------------------------------------------------------------
def test_as_of_never_sees_clicks_at_or_after_the_impression(redis_client: redis.Redis, prefix: str) -> None:
    hist = UserHistory(redis_client, prefix=prefix)
    user, ts = 42, ms(2000, 1, 1, 12)
    # the impression's own click (after it), a click at exactly ts, and earlier clicks
    hist.append_many([user] * 4, [101, 102, 103, 104], [ts - 60_000, ts - 1, ts, ts + 1])
    assert hist.as_of([user], [ts]) == [[101, 102]]
    assert hist.as_of([user], [ts + 1]) == [[101, 102, 103]]
    assert hist.as_of([user], [ts + 2]) == [[101, 102, 103, 104]]
    assert hist.as_of([user], [ts - 60_000]) == [[]]
    assert hist.as_of([999], [ts]) == [[]]  # unknown user
    assert hist.recent(user) == [101, 102, 103, 104]
    assert redis_client.lrange(hist.key(user), 0, -1)[0] == f"{ts + 1}:104".encode()  # newest first in Redis


def test_history_is_bounded_and_newest_last(redis_client: redis.Redis, prefix: str) -> None:
    hist = UserHistory(redis_client, prefix=prefix, max_len=3)
    t = ms(2000, 1, 1)
    hist.append_many([1] * 5, [10, 11, 12, 13, 14], [t + i for i in range(5)])
    assert redis_client.llen(hist.key(1)) == 3
    assert hist.recent(1) == [12, 13, 14]
    hist.append_many([1], [15], [t + 5])
    assert hist.recent(1) == [13, 14, 15]
    assert hist.as_of([1, 1], [t + 100, t + 5]) == [[13, 14, 15], [13, 14]]


# The slack a history's TTL may have run down between the append and the TTL read (a slow, shared CI machine).
TTL_SLACK_S = 60


def assert_expires_in(client: redis.Redis, key: str, ttl_s: int) -> None:
    """``key`` expires within (ttl_s - TTL_SLACK_S, ttl_s] seconds from now."""
    got = client.ttl(key)
    assert ttl_s - TTL_SLACK_S < got <= ttl_s, (key, got, ttl_s)


def test_an_append_expires_the_history_ttl_days_from_now_not_from_its_event_time(
    redis_client: redis.Redis, prefix: str
) -> None:
    """Every user's list used to be kept for ever (TTL -1): Redis grew with every user ever seen. Clicks of 2000 (a
    replay) still live ttl_days from now: the expiry is wall clock."""
    hist = UserHistory(redis_client, prefix=prefix, ttl_days=2)
    t = ms(2000, 1, 1)
    hist.append_many([1, 2, 1], [10, 20, 11], [t, t + 1, t + 2])
    for user in (1, 2):
        assert_expires_in(redis_client, hist.key(user), 2 * DAY_S)
    assert hist.recent(1) == [10, 11]
    UserHistory(redis_client, prefix=prefix).append_many([3], [30], [t])  # the default: 30 days, as the setting's
    assert_expires_in(redis_client, hist.key(3), 30 * DAY_S)


def test_a_later_append_slides_the_expiry_forward_so_an_active_user_keeps_the_history(
    redis_client: redis.Redis, prefix: str
) -> None:
    hist = UserHistory(redis_client, prefix=prefix, ttl_days=2)
    hist.append_many([1, 2], [10, 20], [1, 2])
    redis_client.expire(hist.key(1), 100)  # as if the user had been idle for almost two days
    redis_client.expire(hist.key(2), 100)
    hist.append_many([1], [11], [3])  # user 1 clicks again; user 2 stays idle
    assert_expires_in(redis_client, hist.key(1), 2 * DAY_S)
    assert 0 < redis_client.ttl(hist.key(2)) <= 100
    assert hist.recent(1) == [10, 11]


def test_history_ttl_days_0_never_expires_a_history_and_persists_one_that_had_an_expiry(
    redis_client: redis.Redis, prefix: str
) -> None:
    UserHistory(redis_client, prefix=prefix, ttl_days=7).append_many([2], [20], [1])  # written under a TTL before
    hist = UserHistory(redis_client, prefix=prefix, ttl_days=0)
    hist.append_many([1, 2], [10, 21], [1, 2])
    assert redis_client.ttl(hist.key(1)) == -1
    assert redis_client.ttl(hist.key(2)) == -1  # expiry turned off: the lists it appends to are kept
    assert hist.recent(2) == [20, 21]


def test_a_key_that_is_not_a_list_is_not_given_an_expiry_by_a_failed_append(
    redis_client: redis.Redis, prefix: str
) -> None:
    hist = UserHistory(redis_client, prefix=prefix, ttl_days=2)
    redis_client.set(hist.key(2), "not a list")  # someone else's key: its expiry is not ours to set
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        hist.append_many([1, 2], [10, 20], [1, 2])
    assert redis_client.ttl(hist.key(2)) == -1
    assert_expires_in(redis_client, hist.key(1), 2 * DAY_S)


@pytest.mark.parametrize("ttl_days", [-1, 3_651, True, 1.5])
def test_a_history_ttl_out_of_range_is_refused_naming_the_argument(redis_client: redis.Redis, ttl_days: object) -> None:
    with pytest.raises(ValueError, match="'ttl_days'.*0-3650"):
        UserHistory(redis_client, ttl_days=ttl_days)  # type: ignore[arg-type]


def test_appends_and_reads_are_one_command_each_for_every_user(
    redis_client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    hist = UserHistory(redis_client, prefix=prefix)
    t = ms(2000, 1, 1)
    users = np.array([1, 2, 1, 3, 2, 1], dtype=np.int64)
    items = np.array([100, 200, 101, 300, 201, 102], dtype=np.int64)
    times = np.array([t + 10, t + 20, t + 30, t + 40, t + 50, t + 60], dtype=np.int64)
    spy = PipelineSpy(redis_client, monkeypatch)
    hist.append_many(users, items, times)
    got = hist.as_of([1, 2, 1, 3, 2, 4], [t + 31, t + 31, t + 1000, t + 40, t + 1000, t + 1000])
    monkeypatch.undo()

    assert got == [[100, 101], [200], [100, 101, 102], [], [200, 201], []]
    # the appends and then the reads: one script call each (EVALSHA, or SCRIPT LOAD + EVALSHA the first time), for
    # the three users appended to and the four read
    assert spy.pipelines == [] and [c for c in spy.direct if c not in ("SCRIPT LOAD", "SCRIPT")] == ["EVALSHA"] * 2
    assert hist.as_of([], []) == []


@pytest.mark.parametrize("appends", [2, 5])
def test_a_batch_appended_again_takes_no_room_so_the_older_clicks_are_still_read(
        redis_client: redis.Redis, prefix: str, appends: int) -> None:
    """A joiner batch done again (a rewind after a failure, a crash between its history write and its commit, a
    rebalance) appends its clicks again. They were pushed again: readers read each once, but the copies took the room
    of the user's oldest clicks, which fell off the list (with one redo here, 10 and 11; with four, all of 10-13) and
    which as-of reads then lost. A list appended the batch ``appends`` times now reads as appended once."""
    h = UserHistory(redis_client, prefix=prefix, max_len=8)
    t = ms(2000, 1, 1)
    h.append_many([1] * 6, list(range(10, 16)), [t + i for i in range(6)])  # the list near max_len
    batch = ([1, 2, 1], [16, 20, 17], [t + 6, t + 6, t + 7])
    for _ in range(appends):
        h.append_many(*batch)
    every = list(range(10, 18))
    assert h.as_of([1, 1, 2], [t + 100, t + 3, t + 100]) == [every, [10, 11, 12], [20]]
    assert redis_client.llen(h.key(1)) == 8 and redis_client.llen(h.key(2)) == 1
    flat, offsets = h.as_of_flat_later([1, 1], [t + 100, t + 3])()
    assert flat.tolist() == [*every, 10, 11, 12] and offsets.tolist() == [0, 8, 11]
    h.append_many([1], [18], [t + 8])  # a new click still pushes the oldest out
    assert h.recent(1) == list(range(11, 19))


def test_a_batch_redone_after_other_partitions_appended_clicks_of_the_user_is_found_up_to_redo_slack_of_them(
        redis_client: redis.Redis, prefix: str) -> None:
    """Between a batch and its redo other partitions' workers may append clicks of the same user: the redo rule
    searches the list's newest n + REDO_SLACK entries, so with REDO_SLACK of them in between nothing is pushed again;
    with one more, the batch's first click has left that head and is pushed again (the bound the module docstring
    states), which readers still read once."""
    h = UserHistory(redis_client, prefix=prefix, max_len=4 * REDO_SLACK)
    batch = ([1, 1], [10, 11], [1, 2])
    h.append_many(*batch)
    h.append_many([1] * REDO_SLACK, list(range(100, 100 + REDO_SLACK)), list(range(3, 3 + REDO_SLACK)))
    h.append_many(*batch)
    assert redis_client.llen(h.key(1)) == 2 + REDO_SLACK
    h.append_many([1], [99], [1000])  # one more newer click: "1:10" is now n + REDO_SLACK + 1 deep
    h.append_many(*batch)
    assert redis_client.lrange(h.key(1), 0, 0) == [b"1:10"] and redis_client.llen(h.key(1)) == 4 + REDO_SLACK
    assert h.recent(1) == [10, 11, *range(100, 100 + REDO_SLACK), 99]


def test_a_batch_of_more_clicks_of_a_user_than_max_len_redone_leaves_the_list_as_appended_once(
        redis_client: redis.Redis, prefix: str) -> None:
    """A batch with more clicks of one user than the list keeps (a replay's burst: ML-1M users rate hundreds of films
    within minutes) keeps its newest ``max_len``; its oldest ones were trimmed in the same script. A redo searched the
    head for those trimmed ones, did not find them and pushed them again over the batch's newer clicks: the list then
    held the batch's two oldest clicks and lost two of its newest kept ones (the reads' features changed with each
    redo). A redo now changes nothing."""
    h = UserHistory(redis_client, prefix=prefix, max_len=4)
    batch = ([1] * 6, list(range(10, 16)), list(range(1, 7)))
    h.append_many(*batch)
    once = redis_client.lrange(h.key(1), 0, -1)
    assert once == [b"6:15", b"5:14", b"4:13", b"3:12"]
    h.append_many(*batch)
    assert redis_client.lrange(h.key(1), 0, -1) == once
    assert h.recent(1) == [12, 13, 14, 15]


def test_the_same_click_twice_in_one_batch_is_stored_once(redis_client: redis.Redis, prefix: str) -> None:
    """Two entries alike (the same item at the same millisecond: two impressions of it clicked at once) are one click
    for every reader (``_parse``), so the second takes no room either."""
    h = UserHistory(redis_client, prefix=prefix, max_len=3)
    h.append_many([1, 1, 1, 1, 1], [10, 11, 11, 12, 12], [1, 2, 2, 3, 3])
    assert redis_client.lrange(h.key(1), 0, -1) == [b"3:12", b"2:11", b"1:10"]


def test_out_of_order_appends_are_ordered_by_click_time(redis_client: redis.Redis, prefix: str) -> None:
    hist = UserHistory(redis_client, prefix=prefix)
    t = ms(2000, 1, 1)
    hist.append_many([5, 5], [300, 100], [t + 300, t + 100])
    hist.append_many([5], [200], [t + 200])  # a late click, appended after a newer one
    assert hist.recent(5) == [100, 200, 300]
    assert hist.as_of([5, 5, 5], [t + 250, t + 200, t + 301]) == [[100, 200], [100], [100, 200, 300]]


def test_history_bad_arguments_name_the_argument(redis_client: redis.Redis, prefix: str) -> None:
    hist = UserHistory(redis_client, prefix=prefix)
    cases = [
        ("'item_hashes'", lambda: hist.append_many([1, 2], [1], [1, 2])),
        ("'click_ts'", lambda: hist.append_many([1], [1], [1, 2])),
        ("'ts_ms'", lambda: hist.as_of([1, 2], [1])),
        ("'user_hashes'", lambda: hist.as_of(["u"], [1])),
        ("'user_hash'", lambda: hist.recent("u")),
        ("'max_len'", lambda: UserHistory(redis_client, max_len=0)),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=name):
            call()


def test_a_wrong_clock_neither_counts_nor_becomes_the_latest_day(redis_client: redis.Redis, prefix: str) -> None:
    counts = DailyCounts(redis_client, prefix=prefix, future_s=3600)
    now_ms = int(time.time() * 1000)
    counts.record("item", "impression", [1, 2, 3], [now_ms - DAY_S * 1000, now_ms, now_ms + 30 * DAY_S * 1000])
    assert counts.future_dropped == 1
    # A key of a future day written by someone else's wrong clock is not the hot set's latest day either.
    redis_client.zincrby(counts.key("item", "impression", day_of(now_ms + 400 * DAY_S * 1000)), 1, "9")
    assert counts.days_available("item", "impression")[-1] in (day_of(now_ms), day_of(now_ms + 3_600_000))
    assert counts.top("item", "impression", k=3) == [("2", 1.0)]  # today: id 2 only, never the future 3 or 9


def test_in_the_last_hour_of_a_day_tomorrow_is_not_the_latest_day_before_it_starts(
        redis_client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At 23:30 one event 40 minutes ahead (inside ``future_s``, so counted) writes tomorrow's key. The latest day was
    capped at the day of now + ``future_s``, tomorrow: its one id became the hot set's source (a 7-day window ending
    there dropped the oldest full day for a near-empty one) for the last hour of every day."""
    today = int(time.time()) // DAY_S * DAY_S
    monkeypatch.setattr("stream.counts.time", SimpleNamespace(time=lambda: today + DAY_S - 1800.0,  # 23:30 UTC
                                                              sleep=time.sleep))
    counts = DailyCounts(redis_client, prefix=prefix, future_s=3600)
    at = (today + DAY_S - 1800) * 1000
    counts.record("item", "impression", [1, 1, 2, 3], [at - 5000, at - 4000, at - 3000, at + 2_400_000])
    assert counts.future_dropped == 0  # tomorrow's event is counted, on tomorrow's key
    assert counts.days_available("item", "impression") == [day_of(at)]
    assert counts.top("item", "impression", k=3) == [("1", 2.0), ("2", 1.0)]


def test_a_malformed_history_entry_is_skipped_not_an_error(redis_client: redis.Redis, prefix: str) -> None:
    h = UserHistory(redis_client, prefix=prefix, max_len=10)
    h.append_many([5, 5], [100, 200], [1000, 2000])
    redis_client.lpush(h.key(5), "garbage", "12:notanint", b"\xff\xfe", "1500")
    redis_client.set(h.key(6), "not a list")  # a key of the wrong type
    assert h.as_of([5, 6], [3000, 3000]) == [[100, 200], []]
    assert h.recent(5) == [100, 200]


@pytest.mark.parametrize("odd", ["+1500:300", " 1500:300", "1500:300 ", "1500:300\n", "1_500:300", "1500:3_00",
                                 "1500:+300", "\u0661\u0665\u0660\u0660:300", "1500:\uff13\uff10\uff10"])
def test_an_entry_python_int_reads_but_the_joiner_never_writes_is_malformed_not_a_click(
        redis_client: redis.Redis, prefix: str, odd: str) -> None:
    """An entry with a sign, blanks, underscores or another script's digits is no "{ts}:{item}" the joiner writes (a
    damaged or foreign one): it was read as a click of item 300 (Python's int() reads them all), in every read of the
    user and uncounted. It is skipped and counted as malformed, as every other such entry is."""
    h = UserHistory(redis_client, prefix=prefix, max_len=10)
    h.append_many([5, 5], [100, 200], [1000, 2000])
    redis_client.lpush(h.key(5), odd)
    before = HISTORY_MALFORMED._value.get()
    assert h.recent(5) == [100, 200] and h.as_of([5], [3000]) == [[100, 200]]
    assert HISTORY_MALFORMED._value.get() == before + 2


def _net_output_bytes(client: redis.Redis) -> int:
    return int(client.info("stats")["total_net_output_bytes"])


def test_a_huge_history_entry_reads_as_one_malformed_entry_and_its_bytes_stay_in_redis(
        redis_client: redis.Redis, prefix: str) -> None:
    """Another client's 20 MB entry under a user's key (and a list of several big ones under another's) was sent
    whole by every history read: each serving request and joiner batch for that user pulled it through the socket.
    It reads as one malformed entry each, the users' other clicks as before, and the replies stay small."""
    h = UserHistory(redis_client, prefix=prefix, max_len=10)
    h.append_many([5, 5, 6], [100, 200, 300], [1000, 2000, 1500])
    redis_client.lpush(h.key(5), b"1500:" + b"7" * 20_000_000)
    redis_client.lpush(h.key(6), *[b"9" * 5_000_000] * 4)
    before_malformed, before_bytes = HISTORY_MALFORMED._value.get(), _net_output_bytes(redis_client)
    assert h.as_of([5, 6], [3000, 3000]) == [[100, 200], [300]]  # the joiner's read
    assert h.as_of_later([5], [2**62])() == [[100, 200]]  # serving's
    assert h.as_of_later([6], [2**62])() == [[300]]
    sent = _net_output_bytes(redis_client) - before_bytes
    assert sent < 20 * 10 * ENTRY_MAX_BYTES + 10_000, sent  # three replies of at most 10 short entries, and INFO's
    assert HISTORY_MALFORMED._value.get() - before_malformed == 1 + 4 + 1 + 4
    entries = [e for got in h._lrange([5, 6]) for e in got]
    assert len(entries) == 3 + 5 and max(map(len, entries)) <= ENTRY_MAX_BYTES


def test_as_of_later_sends_now_and_answers_as_as_of(redis_client: redis.Redis, prefix: str) -> None:
    h = UserHistory(redis_client, prefix=prefix, max_len=10)
    t = ms(2000, 1, 1)
    h.append_many([1, 2, 1, 1], [10, 20, 11, 12], [t + 1, t + 2, t + 3, t + 4])
    redis_client.set(h.key(6), "not a list")  # a key of the wrong type: no history, as as_of
    pool = redis_client.connection_pool
    for users, times in (([1], [t + 4]), ([1, 2, 6, 9, 1], [t + 100] * 4 + [t + 2]), ([1], [t + 100])):
        collect = h.as_of_later(users, times, limit=2)
        assert len(pool._in_use_connections) == 1  # the read is out, its answer pending on a pooled connection
        redis_client.ping()  # the pending answer is not read by anyone else: another connection serves this
        assert collect() == h.as_of(users, times, limit=2)
        assert collect() == h.as_of(users, times, limit=2)  # a second call: the same lists, nothing read again
        assert len(pool._in_use_connections) == 0
    redis_client.script_flush()  # a Redis that forgot the script (restarted, flushed): NOSCRIPT, loaded, read again
    assert h.as_of_later([1], [t + 100])() == [[10, 11, 12]]
    assert len(pool._in_use_connections) == 0
    with pytest.raises(ValueError, match="'ts_ms'"):
        h.as_of_later([1, 2], [1])


def test_as_of_later_timed_out_leaves_no_answer_on_the_pooled_connection(redis_client: redis.Redis,
                                                                          prefix: str) -> None:
    """A read that times out is disconnected, not given back with its answer still coming: the next read on the
    same pool gets its own answer."""
    client = redis.Redis(connection_pool=redis.ConnectionPool(
        **{**redis_client.connection_pool.connection_kwargs, "socket_timeout": 0.1}))
    try:
        h = UserHistory(client, prefix=prefix, max_len=10)
        h.append_many([1, 2], [10, 20], [1000, 2000])
        h.as_of([1], [3000])  # the script loaded
        # paused far longer than the read's 0.1 s timeout, and waited out by a PING Redis holds until the pause ends:
        # a 400 ms pause waited out by a 0.5 s sleep let a read sent later than 400 ms after it (this process
        # without a CPU for a while on a loaded machine) be answered, not time out
        redis_client.execute_command("CLIENT", "PAUSE", "2000", "ALL")
        collect = h.as_of_later([1], [3000])
        with pytest.raises(redis.TimeoutError):
            collect()
        with pytest.raises(redis.TimeoutError):  # the same error again, nothing read twice
            collect()
        redis_client.ping()  # the pause is over: the first read's answer went to a closed socket
        assert len(client.connection_pool._in_use_connections) == 0
        assert h.as_of_later([2], [3000])() == [[20]]
    finally:
        client.close()


def test_as_of_the_far_future_is_every_stored_click(redis_client: redis.Redis, prefix: str) -> None:
    """Serving reads "as of" 2**62 (every click): the one-user shortcut, the batch path and the per-user path (a
    malformed entry: skipped) agree with reads as of a time just past the last click."""
    h = UserHistory(redis_client, prefix=prefix, max_len=30)
    t = ms(2000, 1, 1)
    clicks = {1: 20, 2: 3, 3: 0}
    for u, n in clicks.items():
        h.append_many([u] * n, [u * 1000 + i for i in range(n)], [t + (i * 7919) % 23 for i in range(n)])
    far, near = 2**62, t + 100
    for users in ([1], [2], [3], [1, 1], [1, 2, 3, 1]):
        for limit in (None, 0, 5):
            assert h.as_of(users, [far] * len(users), limit) == h.as_of(users, [near] * len(users), limit)
            assert h.as_of_later(users, [far] * len(users), limit)() == h.as_of(users, [near] * len(users), limit)
    redis_client.lpush(h.key(1), "garbage")
    assert h.as_of([1], [far]) == h.as_of([1], [near]) and len(h.as_of([1], [far])[0]) == 20
    assert h.as_of([1, 2], [far, far]) == h.as_of([1, 2], [near, near])


def test_as_of_later_of_one_users_every_click_answers_as_as_of_on_damaged_lists(redis_client: redis.Redis,
                                                                                 prefix: str) -> None:
    """Serving's read (one user, as of the far future: ``as_of_later``'s lists straight from the list's parse) gives
    what ``as_of`` gives as of a time past the last click, also where the list holds a malformed entry, a click stored
    twice, clicks out of time order, or the key is not a list; a user asked twice gets two lists of its own."""
    h = UserHistory(redis_client, prefix=prefix, max_len=30)
    t = ms(2000, 1, 1)
    far, near = 2**62, t + 100
    h.append_many([1] * 20, [1000 + i for i in range(20)], [t + (i * 7919) % 23 for i in range(20)])
    redis_client.set(h.key(6), "not a list")
    damage = [lambda: None, lambda: redis_client.lpush(h.key(1), "garbage"),
              lambda: redis_client.lpush(h.key(1), redis_client.lindex(h.key(1), 3)),  # a click stored twice
              lambda: redis_client.rpush(h.key(1), f"{t + 50}:7")]  # appended late, the newest click
    for harm in damage:
        harm()
        for users in ([1], [6], [9], [1, 1]):
            for limit in (None, 0, 5):
                got = h.as_of_later(users, [far] * len(users), limit)()
                assert got == h.as_of(users, [near] * len(users), limit)
                assert all(type(v) is int for one in got for v in one)
        twice = h.as_of_later([1, 1], [far, far])()
        twice[0].append(-1)
        assert twice[1] == h.as_of([1], [near])[0]


def test_as_of_flat_later_sends_now_and_answers_as_as_of_flat(redis_client: redis.Redis, prefix: str) -> None:
    """The joiner's read (``as_of_flat_later``) gives what ``as_of_flat`` gives: on clean lists, after a NOSCRIPT, and
    where a list holds a malformed entry, an entry with a newline, a click stored twice, or a key is not a list."""
    h = UserHistory(redis_client, prefix=prefix, max_len=10)
    t = ms(2000, 1, 1)
    rng = np.random.default_rng(7)
    users = [int(u) for u in rng.integers(0, 6, 60)]
    items = [int(i) for i in rng.integers(-(2**62), 2**62, 60)]
    h.append_many(users, items, [t + int(d) for d in rng.integers(0, 50, 60)])
    pool = redis_client.connection_pool

    def same(who: list[int], times: list[int], limit: int | None = None) -> None:
        collect = h.as_of_flat_later(who, times, limit)
        assert len(pool._in_use_connections) == 1  # sent; the answer pending on a pooled connection
        flat, offsets = collect()
        want_flat, want_offsets = h.as_of_flat(who, times, limit)
        assert flat.tolist() == want_flat.tolist() and offsets.tolist() == want_offsets.tolist()
        assert flat.dtype == np.int64 and offsets.dtype == np.int32
        assert len(pool._in_use_connections) == 0

    everyone = list(range(8))  # 6 and 7 have no history
    same(everyone * 3, [t + int(x) for x in rng.integers(0, 60, 24)])
    same(everyone, [t + 60] * 8, limit=3)
    same([1], [2**62])
    redis_client.script_flush()  # NOSCRIPT: loaded, read again
    same(everyone, [t + 30] * 8)
    for damage in (lambda: redis_client.lpush(h.key(2), "garbage"),
                   lambda: redis_client.lpush(h.key(3), f"{t + 1}:5\n{t + 2}:6"),  # one entry, two lines
                   lambda: redis_client.lpush(h.key(4), redis_client.lindex(h.key(4), 0)),  # a click stored twice
                   lambda: redis_client.set(h.key(8), "not a list")):
        damage()
        same([*everyone, 8], [t + 60] * 9)
        same([*everyone, 8], [t + 25] * 9, limit=2)


def test_appending_more_entries_than_one_lua_unpack_takes_keeps_every_entry_in_order(
    redis_client: redis.Redis, prefix: str
) -> None:
    h = UserHistory(redis_client, prefix=prefix, max_len=20_000)
    n = 9_001  # three slices of the script's LPUSH
    h.append_many([7] * n + [8], list(range(n)) + [5], list(range(n)) + [3])
    stored = redis_client.lrange(h.key(7), 0, -1)
    assert stored == [f"{i}:{i}".encode() for i in reversed(range(n))]  # newest first, as one LPUSH per entry
    assert redis_client.lrange(h.key(8), 0, -1) == [b"3:5"]


def test_a_key_that_is_not_a_list_fails_the_append_after_every_other_user_is_appended(
    redis_client: redis.Redis, prefix: str
) -> None:
    h = UserHistory(redis_client, prefix=prefix, max_len=2)
    redis_client.set(h.key(2), "not a list")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        h.append_many([1, 2, 3, 1, 1], [10, 20, 30, 11, 12], [1, 2, 3, 4, 5])
    assert redis_client.lrange(h.key(1), 0, -1) == [b"5:12", b"4:11"]  # trimmed to max_len
    assert redis_client.lrange(h.key(3), 0, -1) == [b"3:30"]
    assert redis_client.get(h.key(2)) == b"not a list"


def test_appends_go_on_after_redis_forgets_its_scripts(redis_client: redis.Redis, prefix: str) -> None:
    h = UserHistory(redis_client, prefix=prefix)
    h.append_many([1], [10], [1])
    redis_client.script_flush()  # a restarted or failed-over Redis: NOSCRIPT, loaded again
    h.append_many([1], [11], [2])
    assert redis_client.lrange(h.key(1), 0, -1) == [b"2:11", b"1:10"]


def test_counts_and_names_of_the_layout_before_hash_tags_are_still_read_on_a_single_node(
        redis_client: redis.Redis, prefix: str) -> None:
    # A single-node deployment upgraded in place: its keys written before the {kind} hash tag existed live on until
    # they expire (ttl_days), and the hot set, the CLI and serving must go on counting them.
    counts = DailyCounts(redis_client, prefix=prefix)
    redis_client.zadd(f"{prefix}:counts:item:impression:20050101", {"1": 5, "2": 1})  # as the old code wrote them
    redis_client.zadd(f"{prefix}:counts:item:impression:20041231", {"3": 4})
    redis_client.hset(f"{prefix}:names:item:20050101", mapping={"1": "old-one"})
    counts.record("item", "impression", [2, 2, 4], [ms(2005, 1, 1)] * 3, names={2: "two", 4: "four"})
    assert counts.days_available("item", "impression") == ["20041231", "20050101"]
    assert counts.top("item", day="20050101", k=5) == [("1", 5.0), ("2", 3.0), ("4", 1.0)]
    assert counts.top("item", day="20050101", days=2, k=5) == [("1", 5.0), ("3", 4.0), ("2", 3.0), ("4", 1.0)]
    assert counts.names("item", ["1", "2", "3"], day="20050101") == {"1": "old-one", "2": "two"}
    assert redis_client.zcard(counts.key("item", "impression", "20050101")) == 2  # writes go to the new keys only


def test_one_walk_lists_every_kind_and_events_days_and_no_key_that_is_no_day(
        redis_client: redis.Redis, prefix: str) -> None:
    """``all_days_available`` (the hot set's one SCAN) finds both layouts of every kind and event; a key under the
    counts that is no day (not UTF-8, not a calendar date, a write's markers, ``top``'s temporary key) is skipped, not
    a failed read: any client with write access can add one."""
    counts = DailyCounts(redis_client, prefix=prefix)
    counts.record("item", "impression", [1], [ms(2005, 1, 1)])
    counts.record("user", "click", ["u"], [ms(2005, 1, 2)])
    redis_client.zadd(f"{prefix}:counts:item:impression:20041231", {"3": 4})  # the layout before hash tags
    for junk in (b":counts:{item}:impression:\xff\xfe", b":counts:{item}:lookup:20051399", b":counts:{user}:tmp:x",
                 b":counts:{item}:impression:2005010"):
        redis_client.zadd(prefix.encode() + junk, {"1": 1})
    assert counts.all_days_available() == {("item", "impression"): ["20041231", "20050101"],
                                           ("user", "click"): ["20050102"]}
    assert counts.days_available("item", "lookup") == [] and counts.days_available("user", "click") == ["20050102"]
