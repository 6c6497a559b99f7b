"""Which keys under ``{prefix}:counts:`` are days (``stream/counts.py``, ``DailyCounts.all_days_available``): a key of
a day before 1970 is no streamrec write (``record`` refuses times before the epoch, ``add_counts`` counts by the wall
clock), so any client wrote it. As "the latest day" of a kind and event it failed the nightly hot set with
``OverflowError: date value out of range`` (a window of days back from 0001-01-01), or, before the year 1000, made it
read nothing (``strftime`` writes the year without its leading zeros, so the window named keys that do not exist).
No Redis: the keyspace walk is a stand-in's."""

from __future__ import annotations

from typing import Any

from cache_refresh import hot_set
from learner.features import default_config
from stream.counts import DailyCounts


class Keyspace:
    """The two reads ``all_days_available`` makes: SCAN and a pipeline of TYPE; every key a sorted set."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.typed: list[str] = []

    def scan_iter(self, match: str, count: int) -> list[bytes]:
        return [k.encode() for k in self.keys]

    def get_connection_kwargs(self) -> dict[str, Any]:  # no socket_timeout: round_trip bounds nothing
        return {}

    def pipeline(self, transaction: bool = True) -> Keyspace:
        return self

    def type(self, key: str) -> None:
        self.typed.append(key)

    def execute(self) -> list[bytes]:
        out, self.typed = [b"zset"] * len(self.typed), []
        return out

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"no further Redis read expected, got {name}")


def test_a_day_before_the_epoch_is_no_day_of_the_counts() -> None:
    keys = ["p:counts:{item}:lookup:00010101", "p:counts:{item}:impression:09991231",
            "p:counts:{user}:impression:19691231", "p:counts:{user}:impression:19700101"]
    counts = DailyCounts(Keyspace(keys), prefix="p")  # type: ignore[arg-type]
    assert counts.all_days_available() == {("user", "impression"): ["19700101"]}


def test_the_hot_set_over_only_a_hostile_ancient_day_is_empty_not_a_failed_refresh() -> None:
    cfg = default_config({}, buckets=1000)
    hs = hot_set.compute(Keyspace(["p:counts:{item}:lookup:00010101"]), "p", 8, cfg, days=7,  # type: ignore[arg-type]
                         hot_items=10, hot_users=0, event="lookup", fallback="lookup", small_field_rows=0, attempts=1)
    assert len(hs.rows) == 0 and hs.stats["item_last_day"] is None


class EmptyRedis:
    """A Redis with no key: what the window reads (EXISTS, TYPE, ZREVRANGE, the names script) answer as Redis would."""

    def __init__(self) -> None:
        self.queued: list[Any] = []

    def get_connection_kwargs(self) -> dict[str, Any]:  # no socket_timeout: round_trip bounds nothing
        return {}

    def pipeline(self, transaction: bool = True) -> EmptyRedis:
        return self

    def exists(self, *keys: str) -> int:
        return 0

    def type(self, key: str) -> None:
        self.queued.append(b"none")

    def zrevrange(self, key: str, start: int, end: int, withscores: bool = False) -> None:
        self.queued.append([])

    def register_script(self, text: str) -> Any:  # the top's page read (none) or the names read (no name found)
        def run(keys: list[str], args: list[Any], client: Any = None) -> Any:
            got = [[], []] if "ZREVRANGE" in text else [[None] * (len(args) - 1) for _ in keys]
            return self.queued.append(got) if client is not None else got
        return run

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        out, self.queued = self.queued, []
        return out


def test_a_window_reaching_back_before_the_epoch_reads_the_days_from_1970_on_not_an_overflow() -> None:
    """``streamrec counts top --days 1000000`` (or ``--day 00010101 --days 2``) failed with ``OverflowError: date value
    out of range``, a traceback where a bad --days is a usage error: the window's days before 1970 hold no counts
    (nothing writes one), so they are not read."""
    counts = DailyCounts(EmptyRedis(), prefix="p")  # type: ignore[arg-type]
    assert counts.top("item", "impression", day="20261205", days=1_000_000, k=3) == []
    assert counts.top("item", "impression", day="00010101", days=2, k=3) == []
    assert counts.names("item", ["1"], day="20261205", days=1_000_000) == {}
    assert counts.names("item", ["1"], day="00010101", days=2) == {}
    assert counts.day_counts("item", "impression", ["1"], day="00010101", days=2) == {}


def test_a_windows_page_reads_send_one_key_each_not_every_other_day_of_the_window() -> None:
    """Each page read of a window's top sent the window's other days' keys too (for the scores of a member too long to
    send, kept beside its bytes): n days sent n x n keys a round, and ``--days 1000000`` (20,000 days from 1970) held
    ~20 GB of key lists until the OOM killer ended it. One key each; the others only with a page holding such a
    member."""
    redis, sizes = EmptyRedis(), []
    register = redis.register_script

    def counting(text: str) -> Any:
        run = register(text)

        def call(keys: list[str], args: list[Any], client: Any = None) -> Any:
            if "ZREVRANGE" in text:
                sizes.append(len(keys))
            return run(keys, args, client)
        return call

    redis.register_script = counting  # type: ignore[method-assign]
    assert DailyCounts(redis, prefix="p").top("item", "impression", day="20261205", days=1000, k=3) == []  # type: ignore[arg-type]
    assert len(sizes) == 1000 and set(sizes) == {1}
