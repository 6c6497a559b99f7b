"""``DailyCounts.top`` over several days (``stream/counts.py``) ranks the sum of the days' counts in bounded reads.

It merged the days on the server, ZUNIONSTORE into a temporary key, then read the top k: one command over every member
of every day. Measured on the local Redis: 7 days of 300,000 members each took longer than ``redis_timeout_s`` (5 s), so
the nightly hot set failed as "Redis unreachable after N attempt(s)" while each retry queued another union behind the
first (Redis blocked for every client, serving's history reads included); 7 x 200,000 took 5-17 s. Now no single
command reads more than a page of one day. No Redis: a stand-in that logs each command; the real Redis's ranking is
tests/integration/test_hot_set_hostile_counts.py's and test_readable_ids.py's."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from stream.counts import DailyCounts

PAGE_MAX = 10_000


class Days:
    """Sorted sets in memory: ZREVRANGE (score, then member, descending, as Redis; also as the page script), ZMSCORE,
    TYPE, EXISTS, pipelines; ``largest`` is the most members one command read, ``commands`` the commands sent."""

    def __init__(self, sets: dict[str, dict[bytes, float]]) -> None:
        self.sets, self.largest, self.commands = sets, 0, []

    def pipeline(self, transaction: bool = True) -> Pipe:
        return Pipe(self)

    def exists(self, *keys: str) -> int:
        return sum(k in self.sets for k in keys)

    def zrevrange(self, key: str, start: int, end: int, withscores: bool = False) -> list[tuple[bytes, float]]:
        self.commands.append("zrevrange")
        rows = sorted(self.sets.get(key, {}).items(), key=lambda r: (r[1], r[0]), reverse=True)[start:end + 1]
        self.largest = max(self.largest, len(rows))
        return rows

    def register_script(self, text: str) -> Any:  # the page read (counts_scripts.TOP_PAGE_BOUNDED): a ZREVRANGE, flat
        def page(keys: list[str], args: list[int], client: Any = None) -> Any:
            def run() -> list[Any]:
                rows = self.zrevrange(keys[0], args[0], args[1])
                return [[x for m, score in rows for x in (m, repr(score).encode())], []]  # (no member replaced here)
            return client.queued.append(run) if client is not None else run()
        return page

    def zmscore(self, key: str, members: list[Any]) -> list[float | None]:
        self.commands.append("zmscore")
        self.largest = max(self.largest, len(members))
        data = self.sets.get(key, {})
        return [data.get(m if isinstance(m, bytes) else str(m).encode()) for m in members]

    def type(self, key: str) -> bytes:
        return b"zset" if key in self.sets else b"none"

    def get_connection_kwargs(self) -> dict[str, Any]:  # no socket_timeout: round_trip bounds nothing
        return {}

    def __getattr__(self, name: str) -> Any:  # zunionstore, ...: a read of every member at once
        raise AssertionError(f"unexpected command {name}")


class Pipe:
    def __init__(self, client: Days) -> None:
        self.client, self.queued = client, []

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.client, name)
        return lambda *a, **kw: self.queued.append(lambda: fn(*a, **kw))

    def execute(self) -> list[Any]:
        return [f() for f in self.queued]


def brute(sets: dict[str, dict[bytes, float]], k: int) -> list[tuple[str, float]]:
    total: dict[bytes, float] = {}
    for data in sets.values():
        for m, s in data.items():
            total[m] = total.get(m, 0.0) + s
    ranked = sorted(total.items(), key=lambda r: (r[1], r[0]), reverse=True)[:k]
    return [(m.decode(), s) for m, s in ranked]


def key(day: str) -> str:
    return f"p:counts:{{item}}:lookup:{day}"


DAYS = [f"2026120{d}" for d in range(1, 8)]


@pytest.mark.parametrize("seed", range(6))
def test_the_top_of_a_window_equals_the_top_of_the_days_summed(seed: int) -> None:
    rng = random.Random(seed)
    universe = [str(rng.randrange(10**6)).encode() for _ in range(3000)]
    sets = {}
    for day in DAYS[: rng.randint(2, 7)]:
        members = rng.sample(universe, rng.randint(0, 2500))
        # small counts: many ties, whose order (member descending) must be Redis's; a few negative (another client's)
        sets[key(day)] = {m: float(rng.choice([rng.randint(1, 20), rng.randint(1, 20), -rng.randint(1, 5)]))
                          for m in members}
    counts = DailyCounts(Days(sets), prefix="p")  # type: ignore[arg-type]
    for k in (1, 7, 500, 2000, 10_000):
        assert counts.top("item", "lookup", day=DAYS[6], days=7, k=k) == brute(sets, k), k


def test_no_command_reads_more_than_a_page_whatever_the_window_holds() -> None:
    rng = random.Random(1)
    sets = {key(day): {str(rng.randrange(10**9)).encode(): float(rng.randint(1, 1000)) for _ in range(25_000)}
            for day in DAYS}
    client = Days(sets)
    counts = DailyCounts(client, prefix="p")  # type: ignore[arg-type]
    top = counts.top("item", "lookup", day=DAYS[6], days=7, k=30_000)
    assert top == brute(sets, 30_000)
    assert client.largest <= PAGE_MAX * len(DAYS) and "zunionstore" not in client.commands


def test_one_days_top_is_read_a_page_per_command_as_redis_ranks_it() -> None:
    """A window of one key was one ZREVRANGE of k: a hot set asking again past refused members read them all in one."""
    rng = random.Random(2)
    sets = {key(DAYS[0]): {str(rng.randrange(10**9)).encode(): float(rng.randint(1, 1000)) for _ in range(25_000)}}
    client = Days(sets)
    counts = DailyCounts(client, prefix="p")  # type: ignore[arg-type]
    assert counts.top("item", "lookup", day=DAYS[0], days=1, k=30_000) == brute(sets, 30_000)
    assert counts.top("item", "lookup", day=DAYS[0], days=1, k=PAGE_MAX + 1) == brute(sets, PAGE_MAX + 1)
    assert client.largest <= PAGE_MAX


def test_equal_sums_at_the_cut_are_ranked_as_redis_ranks_them() -> None:
    # every member sums to 2: the order is by member, descending, however they lie in the days
    sets = {key(DAYS[0]): {b"1": 1.0, b"3": 2.0, b"5": 1.0}, key(DAYS[1]): {b"1": 1.0, b"5": 1.0, b"9": 2.0}}
    counts = DailyCounts(Days(sets), prefix="p")  # type: ignore[arg-type]
    assert counts.top("item", "lookup", day=DAYS[1], days=2, k=2) == [("9", 2.0), ("5", 2.0)]
    assert not math.isnan(counts.top("item", "lookup", day=DAYS[1], days=2, k=4)[-1][1])
