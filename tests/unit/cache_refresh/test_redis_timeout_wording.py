"""A Redis that answers too slowly (its replies trickling, a read larger than the timeout allows) is not "unreachable":
the refresh's hot set failed with "Redis unreachable after N attempt(s): Timeout reading from ...", which sends the
operator to check whether Redis is up while it is up and slow. ``hot_set.with_retries`` names a timeout as one."""

from __future__ import annotations

import pytest
import redis

from cache_refresh import hot_set


def _failing(exc: Exception):
    def fn() -> None:
        raise exc
    return fn


def test_retries_that_all_timed_out_say_redis_did_not_answer_in_time_not_unreachable() -> None:
    with pytest.raises(hot_set.RedisUnavailable) as err:
        hot_set.with_retries("top items", _failing(redis.TimeoutError("Timeout reading from 127.0.0.1:6379")), 2, 0.0,
                             sleep=lambda s: None)
    assert "unreachable" not in str(err.value)
    assert "did not answer within its timeout in 2 attempt(s)" in str(err.value), err.value


def test_retries_that_could_not_connect_still_say_unreachable() -> None:
    with pytest.raises(hot_set.RedisUnavailable, match="top items: Redis unreachable after 2 attempt"):
        hot_set.with_retries("top items", _failing(redis.ConnectionError("Connection refused")), 2, 0.0,
                             sleep=lambda s: None)
