"""serving/lookup_counts.py's accounting, with a fake in place of the Redis day counts (the real Redis path is in
tests/integration/test_serving_lookup_counts.py): aggregation per id and kind, the bound on what waits, a failed
flush kept for one retry under the same write ids, then dropped and counted (never raised), the size trigger and the
last flush at stop."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import redis

from serving.lookup_counts import RECENT_FAILURE_S, LookupCounts
from serving.metrics import ServingMetrics
from stream.counts_keys import DAY_S


class FakeCounts:
    """Records add_counts calls (and their write ids); raises while ``down``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[int, int], int]] = []
        self.ids: list[str] = []  # write id of each call written
        self.failed_ids: list[str] = []  # write id of each call refused
        self.down = False
        self.written = threading.Event()
        self.client = None  # DailyCounts.client: no cluster client, so a failure stops the flush as on a single node

    def add_counts(self, kind: str, event: str, members: np.ndarray, counts: np.ndarray, day_index: int,
                   write_id: str) -> None:
        if self.down:
            self.failed_ids.append(write_id)
            raise redis.ConnectionError("Redis is down")
        self.calls.append((kind, event, dict(zip(members.tolist(), counts.tolist(), strict=True)), day_index))
        self.ids.append(write_id)
        self.written.set()


def metric(metrics: ServingMetrics, name: str, labels: dict[str, str] | None = None) -> float:
    value = metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


def test_a_flush_writes_one_count_per_id_and_kind_on_the_wall_clock_day() -> None:
    fake, metrics = FakeCounts(), ServingMetrics(lambda: None)
    lc = LookupCounts(fake, metrics, clock=lambda: 3 * DAY_S + 5.0)  # type: ignore[arg-type]
    lc.add("item", np.array([7, 8, 7], np.int64))
    lc.add("item", np.array([7], np.int64))
    lc.add("user", np.array([42], np.int64))
    lc.add("user", np.array([42], np.int64))
    lc.add("item", np.zeros(0, np.int64))  # nothing read: nothing counted
    assert lc.flush() == 6
    assert sorted(fake.calls) == [("item", "lookup", {7: 3, 8: 1}, 3), ("user", "lookup", {42: 2}, 3)]
    assert lc.flush() == 0 and len(fake.calls) == 2  # nothing waits: no write
    assert metric(metrics, "streamrec_serving_lookup_counts_flushed_total") == 6
    assert metric(metrics, "streamrec_serving_lookup_count_flushes_total", {"outcome": "ok"}) == 1


def test_a_failed_flush_keeps_its_lookups_for_one_retry_under_the_same_write_id_apart_from_newer_ones() -> None:
    fake, metrics = FakeCounts(), ServingMetrics(lambda: None)
    lc = LookupCounts(fake, metrics)  # type: ignore[arg-type]
    fake.down = True
    lc.add("item", np.arange(5, dtype=np.int64))
    assert lc.flush() == 0  # does not raise
    assert lc.dropped == 0
    assert metric(metrics, "streamrec_serving_lookup_count_flushes_total", {"outcome": "error"}) == 1
    fake.down = False  # back: the kept write as it was (its reply may have been lost), then what came since
    lc.add("item", np.array([9], np.int64))
    assert lc.flush() == 6
    assert [c[2] for c in fake.calls] == [dict.fromkeys(range(5), 1), {9: 1}]
    assert fake.ids[0] == fake.failed_ids[0] != fake.ids[1]
    assert (lc.flushed, lc.dropped) == (6, 0)


def test_lookups_a_second_flush_fails_to_write_are_dropped_and_counted() -> None:
    fake, metrics = FakeCounts(), ServingMetrics(lambda: None)
    lc = LookupCounts(fake, metrics)  # type: ignore[arg-type]
    fake.down = True
    lc.add("item", np.arange(5, dtype=np.int64))
    assert lc.flush() == 0
    lc.add("user", np.array([1, 2], np.int64))
    assert lc.flush() == 0  # the items' second try: dropped; the users' first: kept
    assert lc.dropped == 5
    assert metric(metrics, "streamrec_serving_lookup_counts_dropped_total", {"reason": "redis"}) == 5
    fake.down = False
    assert lc.flush() == 2
    assert [c[2] for c in fake.calls] == [{1: 1, 2: 1}]
    assert (lc.flushed, lc.dropped) == (2, 5)


def test_lookups_kept_for_a_retry_count_against_max_pending() -> None:
    fake = FakeCounts()
    lc = LookupCounts(fake, max_pending=10)  # type: ignore[arg-type]
    fake.down = True
    lc.add("item", np.arange(8, dtype=np.int64))
    lc.flush()  # kept: 8 of the 10
    lc.add("item", np.arange(3, dtype=np.int64))  # 11 > 10: not counted
    lc.add("user", np.array([1, 2], np.int64))  # 10: fits
    assert lc.dropped == 3


def test_lookups_a_flush_holds_while_redis_is_slow_count_against_max_pending() -> None:
    """A flush waiting on a slow Redis holds its lookups, and keeps them when the write then fails: they once did not
    count while it ran, so the requests of those seconds filled max_pending again and twice max_pending waited."""
    class StuckCounts(FakeCounts):
        def __init__(self) -> None:
            super().__init__()
            self.entered, self.release = threading.Event(), threading.Event()

        def add_counts(self, *args: object, **kwargs: object) -> None:
            self.entered.set()
            assert self.release.wait(10)  # Redis slow, then down
            self.down = True
            super().add_counts(*args, **kwargs)  # type: ignore[arg-type]

    fake = StuckCounts()
    lc = LookupCounts(fake, max_pending=10)  # type: ignore[arg-type]
    lc.add("item", np.arange(8, dtype=np.int64))
    flusher = threading.Thread(target=lc.flush)
    flusher.start()
    assert fake.entered.wait(10)
    lc.add("item", np.arange(3, dtype=np.int64))  # 8 held by the flush + 3 > 10: not counted
    lc.add("user", np.array([1, 2], np.int64))  # 10: fits
    fake.release.set()
    flusher.join(10)
    assert lc.dropped == 3
    assert lc._n + lc._kept_n == 10  # the 8 kept for their retry and the 2 added meanwhile


def test_a_flush_ending_in_an_unexpected_error_no_longer_holds_its_lookups_against_max_pending(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The flush's end is the one place its hold is released (written, kept or, here, dropped for a bug): a hold left
    # behind dropped every later request as "full" until the next flush.
    lc = LookupCounts(FakeCounts(), max_pending=10)  # type: ignore[arg-type]
    lc.add("item", np.arange(8, dtype=np.int64))

    def broken(members: np.ndarray, counts: np.ndarray) -> None:
        raise RuntimeError("a bug in the flush")

    monkeypatch.setattr(lc, "_hashes_only", broken)
    assert lc.flush() == 0  # counted, not raised (the next test)
    lc.add("item", np.arange(10, dtype=np.int64))  # fits: nothing is held or kept any more
    assert lc.dropped == 8 and lc._held_n == 0


def test_lookups_a_flush_holds_when_it_fails_unexpectedly_are_dropped_and_counted_as_error_not_lost_silently(
        caplog: pytest.LogCaptureFixture) -> None:
    """A flush that raised outside its writes' handling (here: lookups that are no int64 ids, which np.unique cannot
    order) lost every lookup it held uncounted, those kept for a retry of a failed write too, and ended the flush
    thread. Now they are dropped and counted (reason="error"), it is logged once until a flush succeeds, and the
    accounting against max_pending is clear for the lookups made since."""
    fake, metrics = FakeCounts(), ServingMetrics(lambda: None)
    lc = LookupCounts(fake, metrics, max_pending=10)  # type: ignore[arg-type]
    fake.down = True
    lc.add("item", np.array([1, 2], np.int64))
    assert lc.flush() == 0 and lc._kept_n == 2  # Redis down: kept for one retry
    fake.down = False
    lc.add("user", np.array([None, 3], dtype=object))  # a caller's bug: no hashed ids
    with caplog.at_level(logging.ERROR, logger="streamrec.serve"):
        assert lc.flush() == 0  # not raised: the flush thread goes on
        lc.add("user", np.array([None], dtype=object))
        assert lc.flush() == 0
    assert metric(metrics, "streamrec_serving_lookup_counts_dropped_total", {"reason": "error"}) == 5
    assert lc.dropped == 5 and (lc._n, lc._kept_n, lc._held_n) == (0, 0, 0)
    assert metric(metrics, "streamrec_serving_lookup_count_flushes_total", {"outcome": "error"}) == 3
    said = [r for r in caplog.records if "failed unexpectedly" in r.getMessage()]
    assert len(said) == 1 and said[0].exc_info is not None, caplog.text  # once, with the traceback
    assert "4 lookups" in said[0].getMessage()
    lc.add("item", np.arange(10, dtype=np.int64))  # fits: nothing held or kept
    assert lc.flush() == 10 and lc.dropped == 5


def test_what_stop_s_last_flush_fails_to_write_is_dropped_and_counted() -> None:
    fake = FakeCounts()
    lc = LookupCounts(fake).start()  # type: ignore[arg-type]
    fake.down = True
    lc.add("item", np.arange(4, dtype=np.int64))
    lc.stop()  # its flush fails: what it keeps has no next flush
    assert (lc.flushed, lc.dropped) == (0, 4)
    fake.down = False
    assert lc.flush() == 0


def test_lookups_beyond_max_pending_are_dropped_not_buffered() -> None:
    fake, metrics = FakeCounts(), ServingMetrics(lambda: None)
    lc = LookupCounts(fake, metrics, max_pending=10)  # type: ignore[arg-type]
    lc.add("item", np.arange(8, dtype=np.int64))
    lc.add("item", np.arange(3, dtype=np.int64))  # 11 > 10: this request is not counted
    lc.add("user", np.array([1, 2], np.int64))  # 10: fits
    assert lc.dropped == 3
    assert metric(metrics, "streamrec_serving_lookup_counts_dropped_total", {"reason": "full"}) == 3
    assert lc.flush() == 10


def test_the_thread_flushes_once_flush_ids_wait_and_stop_flushes_the_rest() -> None:
    fake = FakeCounts()
    lc = LookupCounts(fake, flush_s=3600, flush_ids=4).start()  # type: ignore[arg-type]  # only the size trigger
    try:
        lc.add("item", np.arange(4, dtype=np.int64))
        assert fake.written.wait(10), "4 lookups waiting (flush_ids) did not wake the flush thread"
        lc.add("user", np.array([5], np.int64))  # below flush_ids: waits for stop
        time.sleep(0.05)
        assert [c[0] for c in fake.calls] == ["item"]
    finally:
        lc.stop()
    assert [c[0] for c in fake.calls] == ["item", "user"]


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="flush_s"):
        LookupCounts(FakeCounts(), flush_s=0)  # type: ignore[arg-type]


def test_lookups_count_on_the_utc_day_they_were_made_not_the_day_of_the_flush() -> None:
    # A request at 23:59:59 UTC flushed at 00:00:01 belongs to the day it was served (the hot set ranks by day keys,
    # and a day key ages out of the window by its day): the flush must not move it to the next day.
    now = [4 * DAY_S - 1.0]
    fake = FakeCounts()
    lc = LookupCounts(fake, clock=lambda: now[0])  # type: ignore[arg-type]
    lc.add("item", np.array([7, 7], np.int64))
    now[0] = 4 * DAY_S + 1.0
    lc.add("item", np.array([7], np.int64))
    lc.add("user", np.array([1], np.int64))
    assert lc.flush() == 4
    assert sorted(fake.calls, key=lambda c: (c[3], c[0])) == [
        ("item", "lookup", {7: 2}, 3), ("item", "lookup", {7: 1}, 4), ("user", "lookup", {1: 1}, 4)]


@pytest.mark.parametrize("flush_s", [float("inf"), 1e10])
def test_a_flush_period_the_thread_cannot_wait_is_refused(flush_s: float) -> None:
    # threading.Event.wait(inf) raises OverflowError: the flush thread would die at once and nothing would be
    # flushed until stop, every lookup beyond max_pending dropped meanwhile.
    with pytest.raises(ValueError, match="flush_s"):
        LookupCounts(FakeCounts(), flush_s=flush_s)  # type: ignore[arg-type]


def test_stop_during_a_slow_flush_waits_for_it_then_writes_the_rest_and_leaves_no_thread() -> None:
    class SlowCounts(FakeCounts):
        def __init__(self) -> None:
            super().__init__()
            self.entered, self.release = threading.Event(), threading.Event()

        def add_counts(self, *args: object, **kwargs: object) -> None:
            if not self.calls:  # the thread's first flush hangs until released (Redis slow)
                self.entered.set()
                assert self.release.wait(10)
            super().add_counts(*args, **kwargs)  # type: ignore[arg-type]

    fake = SlowCounts()
    lc = LookupCounts(fake, flush_s=3600, flush_ids=2).start()  # type: ignore[arg-type]
    lc.add("item", np.array([1, 2], np.int64))
    assert fake.entered.wait(10)
    lc.add("item", np.array([3], np.int64))  # counted while the slow flush runs
    stopper = threading.Thread(target=lc.stop)
    stopper.start()
    time.sleep(0.05)
    assert stopper.is_alive()  # stop waits for the flush in progress
    fake.release.set()
    stopper.join(10)
    assert not stopper.is_alive() and lc._thread is None
    assert lc.flushed == 3 and lc.dropped == 0
    assert [c[2] for c in fake.calls] == [{1: 1, 2: 1}, {3: 1}]


def test_a_lookup_added_after_stop_is_dropped_and_counted_not_lost_silently() -> None:
    fake, metrics = FakeCounts(), ServingMetrics(lambda: None)
    lc = LookupCounts(fake, metrics).start()  # type: ignore[arg-type]
    lc.add("item", np.array([1, 2], np.int64))
    lc.stop()  # the last flush writes those two
    lc.add("item", np.array([3, 4, 5], np.int64))  # a request still running past the shutdown grace
    assert lc.flushed == 2 and lc.dropped == 3
    assert metric(metrics, "streamrec_serving_lookup_counts_dropped_total", {"reason": "stopped"}) == 3
    assert lc.flush() == 0  # nothing was left waiting for a flush that will never come


def test_stop_returns_within_its_bound_and_logs_the_thread_when_a_flush_is_stuck(
        caplog: pytest.LogCaptureFixture) -> None:
    # A flush stuck on Redis held stop()'s unbounded join, and so every ScoringService exit, for good.
    class StuckCounts(FakeCounts):
        def __init__(self) -> None:
            super().__init__()
            self.entered, self.release = threading.Event(), threading.Event()

        def add_counts(self, *args: object, **kwargs: object) -> None:
            self.entered.set()
            self.release.wait()  # stuck until the test lets it go
            super().add_counts(*args, **kwargs)  # type: ignore[arg-type]

    fake, metrics = StuckCounts(), ServingMetrics(lambda: None)
    lc = LookupCounts(fake, metrics, flush_s=3600, flush_ids=2).start()  # type: ignore[arg-type]
    thread = lc._thread
    try:
        lc.add("item", np.array([1, 2], np.int64))
        assert fake.entered.wait(10)
        lc.add("item", np.array([3], np.int64))  # waits for a last flush that cannot run
        with caplog.at_level("ERROR", logger="streamrec.serve"):
            lc.stop(timeout_s=0.1)
        assert lc._thread is None
        assert "lookup-counts" in caplog.text and "did not stop within 0.1 s" in caplog.text
        assert lc.dropped == 1
        assert metric(metrics, "streamrec_serving_lookup_counts_dropped_total", {"reason": "stopped"}) == 1
        lc.add("item", np.array([4], np.int64))  # stopped: dropped, not left for a flush that never comes
        assert lc.dropped == 2
        lc.stop(timeout_s=0.1)  # again (a second shutdown path): returns, where its flush waited on the stuck lock
    finally:
        fake.release.set()
        assert thread is not None
        thread.join(10)
    assert fake.calls == [("item", "lookup", {1: 1, 2: 1}, fake.calls[0][3])]  # the stuck flush still finishes


def test_stop_with_redis_not_answering_makes_one_flush_attempt_not_a_retry_of_it() -> None:
    # stop() woke the thread, whose flush timed out (2 s against a frozen Redis), then flushed again itself: the
    # retry of what that flush kept waited out a second timeout (a frozen Redis held `streamrec serve`'s exit ~4 s).
    fake, metrics = FakeCounts(), ServingMetrics(lambda: None)
    lc = LookupCounts(fake, metrics, flush_s=3600).start()  # type: ignore[arg-type]
    fake.down = True
    lc.add("item", np.arange(4, dtype=np.int64))
    lc.stop()
    assert len(fake.failed_ids) == 1, fake.failed_ids  # Redis waited on once
    assert (lc.flushed, lc.dropped) == (0, 4) and lc._thread is None
    assert metric(metrics, "streamrec_serving_lookup_counts_dropped_total", {"reason": "redis"}) == 4


def test_stop_during_a_flush_that_then_fails_does_not_wait_on_redis_again() -> None:
    class FrozenCounts(FakeCounts):
        """The thread's flush hangs (a frozen Redis) until released, then times out, as every later call does."""

        def __init__(self) -> None:
            super().__init__()
            self.entered, self.release = threading.Event(), threading.Event()

        def add_counts(self, *args: object, **kwargs: object) -> None:
            self.entered.set()
            assert self.release.wait(10)
            self.failed_ids.append(str(kwargs.get("write_id")))
            raise redis.TimeoutError("Timeout reading from redis")

    fake = FrozenCounts()
    lc = LookupCounts(fake, flush_s=3600, flush_ids=2).start()  # type: ignore[arg-type]
    lc.add("item", np.array([1, 2], np.int64))
    assert fake.entered.wait(10)
    lc.add("item", np.array([3], np.int64))  # counted while the flush hangs
    stopper = threading.Thread(target=lc.stop)
    stopper.start()
    assert lc._stop.wait(10)  # stop has begun: it waits for the flush in progress
    fake.release.set()  # that flush times out
    stopper.join(10)
    assert not stopper.is_alive() and lc._thread is None
    assert len(fake.failed_ids) == 1, fake.failed_ids  # no second round trip to the Redis that just timed out
    assert (lc.flushed, lc.dropped) == (0, 3)


def test_stop_just_after_a_failed_flush_does_not_wait_on_redis_again() -> None:
    # The thread's flush timed out against a frozen Redis just before stop began: stop flushed again (the kept write
    # and the lookups since) and waited out a second full timeout.
    fake, metrics = FakeCounts(), ServingMetrics(lambda: None)
    lc = LookupCounts(fake, metrics, flush_s=3600).start()  # type: ignore[arg-type]
    fake.down = True
    lc.add("item", np.arange(4, dtype=np.int64))
    assert lc.flush() == 0  # the flush just before stop: fails, keeps its write for a retry
    lc.add("item", np.array([9], np.int64))
    lc.stop()
    assert len(fake.failed_ids) == 1, fake.failed_ids  # no second round trip to the Redis that just failed
    assert (lc.flushed, lc.dropped) == (0, 5) and lc._thread is None
    assert metric(metrics, "streamrec_serving_lookup_counts_dropped_total", {"reason": "redis"}) == 5


def test_stop_long_after_a_failed_flush_makes_its_last_flush() -> None:
    # A failure older than RECENT_FAILURE_S says nothing of Redis now: stop still writes what waits (Redis is back).
    fake = FakeCounts()
    lc = LookupCounts(fake, flush_s=3600).start()  # type: ignore[arg-type]
    fake.down = True
    lc.add("item", np.arange(4, dtype=np.int64))
    assert lc.flush() == 0
    lc._failed_at -= RECENT_FAILURE_S  # as if it failed that long ago
    fake.down = False
    lc.add("item", np.array([9], np.int64))
    lc.stop()
    assert (lc.flushed, lc.dropped) == (5, 0) and len(fake.failed_ids) == 1


def test_stop_waits_on_its_last_flush_for_flush_timeout_s_once_however_long_redis_holds_the_write() -> None:
    # The last flush was bounded only by the client's timeouts, each per step: a connect, then every recv (a Redis
    # that trickles its reply a byte at a time within the timeout held `streamrec serve`'s exit 6.7x
    # lookup_counts_timeout_s, measured), and every write of the flush (a kind, a day) its own round trip.
    class HeldCounts(FakeCounts):
        """Each write is held (an unreachable or trickling Redis) until released, then fails as a timeout would."""

        def __init__(self) -> None:
            super().__init__()
            self.entered, self.release, self.done = threading.Event(), threading.Event(), threading.Event()

        def add_counts(self, *args: object, **kwargs: object) -> None:
            self.entered.set()
            try:
                self.release.wait(10)  # (the fake Redis's own socket timeout: an unbounded stop returns after it)
                raise redis.TimeoutError("Timeout reading from redis")
            finally:
                self.done.set()

    fake, metrics = HeldCounts(), ServingMetrics(lambda: None)
    lc = LookupCounts(fake, metrics, flush_s=3600, flush_timeout_s=0.05).start()  # type: ignore[arg-type]
    lc.add("item", np.array([1, 2], np.int64))
    lc.add("user", np.array([3], np.int64))
    try:
        lc.stop()
        assert fake.entered.is_set() and not fake.done.is_set()  # returned while Redis still held the write
    finally:
        fake.release.set()
    abandoned = lc._abandoned
    assert abandoned is not None and abandoned.name == "lookup-counts-last"
    abandoned.join(10)
    assert not abandoned.is_alive() and len(fake.failed_ids) == 0 and lc.flushed == 0
    assert lc.dropped == 3  # what it was writing, counted once it failed: no flush comes after the last
    assert metric(metrics, "streamrec_serving_lookup_counts_dropped_total", {"reason": "redis"}) == 3


def test_stop_waits_on_a_flush_in_progress_for_flush_timeout_s_not_its_thirty_second_bound(
        caplog: pytest.LogCaptureFixture) -> None:
    # A flush of the flush thread already under way as stop() began was waited for STOP_TIMEOUT_S (30 s): a Redis
    # trickling its reply held `streamrec serve`'s exit that long, where the last flush is held lookup_counts_timeout_s.
    class HeldCounts(FakeCounts):
        def __init__(self) -> None:
            super().__init__()
            self.entered, self.release = threading.Event(), threading.Event()

        def add_counts(self, *args: object, **kwargs: object) -> None:
            self.entered.set()
            self.release.wait(10)
            raise redis.TimeoutError("Timeout reading from redis")

    fake = HeldCounts()
    lc = LookupCounts(fake, ServingMetrics(lambda: None), flush_s=0.01, flush_timeout_s=0.05).start()  # type: ignore[arg-type]
    lc.add("item", np.array([1, 2], np.int64))
    assert fake.entered.wait(10)  # the flush thread is writing, held by Redis
    try:
        with caplog.at_level(logging.ERROR, logger="streamrec.serve"):
            lc.stop()
        assert not fake.release.is_set()  # stop returned while Redis still held the write
        assert "did not stop within 0.05 s" in caplog.text
    finally:
        fake.release.set()
        if lc._abandoned is not None:
            lc._abandoned.join(10)


def test_stop_that_leaves_its_last_flush_running_says_how_many_lookups_it_holds(
        caplog: pytest.LogCaptureFixture) -> None:
    # The warning named no number: a `streamrec serve` that exits right after lost those lookups without a record.
    class HeldCounts(FakeCounts):
        def __init__(self) -> None:
            super().__init__()
            self.release = threading.Event()

        def add_counts(self, *args: object, **kwargs: object) -> None:
            self.release.wait(10)
            raise redis.TimeoutError("Timeout reading from redis")

    fake = HeldCounts()
    lc = LookupCounts(fake, ServingMetrics(lambda: None), flush_s=3600, flush_timeout_s=0.05).start()  # type: ignore[arg-type]
    lc.add("item", np.array([1, 2], np.int64))
    lc.add("user", np.array([3], np.int64))
    try:
        with caplog.at_level(logging.WARNING, logger="streamrec.serve"):
            lc.stop()
        assert "its 3 lookups are counted when it ends, and lost uncounted if the process exits first" in caplog.text
    finally:
        fake.release.set()
        if lc._abandoned is not None:
            lc._abandoned.join(10)
