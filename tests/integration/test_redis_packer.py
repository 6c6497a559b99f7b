"""stream/redis_client.py against the real Redis: a client from ``connect`` (``PlainPacker``: hiredis packs plain
commands whole) leaves Redis holding exactly what redis-py's own packer makes it hold, for the joiner's writes (day
counts with names, history appends, in MULTI/EXEC and scripts) and reads."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from stream.config import RedisSettings
from stream.counts import DailyCounts
from stream.history import UserHistory
from stream.redis_client import PlainPacker, connect
from tests.conftest import LocalStack

DAY_MS = 86_400_000


@pytest.fixture
def plain(stack: LocalStack) -> Iterator[redis.Redis]:
    client = connect(RedisSettings(url=stack.redis_url))
    assert isinstance(client.connection_pool.connection_kwargs["command_packer"], PlainPacker)
    try:
        yield client
    finally:
        client.close()


def stored(client: redis.Redis, prefix: str) -> dict[str, object]:
    """Every key under ``prefix`` (the prefix cut off) with its value, read by type."""
    out: dict[str, object] = {}
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        name, kind = key.decode()[len(prefix):], client.type(key).decode()
        if kind == "zset":
            out[name] = client.zrange(key, 0, -1, withscores=True)
        elif kind == "hash":
            out[name] = client.hgetall(key) if ":names:" in name else sorted(client.hgetall(key).values())
        elif kind == "list":
            out[name] = client.lrange(key, 0, -1)
    return out


def write(client: redis.Redis, prefix: str) -> list[list[int]]:
    counts, history = DailyCounts(client, prefix=prefix), UserHistory(client, prefix=prefix, max_len=8)
    ids = [5, 7, 2**62 + 3, 5, 7, 5]
    ts = [DAY_MS * 20_000 + i for i in range(len(ids))]
    names = {5: "user-é", 7: 7, 2**62 + 3: "x" * 256}
    counts.record("user", "impression", ids, ts, names=names, write_id=f"w-{uuid.uuid4().hex}")
    counts.record("item", "click", ["a", "ü", "a"], ts[:3])
    history.append_many([5, 5, 7], [11, 12, 2**62], [1_000, 2_000, 3_000])
    history.append_many([5, 5, 7], [11, 12, 2**62], [1_000, 2_000, 3_000])  # a redo: nothing pushed again
    return [list(map(list, history.as_of([5, 7, 9], [2_500, 10_000, 10_000])))]


def test_the_joiners_redis_writes_and_reads_through_connect_match_redis_pys_own_packer(
        plain: redis.Redis, redis_client: redis.Redis) -> None:
    ours, theirs = f"packer-{uuid.uuid4().hex[:8]}", f"packer-{uuid.uuid4().hex[:8]}"
    read_ours, read_theirs = write(plain, ours), write(redis_client, theirs)
    assert read_ours == read_theirs == [[[11, 12], [2**62], []]]
    got, want = stored(plain, ours), stored(redis_client, theirs)
    assert got == want and len(got) >= 5
