"""Readable ids for operators (issue 16, part 2) against the real Redis (and broker) of the session stack.

The day counts are kept by the raw ids' stable hashes; the names beside them (``{prefix}:names:{kind}:{day}``,
``stream/counts.py``) let ``streamrec counts top``, the hot set's stats and the refresh summary show the raw ids,
and the hash only where no name is known.
"""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from cache_refresh import hot_set
from stream.counts import DailyCounts
from stream.features import hash_value
from stream.ids import stable_hash
from streamrec.cli import main
from tests.integration.test_join_pipeline import T0, click, imp, make, settings  # noqa: F401 - fixtures
from tests.integration.test_refresh import (  # noqa: F401 - fixtures
    CFG,
    DAY_MS,
    ITEMS,
    USERS,
    config_file,
    env,
    trained,
)


def ms(y: int, mo: int, d: int, h: int = 0, mi: int = 0) -> int:
    return int(dt.datetime(y, mo, d, h, mi, tzinfo=dt.timezone.utc).timestamp()) * 1000


@pytest.fixture
def prefix(redis_client: redis.Redis) -> Iterator[str]:
    p = f"names-{uuid.uuid4().hex[:12]}"
    yield p
    keys = list(redis_client.scan_iter(match=f"{p}:*", count=1000))
    if keys:
        redis_client.delete(*keys)


def redis_config(path: Path, url: str, prefix: str) -> Path:
    path.write_text(f'[redis]\nurl = "{url}"\nprefix = "{prefix}"\n')
    return path


def counts_top(capsys: pytest.CaptureFixture[str], cfg: Path, *args: str) -> tuple[dict, str]:
    """``streamrec counts top`` twice: its JSON summary and its human output."""
    argv = ["counts", "top", "--config", str(cfg), *args]
    assert main([*argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    return summary, capsys.readouterr().out


def hashed(raws: list[int | str]) -> tuple[list[int], dict[int, int | str]]:
    """What the joiner gives ``record``: the hashes, and hash -> raw id."""
    return [stable_hash(r) for r in raws], {stable_hash(r): r for r in raws}


# -- counts top ------------------------------------------------------------------------------------
def test_counts_top_prints_raw_ids_and_the_hash_only_where_no_name_is_known(
        stack, redis_client: redis.Redis, prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    counts = DailyCounts(redis_client, prefix=prefix)
    t = ms(2000, 12, 31, 12)
    # 123 (int) and "123" (str) are one id (stable_hash hashes their text): shown as 123
    raws: list[int | str] = [123, "123", 123, "movie:Heat (1995)", "movie:Heat (1995)", 77]
    ids, names = hashed(raws)
    counts.record("item", "impression", ids, [t] * len(ids), names=names)
    nameless = stable_hash("recorded-before-names")
    counts.record("item", "impression", [nameless], [t])  # a writer that passed no names (or an old count)

    assert counts.names("item", [str(stable_hash(123)), str(nameless)], day="20001231") == {
        str(stable_hash(123)): "123"}
    summary, human = counts_top(capsys, redis_config(tmp_path / "c.toml", stack.redis_url, prefix), "--kind", "item")
    # "id" stays the member counted (the hash), "name" is the raw id
    assert summary["top"] == [
        {"id": str(stable_hash(123)), "name": "123", "count": 3.0},
        {"id": str(stable_hash("movie:Heat (1995)")), "name": "movie:Heat (1995)", "count": 2.0},
        *sorted([{"id": str(stable_hash(77)), "name": "77", "count": 1.0},
                 {"id": str(nameless), "name": None, "count": 1.0}],
                key=lambda r: r["id"], reverse=True),  # equal counts: Redis's reverse member text
    ]
    lines = human.splitlines()
    assert lines[0] == "top 10 items by impressions over 1 day(s) ending 20001231 (UTC)"
    assert lines[1].split() == ["1.", "123", "3"]
    assert lines[2].split() == ["2.", "movie:Heat", "(1995)", "2"]
    assert f"hash {nameless}" in human and str(stable_hash(123)) not in human  # a named id shows no hash
    assert "1 of 4 shown by hash: no name recorded" in lines[-1]


@pytest.mark.parametrize("bad", [["--k", "0"], ["--k", "-1"], ["--days", "0"]])
def test_counts_top_refuses_a_k_or_days_below_1_also_where_redis_holds_no_counts(
        stack, prefix: str, tmp_path: Path, bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # with no counts under the prefix, `counts top --k 0` printed "no item impression counts" and exited 0: the
    # check of --k/--days ran only once a day with counts was found
    cfg = redis_config(tmp_path / "c.toml", stack.redis_url, prefix)
    assert main(["counts", "top", "--kind", "item", "--config", str(cfg), *bad]) == 2
    assert f"argument {bad[0][2:]!r}" in capsys.readouterr().err


def test_a_click_after_midnight_is_named_from_its_impression_the_day_before(
        redis_client: redis.Redis, prefix: str) -> None:
    counts = DailyCounts(redis_client, prefix=prefix)
    ids, names = hashed(["late-night-item"])
    counts.record("item", "impression", ids, [ms(2001, 3, 1, 23, 59)], names=names)
    counts.record("item", "click", ids, [ms(2001, 3, 2, 0, 1)])  # its flush no longer had the impression's raw id
    member = str(ids[0])
    assert counts.top("item", "click") == [(member, 1.0)]
    assert counts.names("item", [member], day="20010302") == {member: "late-night-item"}
    assert counts.names("item", [member], day="20010303") == {}  # two days on: not looked up


def test_names_are_looked_up_newest_day_first_across_the_days_asked_in_one_round_trip(
        redis_client: redis.Redis, prefix: str) -> None:
    """``names`` asks the days in pipelined groups (``_NAMES_DAYS_PER_TRIP``): the newest day's name still wins, a
    name only a group further back is found, and a member named nowhere costs one round trip per group of days, not
    one per day (a 100,000-day window of unnamed members took ~60 s of round trips)."""
    counts = DailyCounts(redis_client, prefix=prefix)
    ids, _ = hashed(["a", "b", "never"])
    a, b, never = (str(i) for i in ids)
    counts.record("item", "impression", [ids[0]], [ms(2001, 1, 1)], names={ids[0]: "a-old"})  # 59 days back
    counts.record("item", "impression", [ids[0]], [ms(2001, 2, 20)], names={ids[0]: "a-new"})  # 9 days back
    counts.record("item", "impression", [ids[1]], [ms(2001, 1, 1)], names={ids[1]: "b"})
    counts.record("item", "impression", [ids[2]], [ms(2001, 3, 1)])  # counted, never named
    assert counts.names("item", [a, b, never], day="20010301", days=100) == {a: "a-new", b: "b"}
    trips = []  # round trips: a command sent alone, or a pipeline
    real_pipeline, real_command = redis_client.pipeline, redis_client.execute_command
    redis_client.pipeline = lambda *a, **kw: trips.append(1) or real_pipeline(*a, **kw)  # type: ignore[method-assign]
    redis_client.execute_command = lambda *a, **kw: trips.append(1) or real_command(*a, **kw)  # type: ignore
    try:
        assert counts.names("item", [never], day="20010301", days=100) == {}
    finally:
        del redis_client.pipeline, redis_client.execute_command
    assert len(trips) <= 101 // 32 + 1


# -- bounded and expiring like the counts ------------------------------------------------------------
def test_names_are_bounded_by_the_days_counted_ids_and_share_their_expiry(
        redis_client: redis.Redis, prefix: str) -> None:
    counts = DailyCounts(redis_client, prefix=prefix, ttl_days=3)
    d1, d2 = ms(2002, 2, 2, 10), ms(2002, 2, 3, 10)
    raws: list[int | str] = [f"item-{i}" for i in range(50)]
    ids, names = hashed(raws)
    extra = {stable_hash(f"not-counted-{i}"): f"not-counted-{i}" for i in range(500)}  # more names than counts
    ts = [d1 if i % 2 else d2 for i in range(len(ids))]
    counts.record("item", "impression", ids * 3, ts * 3, names={**names, **extra})
    future = int((time.time() + 10 * 86_400) * 1000)  # beyond future_s: not counted, so not named either
    counts.record("item", "impression", [stable_hash("from-the-future")], [future],
                  names={stable_hash("from-the-future"): "from-the-future"})

    k1, k2 = counts.names_key("item", "20020202"), counts.names_key("item", "20020203")
    assert k1 == f"{prefix}:names:{{item}}:20020202"  # {item}: the kind's hash tag, the same as its counts keys
    assert redis_client.hlen(k1) == redis_client.zcard(counts.key("item", "impression", "20020202")) == 25
    assert redis_client.hlen(k2) == 25
    assert sorted(v.decode() for v in redis_client.hvals(k1)) == sorted(f"item-{i}" for i in range(1, 50, 2))
    assert [k.decode() for k in redis_client.scan_iter(match=f"{prefix}:names:*")] != []
    assert sorted(k.decode() for k in redis_client.scan_iter(match=f"{prefix}:names:*")) == [k1, k2]
    # no user names from item counts; names are per kind
    assert redis_client.exists(counts.names_key("user", "20020202")) == 0

    # one expiry with the counts key written in the same call (EXPIREAT, moved forward by every write)
    pipe = redis_client.pipeline()
    pipe.pttl(k1)
    pipe.pttl(counts.key("item", "impression", "20020202"))
    names_ttl, counts_ttl = pipe.execute()
    assert 0 < counts_ttl <= 3 * 86_400_000 and abs(names_ttl - counts_ttl) < 50

    # and gone with it: a counts object whose keys expire in 1 s
    class Soon(DailyCounts):
        def expire_at(self, day_index: int, now_s: float | None = None) -> int:
            return int(time.time()) + 2

    soon = Soon(redis_client, prefix=prefix + "-soon")
    ids, names = hashed(["brief"])
    soon.record("user", "click", ids, [d1], names=names)
    assert soon.names("user", [str(ids[0])], day="20020202") == {str(ids[0]): "brief"}
    deadline = time.monotonic() + 5
    while redis_client.exists(soon.key("user", "click", "20020202")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert redis_client.exists(soon.key("user", "click", "20020202")) == 0
    assert redis_client.exists(soon.names_key("user", "20020202")) == 0
    assert soon.names("user", [str(ids[0])], day="20020202") == {}


def test_a_name_is_sent_once_and_again_after_its_key_is_lost_or_a_write_failed(
        redis_client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = DailyCounts(redis_client, prefix=prefix)
    t = ms(2004, 4, 4)
    ids, names = hashed(["a", "b"])
    counts.record("item", "impression", ids, [t, t], names=names)
    key = counts.names_key("item", "20040404")
    sent: list[list] = []
    real = counts._zincr_many

    def spy(keys: list[str], args: list, client: object) -> object:
        sent.append(args)
        return real(keys=keys, args=args, client=client)

    monkeypatch.setattr(counts, "_zincr_many", spy)
    counts.record("item", "impression", ids, [t, t], names=names)
    assert len(sent[-1]) == 3 + 2 * 2  # expiry, marker, n, two (count, member) pairs: no name sent again
    redis_client.delete(key)  # lost (deleted, evicted): the next call finds it gone, the one after names again
    counts.record("item", "impression", ids, [t, t], names=names)
    counts.record("item", "impression", ids, [t, t], names=names)
    assert {k.decode(): v.decode() for k, v in redis_client.hgetall(key).items()} == {
        str(i): raw for i, raw in names.items()}

    # a write that fails leaves nothing remembered as written
    ids, names = hashed(["c"])
    real_pipeline = redis_client.pipeline

    def failing(*a, **kw):
        pipe = real_pipeline(*a, **kw)
        pipe.execute = lambda *a, **kw: (_ for _ in ()).throw(redis.ConnectionError("down"))
        return pipe

    monkeypatch.setattr(redis_client, "pipeline", failing)
    with pytest.raises(redis.ConnectionError):
        counts.record("item", "impression", ids, [t], names=names)
    monkeypatch.setattr(redis_client, "pipeline", real_pipeline)
    counts.record("item", "impression", ids, [t], names=names)  # the retry
    assert redis_client.hget(key, str(ids[0])) == b"c"


def test_names_lost_with_their_key_are_written_again_even_when_the_first_write_after_counts_other_ids(
        redis_client: redis.Redis, prefix: str) -> None:
    # The names key of a day is lost (evicted, a Redis restarted without persistence) and the next write of that day
    # counts other ids: it makes the key again, so the write after it finds the key and must not take the ids named
    # before the loss as still named (their names were gone for the rest of the day).
    counts = DailyCounts(redis_client, prefix=prefix)
    t = ms(2004, 4, 5)
    ids, names = hashed(["a", "b"])
    counts.record("item", "impression", ids[:1], [t], names=names)
    redis_client.delete(counts.names_key("item", "20040405"))
    counts.record("item", "impression", ids[1:], [t], names=names)  # "b" only: makes the key again
    counts.record("item", "impression", ids, [t, t], names=names)
    assert counts.names("item", [str(i) for i in ids], day="20040405") == {str(i): raw for i, raw in names.items()}


def test_bad_names_name_the_value(redis_client: redis.Redis, prefix: str) -> None:
    counts = DailyCounts(redis_client, prefix=prefix)
    t = ms(2000, 1, 1)
    with pytest.raises(ValueError, match=r"argument 'names': the name of id 7 is -3, expected the raw id"):
        counts.record("item", "click", [5, 7], [t, t], names={5: "five", 7: -3})
    counts.record("item", "click", [5], [t], names={5: "five"})  # 5 was not remembered as named by the failed call
    assert counts.names("item", ["5"], day="20000101") == {"5": "five"}
    with pytest.raises(ValueError, match=r"argument 'names': has the key -1, expected an id as given in 'ids'"):
        counts.record("item", "click", ["5"], [t], names={-1: "x"})
    assert counts.top("item", "click") == [("5", 1.0)]  # nothing half-written by the failed calls


# -- the hot set and the refresh summary --------------------------------------------------------------
def test_hot_set_stats_list_the_hottest_ids_by_raw_id(redis_client: redis.Redis, prefix: str) -> None:
    counts = DailyCounts(redis_client, prefix=prefix)
    t = ms(2003, 2, 28, 8)
    raws: list[int | str] = [2858] * 5 + [260] * 4 + ["u:1"] * 3
    ids, names = hashed(raws)
    counts.record("item", "impression", ids, [t] * len(ids), names=names)
    counts.record("item", "impression", [stable_hash("anon")] * 2, [t] * 2)
    users, user_names = hashed(["1m_1", "1m_1", "1m_2"])
    counts.record("user", "impression", users, [t] * 3, names=user_names)

    hs = hot_set.compute(redis_client, prefix, 8, CFG, days=7, hot_items=10, hot_users=10, show=3)
    assert hs.stats["top_items"] == [{"name": "2858", "count": 5}, {"name": "260", "count": 4},
                                     {"name": "u:1", "count": 3}]
    assert hs.stats["top_users"] == [{"name": "1m_1", "count": 2}, {"name": "1m_2", "count": 1}]
    assert hs.stats["items"] == 4  # the hot set itself is not cut to what is shown
    hs = hot_set.compute(redis_client, prefix, 8, CFG, days=7, hot_items=10, hot_users=10)
    assert hs.stats["top_items"][-1] == {"name": None, "hash": str(stable_hash("anon")), "count": 2}
    assert hot_set.describe_top(hs.stats["top_items"]) == (
        f"2858 (5), 260 (4), u:1 (3), hash {stable_hash('anon')} (2)")


def test_refresh_summary_and_manifest_show_the_hottest_ids_by_raw_id(
        env, tmp_path: Path, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    rs, kafka, rds = env  # test_refresh's counts: ITEMS[k] (hashes of "i{k}") seen 100 - k times, no names
    counts = DailyCounts(redis_client, prefix=rds.prefix)
    # the joiner, later that day, names the first three items and two users (one impression each)
    counts.record("item", "impression", ITEMS[:3], [DAY_MS] * 3, names={h: f"i{k}" for k, h in enumerate(ITEMS[:3])})
    counts.record("user", "impression", USERS[:2], [DAY_MS] * 2, names={h: f"u{k}" for k, h in enumerate(USERS[:2])})

    assert main(["refresh", "--now", "--json", "--config", str(config_file(tmp_path / "c.toml", rs, kafka, rds))]) == 0
    summary = json.loads(capsys.readouterr().out)
    top_items, top_users = summary["hot_set"]["top_items"], summary["hot_set"]["top_users"]
    assert top_items[:3] == [{"name": "i0", "count": 101}, {"name": "i1", "count": 100}, {"name": "i2", "count": 99}]
    assert top_items[3:] == [{"name": None, "hash": str(ITEMS[k]), "count": 100 - k} for k in range(3, 10)]
    assert top_users[:2] == [{"name": "u0", "count": 51}, {"name": "u1", "count": 50}]
    assert [r["name"] for r in top_users[2:]] == [None] * 3
    manifest = json.loads((Path(summary["path"]) / "manifest.json").read_text())
    assert manifest["hot_set"]["top_items"] == top_items


# -- the joiner end to end ----------------------------------------------------------------------------
def test_the_joiner_records_names_that_counts_top_prints(
        kafka, make, stack, prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    p = make()
    p.process([imp(kafka, 0, 0, "a", T0, user="u1", item="i1"),
               imp(kafka, 0, 1, "b", T0 + 1, user="u2", item="i1"),
               imp(kafka, 0, 2, "c", T0 + 2, user="u2", item="i2"),
               click(kafka, 0, 0, "a", T0 + 5)])
    p.close()  # flushes the buffered counts (counts_flush_s=3600 in these settings)
    cfg = redis_config(tmp_path / "c.toml", stack.redis_url, prefix)

    items, human = counts_top(capsys, cfg, "--kind", "item")
    assert [(r["name"], r["count"]) for r in items["top"]] == [("i1", 2.0), ("i2", 1.0)]
    assert [r["id"] for r in items["top"]] == [str(hash_value("i1")), str(hash_value("i2"))]
    assert human.splitlines()[1].split() == ["1.", "i1", "2"] and str(hash_value("i1")) not in human
    clicks, _ = counts_top(capsys, cfg, "--kind", "item", "--event", "click")
    assert [(r["name"], r["count"]) for r in clicks["top"]] == [("i1", 1.0)]
    users, _ = counts_top(capsys, cfg, "--kind", "user")
    assert [(r["name"], r["count"]) for r in users["top"]] == [("u2", 2.0), ("u1", 1.0)]
    assert p.day_counts.names == {"item": set(), "user": set()}  # cleared by the flush: kept no longer than that


def test_counts_top_escapes_unprintable_raw_ids(
        stack, redis_client: redis.Redis, prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    counts = DailyCounts(redis_client, prefix=prefix)
    ids, names = hashed(["two\nlines"])
    counts.record("user", "click", ids, np.array([ms(2000, 1, 1)]), names=names)
    summary, human = counts_top(capsys, redis_config(tmp_path / "c.toml", stack.redis_url, prefix),
                                "--kind", "user", "--event", "click")
    assert summary["top"] == [{"id": str(ids[0]), "name": "two\nlines", "count": 1.0}]
    assert human.splitlines()[1].split() == ["1.", "'two\\nlines'", "1"]


def test_counts_top_reads_servings_lookup_counts_which_rank_the_hot_set(
        stack, redis_client: redis.Redis, prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The hot set ranks by serving's row lookups by default; ``--event lookup`` was refused by the command's
    choices (impression, click), so what ranks it could not be read from the CLI."""
    counts = DailyCounts(redis_client, prefix=prefix)
    ids, names = hashed(["looked-up", "seen"])
    t = ms(2001, 5, 1, 12)
    counts.record("item", "impression", ids, [t, t], names=names)  # the joiner's names
    counts.add_counts("item", "lookup", np.array(ids, np.int64), np.array([40, 2], np.int64),
                      t // 86_400_000)  # (the day index)
    summary, human = counts_top(capsys, redis_config(tmp_path / "c.toml", stack.redis_url, prefix), "--kind", "item",
                                "--event", "lookup")
    assert [(r["name"], r["count"]) for r in summary["top"]] == [("looked-up", 40.0), ("seen", 2.0)]
    assert summary["event"] == "lookup" and "by lookups" in human.splitlines()[0]
