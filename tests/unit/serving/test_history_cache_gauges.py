"""serving/history_cache.py's entries gauge against the listener's events racing a request's fill: no Redis (the cache
is never started; its listener's events are called as its thread calls them)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis

from serving.history_cache import HistoryCache
from serving.metrics import ServingMetrics

EVENTS: dict[str, Callable[[HistoryCache], None]] = {
    "listener lost": lambda cache: cache._set_up(False),
    "user invalidated": lambda cache: cache.invalidate([f"{cache.prefix}1".encode()]),
    "redis flushed": lambda cache: cache.invalidate(None),
}


class ThenOnRelease:
    """A lock that runs ``then`` once, right after the next release once armed: the listener's event landing between
    a request's fill leaving the cache's lock and its next step."""

    def __init__(self, then: Callable[[], None]) -> None:
        self.lock, self.then, self.armed = threading.Lock(), then, False

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.lock.release()
        if self.armed:
            self.armed = False
            self.then()


@pytest.mark.parametrize("event", sorted(EVENTS))
def test_the_entries_gauge_is_the_caches_size_when_a_listener_event_lands_as_a_fill_leaves_the_lock(
        event: str) -> None:
    metrics = ServingMetrics(lambda: None)
    client = redis.Redis(host="127.0.0.1", port=1)  # never connected: the listener is not started
    cache = HistoryCache(client, "p", 10, metrics)
    cache._set_up(True)  # as the listener does once tracking is on
    hits, fill = cache.lookup([1])
    assert hits == {} and fill is not None
    hook = ThenOnRelease(lambda: EVENTS[event](cache))
    cache._lock = hook  # type: ignore[assignment]
    hook.armed = True
    fill.done([1], [[11]])
    assert not hook.armed  # the event ran, after the fill released the lock
    assert len(cache) == 0
    assert metrics.registry.get_sample_value("streamrec_serving_history_cache_entries") == 0
