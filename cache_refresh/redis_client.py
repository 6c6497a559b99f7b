"""The refresh's Redis client (``stream/redis_client.py``'s ``connect`` with the [redis] and [refresh] settings) and
its timeout, which bounds each whole reply and grows with the largest reply the settings allow."""

from __future__ import annotations

from typing import Any

from cache_refresh.settings import RefreshSettings
from stream.config import RedisSettings
from stream.counts import TOP_PAGE
from stream.redis_client import connect, scaled_timeout_s

# The largest reply a refresh reads is a top-ids read of the hot set (DailyCounts.top: ZREVRANGE of up to twice
# hot_items members, ZMSCORE of as many; a window's page reads, up to days x TOP_PAGE members). At the defaults
# (200,000 members) it takes ~0.7 s on a loaded 2-core machine against a local Redis (measured: 100,000 members 0.35 s,
# 1,000,000 3.4 to 5.4 s), within redis_timeout_s (5 s) bounding the whole reply; larger settings grow it in proportion.
_REPLY_MEMBERS_PER_TIMEOUT = 200_000


def redis_timeout_s(rs: RefreshSettings) -> float:
    """The refresh's Redis timeout, bounding each whole reply: ``redis_timeout_s``, longer where ``hot_items``,
    ``hot_users`` or ``days`` allow a larger top-ids reply than the defaults."""
    members = max(2 * max(rs.hot_items, rs.hot_users), rs.days * TOP_PAGE)
    return scaled_timeout_s(rs.redis_timeout_s, members, _REPLY_MEMBERS_PER_TIMEOUT)


def _redis(rds: RedisSettings, rs: RefreshSettings) -> Any:
    """A client with the [redis] credentials and TLS (a Redis Cluster's with ``[redis] cluster`` or its older alias
    ``[refresh] embedding_store_cluster``); each whole reply bounded by :func:`redis_timeout_s`
    (``stream/redis_deadline.py``: a Redis trickling its replies fails the run's Redis step as a timeout instead of
    holding the run, and its lock, for as long as it trickles; the job's own ``hot_set.with_retries`` retries outages
    and timeouts; refused credentials are never retried)."""
    return connect(rds.clustered(rs.embedding_store_cluster), timeout_s=redis_timeout_s(rs), whole_reply=True)
