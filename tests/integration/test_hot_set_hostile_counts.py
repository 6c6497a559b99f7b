"""The hot set over day counts that some other client wrote into Redis (issue 16: counts that are malformed are
rejected or bounded with a reason, never a failed refresh and never a silent change of the hot set), against the
real Redis of the session stack."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator

import pytest
import redis

from cache_refresh import hot_set
from stream import counts as counts_module
from stream.config import RedisSettings
from stream.counts import DailyCounts
from stream.counts_scripts import NAME_MAX_BYTES
from stream.redis_client import RedisAuthError, connect, describe, failure
from streamrec.stack import LocalStack
from tests.integration.test_refresh import CFG
from tests.trickle_proxy import TrickleProxy

DAY = "20030228"


@pytest.fixture
def prefix(redis_client: redis.Redis) -> Iterator[str]:
    p = f"hostile-{uuid.uuid4().hex[:12]}"
    yield p
    keys = list(redis_client.scan_iter(match=f"{p}:*", count=1000))
    if keys:
        redis_client.delete(*keys)


def _items(redis_client: redis.Redis, prefix: str, scores: dict[str, float], day: str = DAY) -> DailyCounts:
    counts = DailyCounts(redis_client, prefix=prefix)
    redis_client.zadd(counts.key("item", "impression", day), scores)  # type: ignore[arg-type]
    return counts


def _hot_items(redis_client: redis.Redis, prefix: str, k: int = 10) -> hot_set.HotSet:
    return hot_set.compute(redis_client, prefix, 8, CFG, days=7, hot_items=k, hot_users=0, event="impression")


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), -5.0, 0.0])
def test_a_count_that_is_not_a_positive_finite_number_is_left_out_of_the_hot_set_with_a_warning(
        redis_client: redis.Redis, prefix: str, bad: float, caplog: pytest.LogCaptureFixture) -> None:
    _items(redis_client, prefix, {"123": bad, "456": 3, "789": 2})
    with caplog.at_level(logging.WARNING, logger="streamrec.refresh"):
        hs = _hot_items(redis_client, prefix)
    assert [r["hash"] for r in hs.stats["top_items"]] == ["456", "789"]
    assert hs.stats["items"] == 2 and hs.stats["item_count_covered"] == 5.0
    assert "not a positive finite count" in caplog.text


def test_an_infinite_count_at_the_head_gives_its_place_to_the_next_valid_id(
        redis_client: redis.Redis, prefix: str) -> None:
    _items(redis_client, prefix, {"1": float("inf"), "2": 9, "3": 8, "4": 7})
    hs = _hot_items(redis_client, prefix, k=2)
    assert [r["hash"] for r in hs.stats["top_items"]] == ["2", "3"]


def test_a_days_head_of_refused_members_is_read_a_page_per_reply_so_a_trickling_redis_does_not_time_it_out(
        stack: LocalStack, redis_client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One day's counts (a window of one key) whose first pages are all refused members (not a stable hash's text):
    the hot set asks for k, then twice as many until k valid ids come, and each read ranks the day again. With a
    whole-reply timeout of 1 s and Redis trickling a byte per 2 ms, a page (TOP_PAGE = 2: ~40 bytes, ~0.08 s) is well
    within it, on a loaded machine too (0.45 s failed once at load 15); the read of 64 members in one reply (~1,200
    bytes, 2.4 s) was not, and the hot set failed as a Redis timeout (at the real TOP_PAGE: a day with a million
    refused members at its head)."""
    monkeypatch.setattr(counts_module, "TOP_PAGE", 2)
    refused = {f"x{i:02d}": 1000.0 - i for i in range(60)}
    _items(redis_client, prefix, {**refused, "1": 5.0, "2": 4.0, "3": 3.0})
    with TrickleProxy(stack.s.redis_port, gap_s=0.002) as proxy:
        client = connect(RedisSettings(url=proxy.url), timeout_s=1.0, retries=0, whole_reply=True)
        try:
            counts = DailyCounts(client, prefix=prefix)
            proxy.trickling = True
            top, day = hot_set.top_ids(counts, "item", "impression", days=1, k=2,
                                       available={("item", "impression"): [DAY]})
        finally:
            proxy.trickling = False
            client.close()
    assert (top, day) == ([("1", 5.0), ("2", 4.0)], DAY)


def test_a_window_of_days_trickled_past_the_clients_timeout_fails_as_a_timeout_not_one_timeout_per_day(
        stack: LocalStack, redis_client: redis.Redis, prefix: str) -> None:
    """The top of a 7-day window reads a page of every day in one pipeline per round. Redis trickles its replies a
    byte per 2 ms: each day's page (5 members, ~175 bytes) arrives well within the refresh client's whole-reply
    timeout, the round's 7 in ~2.5 of it. The read fails as a Redis timeout (what the hot set's retries handle);
    bounded reply by reply it waited out the whole trickle, up to one timeout per day of every round."""
    days = [f"200302{d:02d}" for d in range(22, 29)]
    for day in days:
        _items(redis_client, prefix, {f"{10**18 + i}{day[-1]}": 1.0 for i in range(5)}, day)
    with TrickleProxy(stack.s.redis_port, gap_s=0.002) as proxy:
        client = connect(RedisSettings(url=proxy.url), timeout_s=1.0, retries=0, whole_reply=True)
        try:
            counts = DailyCounts(client, prefix=prefix)
            proxy.trickling = True
            with pytest.raises(redis.TimeoutError):
                counts.top("item", "impression", day=DAY, days=7, k=3)
        finally:
            proxy.trickling = False
            client.close()


def test_names_of_a_window_trickled_past_the_clients_timeout_fail_as_a_timeout_not_one_timeout_per_day(
        stack: LocalStack, prefix: str) -> None:
    """The names of a 7-day window are one pipelined round trip of HMGETs (8 days, each in both key layouts on a single
    node: 16). Redis trickles its replies a byte per 5 ms: each (9 bytes, no name) arrives well within the whole-reply
    timeout, the trip's 16 in ~2.4 of it. The read fails as a Redis timeout; bounded reply by reply it waited out the
    whole trickle (up to 32 timeouts per trip) and returned. ``day_counts`` and ``_sorted_sets`` (the TYPEs of a window)
    bound their pipelines by the same ``round_trip``."""
    with TrickleProxy(stack.s.redis_port, gap_s=0.005) as proxy:
        client = connect(RedisSettings(url=proxy.url), timeout_s=0.3, retries=0, whole_reply=True)
        try:
            counts = DailyCounts(client, prefix=prefix)
            client.ping()  # connected (the handshake's replies not trickled: they alone outlast the timeout)
            proxy.trickling = True
            with pytest.raises(redis.TimeoutError, match="Timeout reading"):
                counts.names("item", ["123"], DAY, days=7)
        finally:
            proxy.trickling = False
            client.close()


class _WriteBetweenPages:
    """The session's Redis client, with a joiner's ZINCRBY sent right after the first page of a day is read (a live
    joiner writes while the refresh reads its pages)."""

    def __init__(self, client: redis.Redis, key: str, member: str, by: float) -> None:
        self.client, self.write = client, (key, by, member)

    def register_script(self, text: str) -> object:  # the page read (counts_scripts.TOP_PAGE_BOUNDED)
        script = self.client.register_script(text)

        def page(*args: object, **kwargs: object) -> object:
            got = script(*args, **kwargs)  # type: ignore[arg-type]
            if self.write is not None:
                self.client.zincrby(*self.write)
                self.write = None
            return got
        return page

    def __getattr__(self, name: str) -> object:
        return getattr(self.client, name)


def test_a_member_a_write_moves_into_the_pages_already_read_is_still_in_the_top(
        redis_client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One day's top read a page at a time is no snapshot: a member of page 2 that a write moves above page 1's last
    member between the two reads pushes that member into page 2 (read twice) and is read in neither. It ranks in the
    top k before and after the write, and was missing; the read had k - 1 members, which the hot set takes for every
    member of the day read."""
    monkeypatch.setattr(counts_module, "TOP_PAGE", 2)
    counts = _items(redis_client, prefix, {"1": 10.0, "2": 9.0, "3": 8.0, "4": 7.0, "5": 6.0})
    racing = _WriteBetweenPages(redis_client, counts.key("item", "impression", DAY), "4", 5.0)  # 4: 7 -> 12
    got = DailyCounts(racing, prefix=prefix).top("item", "impression", day=DAY, days=1, k=4)  # type: ignore[arg-type]
    assert got == [("4", 12.0), ("1", 10.0), ("2", 9.0), ("3", 8.0)]


def test_a_member_that_is_not_utf8_is_left_out_not_a_failed_refresh(redis_client: redis.Redis, prefix: str) -> None:
    _items(redis_client, prefix, {b"\xff\xfe1": 50, "456": 3})  # type: ignore[dict-item]
    hs = _hot_items(redis_client, prefix)
    assert [r["hash"] for r in hs.stats["top_items"]] == ["456"]


def test_a_name_that_is_not_utf8_is_shown_escaped_not_a_failed_refresh(redis_client: redis.Redis, prefix: str) -> None:
    counts = _items(redis_client, prefix, {"456": 3})
    redis_client.hset(counts.names_key("item", DAY), "456", b"caf\xe9")
    hs = _hot_items(redis_client, prefix)
    assert hs.stats["top_items"] == [{"name": "caf\ufffd", "count": 3}]


@pytest.mark.parametrize("days", [1, 3])  # one key read in pages; a window's pages summed
def test_a_huge_member_at_the_head_of_the_counts_is_refused_without_crossing_the_socket(
        redis_client: redis.Redis, prefix: str, days: int) -> None:
    # another client's 20 MB members at the head of a day's counts were read whole by every refresh, then refused
    huge = [b"9" * 20_000_000, b"8" * 20_000_000]
    counts = _items(redis_client, prefix, {huge[0]: 50.0, huge[1]: 40.0, "456": 3.0, "789": 2.0})  # type: ignore[dict-item]
    _items(redis_client, prefix, {huge[0]: 5.0, "789": 2.0}, day="20030227")  # type: ignore[dict-item]
    before = int(redis_client.info("stats")["total_net_output_bytes"])
    top = counts.top("item", "impression", day=DAY, days=days, k=4)
    hs = _hot_items(redis_client, prefix, k=2)
    assert int(redis_client.info("stats")["total_net_output_bytes"]) - before < 1_000_000  # counts, names, INFO
    assert [m for m, _ in top[2:]] == (["456", "789"] if days == 1 else ["789", "456"])  # 789: 2 + 2 over days
    assert all(m.startswith("!toolong:") for m, _ in top[:2])
    assert top[0][0] != top[1][0] and top[0][1] == (50.0 if days == 1 else 55.0)  # two members, and each one's sum
    assert [r["hash"] for r in hs.stats["top_items"]] == ["789", "456"]  # the refresh's window: 7 days


def test_a_huge_members_sum_over_days_counts_the_days_where_it_is_below_the_first_page(
        redis_client: redis.Redis, prefix: str) -> None:
    # a window's other days were asked for a member's score by ZMSCORE of the member as read: '!toolong:<sha1>', which
    # no key holds, so a huge member deep in another day (below its first page) lost that day's count from its sum
    huge = b"9" * 2_000
    counts = _items(redis_client, prefix, {huge: 100.0, "1": 1.0})  # type: ignore[dict-item]
    _items(redis_client, prefix, {huge: 1.0, **{str(m): 50.0 for m in range(1000, 2200)}}, day="20030227")  # type: ignore[dict-item]
    top = counts.top("item", "impression", day=DAY, days=2, k=1)
    assert top[0][0].startswith("!toolong:") and top[0][1] == 101.0  # as ZUNIONSTORE sums it


def test_a_huge_name_is_left_in_redis_and_its_id_shown_by_hash_with_a_warning(
        redis_client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    # another client's 20 MB names (one on each of two days) were read whole by every refresh's names of its top ids
    counts = _items(redis_client, prefix, {"456": 3, "789": 2})
    redis_client.hset(counts.names_key("item", DAY), mapping={"456": b"n" * 20_000_000, "789": "bob-item"})
    redis_client.hset(counts.names_key("item", "20030227"), "456", b"m" * 20_000_000)
    before = int(redis_client.info("stats")["total_net_output_bytes"])
    with caplog.at_level(logging.WARNING):
        assert counts.names("item", ["456", "789"], DAY, days=2) == {"789": "bob-item"}
        hs = _hot_items(redis_client, prefix)
    assert int(redis_client.info("stats")["total_net_output_bytes"]) - before < 1_000_000  # the names, counts, INFO
    assert hs.stats["top_items"] == [{"name": None, "hash": "456", "count": 3}, {"name": "bob-item", "count": 2}]
    assert f"longer than {NAME_MAX_BYTES} bytes" in caplog.text


def test_a_names_key_of_the_wrong_type_leaves_the_ids_unnamed_with_a_warning(
        redis_client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    counts = _items(redis_client, prefix, {"456": 3})
    redis_client.rpush(counts.names_key("item", DAY), "not a hash")
    with caplog.at_level(logging.WARNING, logger="streamrec.refresh"):
        hs = _hot_items(redis_client, prefix)
    assert hs.stats["top_items"] == [{"name": None, "hash": "456", "count": 3}]
    assert hs.stats["items"] == 1
    assert "WRONGTYPE" in caplog.text


@pytest.mark.parametrize("latest", [True, False])
def test_a_day_key_of_the_wrong_type_is_left_out_of_the_window_with_a_warning(
        redis_client: redis.Redis, prefix: str, latest: bool, caplog: pytest.LogCaptureFixture) -> None:
    """A list where a day's sorted set belongs (the latest day, or one inside the window) failed the run with
    WRONGTYPE from ZREVRANGE / ZUNIONSTORE; the other days' counts rank the hot set."""
    counts = _items(redis_client, prefix, {"456": 3, "789": 2}, day="20030227")
    bad_day = "20030228" if latest else "20030226"
    redis_client.rpush(counts.key("item", "impression", bad_day), "x")
    with caplog.at_level(logging.WARNING):
        hs = _hot_items(redis_client, prefix)
    assert [r["hash"] for r in hs.stats["top_items"]] == ["456", "789"]
    assert counts.key("item", "impression", bad_day) in caplog.text and "not a sorted set" in caplog.text


def test_a_day_key_of_the_wrong_type_is_no_day_so_it_cannot_move_the_window_off_the_real_counts(
        redis_client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A list at a later day's key, with the real counts ending more than ``days`` (7) before it, was taken as the
    latest day: the window held no sorted set and the hot set came out empty with only a "no counted item"
    warning. Only sorted-set keys are days (as ``top`` reads them), so the real counts rank the hot set."""
    counts = _items(redis_client, prefix, {"456": 3, "789": 2}, day="20030210")
    redis_client.rpush(counts.key("item", "impression", DAY), "x")
    with caplog.at_level(logging.WARNING):
        assert counts.days_available("item", "impression") == ["20030210"]
        hs = _hot_items(redis_client, prefix)
    assert [r["hash"] for r in hs.stats["top_items"]] == ["456", "789"]
    assert counts.key("item", "impression", DAY) in caplog.text and "not a sorted set" in caplog.text


def test_a_negative_day_count_summed_with_positive_ones_leaves_the_member_out_with_a_warning(
        redis_client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """Summed over the window, 10 one day and -8 the next ranked "123" at 2, below "456" and "789": a silent drop
    of its rank. It is refused as a member whose only count is -8 is (one definition: hot_set._is_count)."""
    _items(redis_client, prefix, {"123": 10, "456": 5}, day="20030227")
    _items(redis_client, prefix, {"123": -8, "789": 3, "999": 1})
    with caplog.at_level(logging.WARNING, logger="streamrec.refresh"):
        hs = _hot_items(redis_client, prefix)
    assert [r["hash"] for r in hs.stats["top_items"]] == ["456", "789", "999"]
    assert hs.stats["item_count_covered"] == 9.0
    assert "not a positive finite count" in caplog.text


def test_a_negative_count_in_the_layout_before_hash_tags_is_not_hidden_by_a_one_day_window(
        redis_client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A one-day window on a single node reads the day's key and, while it lives, the same day's key of the layout
    before hash tags, summed: 10 in one and -8 in the other ranked "123" at 2. The per-day check ran only for
    days > 1, so it was ranked; it is refused as in a longer window."""
    counts = _items(redis_client, prefix, {"123": 10, "456": 5})
    redis_client.zadd(f"{prefix}:counts:item:impression:{DAY}", {"123": -8, "789": 3, "999": 1})
    with caplog.at_level(logging.WARNING, logger="streamrec.refresh"):
        top, day = hot_set.top_ids(counts, "item", "impression", days=1, k=10)
    assert (top, day) == ([("456", 5.0), ("789", 3.0), ("999", 1.0)], DAY)
    assert "not a positive finite count" in caplog.text


def test_a_window_with_no_count_at_or_below_zero_sends_no_member_to_redis_for_the_per_day_check(
        redis_client: redis.Redis, prefix: str) -> None:
    """The per-day check read every ranked member's score in every key of the window (one ZMSCORE of up to hot_items
    members per day: 2.4x the read's time at 100,000 items over 7 days, Redis busy ~70 ms per key). Only keys holding
    a count <= 0 can hide one (ZCOUNT first); the joiner and serving write none, so no ZMSCORE is sent."""
    _items(redis_client, prefix, {"123": 10, "456": 5}, day="20030227")
    _items(redis_client, prefix, {"123": 1, "789": 3})

    def zmscores() -> int:
        return int(redis_client.info("commandstats").get("cmdstat_zmscore", {}).get("calls", 0))

    before = zmscores()
    hs = _hot_items(redis_client, prefix)
    assert [r["hash"] for r in hs.stats["top_items"]] == ["123", "456", "789"]
    assert zmscores() == before


def test_counts_whose_sum_passes_float_max_cover_their_exact_sum_in_strict_json(
        redis_client: redis.Redis, prefix: str) -> None:
    """Two counts of 1e308 (another client's) summed to ``Infinity`` in ``item_count_covered``: the manifest and the
    summary were not JSON a strict reader (jq) takes. The sum is exact, an integer, at any size."""
    _items(redis_client, prefix, {"1": 1e308, "2": 1e308})
    hs = _hot_items(redis_client, prefix)
    assert hs.stats["item_count_covered"] == 2 * int(1e308)
    json.dumps(hs.stats, allow_nan=False)


def test_a_names_key_of_the_wrong_type_on_one_day_leaves_the_other_days_names_readable(
        redis_client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A list at the day before's names key failed the whole names read with WRONGTYPE: every top id of every day
    shown by hash in the hot set, and ``streamrec counts top`` failed. That key alone is left out, with a warning."""
    counts = _items(redis_client, prefix, {"456": 3, "789": 2})
    redis_client.hset(counts.names_key("item", DAY), "456", "alice-item")
    redis_client.hset(counts.names_key("item", "20030226"), "789", "bob-item")
    redis_client.rpush(counts.names_key("item", "20030227"), "not a hash")
    with caplog.at_level(logging.WARNING, logger="streamrec.counts"):
        assert counts.names("item", ["456", "789"], day=DAY, days=3) == {"456": "alice-item", "789": "bob-item"}
    assert counts.names_key("item", "20030227") in caplog.text and "not a hash" in caplog.text


def test_the_names_read_under_an_acl_denying_hstrlen_is_described_as_the_acls_to_fix(
        stack: LocalStack, redis_client: redis.Redis, prefix: str) -> None:
    # the names read is a script now: Redis 6 answers a command its ACL denies inside one with no NOPERM code, and
    # `streamrec counts top` said only "Redis at ...: ResponseError: ... can't run this command", not which ACL to fix
    counts = _items(redis_client, prefix, {"456": 3})
    user, password = f"{prefix}-user", uuid.uuid4().hex
    redis_client.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "+@all", "-hstrlen")
    settings = RedisSettings(url=stack.redis_url, username=user)
    limited = redis.Redis.from_url(stack.redis_url, username=user, password=password)
    try:
        with pytest.raises(redis.ResponseError) as exc:
            DailyCounts(limited, prefix=prefix).names("item", ["456"], DAY)
        assert "grant it in the Redis ACL" in describe(exc.value, settings), describe(exc.value, settings)
    finally:
        limited.close()
        redis_client.execute_command("ACL", "DELUSER", user)
    assert counts.names("item", ["456"], DAY) == {}


def test_a_hstrlen_the_acl_denies_inside_the_names_script_is_a_redis_auth_error_as_outside_it(
        stack: LocalStack, redis_client: redis.Redis, prefix: str) -> None:
    """``failure`` classed a command the ACL denies inside a script (Redis 6: no NOPERM code) as a plain
    ``RedisFailure`` while ``describe`` said it was the ACL's to fix: a caller catching ``RedisAuthError`` (the
    refresh, serving's start) took a configuration to fix for an outage. Inside the script and outside it, the same
    denial is now the same ``RedisAuthError``."""
    _items(redis_client, prefix, {"456": 3})
    user, password = f"{prefix}-user", uuid.uuid4().hex
    redis_client.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "+@all", "-hstrlen")
    settings = RedisSettings(url=stack.redis_url, username=user)
    limited = redis.Redis.from_url(stack.redis_url, username=user, password=password)
    try:
        with pytest.raises(redis.ResponseError) as in_script:
            DailyCounts(limited, prefix=prefix).names("item", ["456"], DAY)
        with pytest.raises(redis.ResponseError) as outside:
            limited.hstrlen(f"{prefix}:names", "456")
    finally:
        limited.close()
        redis_client.execute_command("ACL", "DELUSER", user)
    assert "NOPERM" not in str(in_script.value)  # (the codeless denial this is about)
    for exc in (in_script.value, outside.value):
        err = failure(exc, settings)
        assert isinstance(err, RedisAuthError) and "grant it in the Redis ACL" in str(err), (type(err), str(err))
