"""stream/joiner/pipeline.py: the users' histories go through one thread (``_on_history_lane``) while the batch goes
on, in the order the sequential steps had: per partition, its joined clicks appended, then its samples' histories
read. A failed call stops the ones after it, and a batch returns or fails only once the thread is idle."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import redis

from stream.config import KafkaSettings
from stream.events import Click, Impression
from stream.joiner.config import JoinerSettings
from stream.joiner.engine import JoinConfig, PartitionJoin
from stream.joiner.pipeline import JoinPipeline, JoinTotals

S = 1000  # ms


class FakeHistory:
    """Records each call with the thread it ran on; ``fail``: the call number (from 0) that raises."""

    def __init__(self, fail: int | None = None) -> None:
        self.calls: list[tuple[str, list[int], int]] = []
        self.fail = fail

    def _called(self, op: str, users: list[int]) -> None:
        if self.fail is not None and len(self.calls) == self.fail:
            self.calls.append((op + " (failed)", list(users), threading.get_ident()))
            raise redis.ConnectionError("redis went away")
        time.sleep(0.01)  # Redis answering: the batch goes on meanwhile
        self.calls.append((op, list(users), threading.get_ident()))

    def append_many(self, users: list[int], items: list[int], ts: list[int]) -> None:
        self._called("append", users)

    def as_of_flat(self, users: list[int], ts: list[int], limit: int) -> tuple[np.ndarray, np.ndarray]:
        self._called("read", users)
        return np.zeros(0, np.int64), np.zeros(len(users) + 1, np.int32)


class FakeProducer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []

    def send(self, topic: str, value: bytes | None, key: object, partition: int) -> None:
        self.sent.append((topic, partition))


def _pipeline(history: FakeHistory) -> JoinPipeline:
    """A JoinPipeline with what ``_apply`` uses (no broker, no Redis): two partitions' engines, ``wait`` policy."""
    p = JoinPipeline.__new__(JoinPipeline)
    p.kafka, p.js = KafkaSettings(), JoinerSettings()
    p.cfg = JoinConfig(watermark_quorum=1, window_ms=10 * S, lateness_ms=0)
    p.engines = {q: PartitionJoin(q, p.cfg) for q in (0, 1)}
    p.totals, p._last_click, p.clicks_held = JoinTotals(), {}, set()
    p.history, p.producer = history, FakeProducer()  # type: ignore[assignment]
    p._counts_buffer, p._names_buffer = {}, {"item": set(), "user": set()}
    p._counts_flushed, p._flushing = time.monotonic(), None
    p._history_lane, p._history_tail = ThreadPoolExecutor(max_workers=1), None
    return p


def _batch(partition: int) -> tuple[list[tuple[int, Impression]], list[tuple[int, Click]]]:
    """Two impressions, one clicked (a positive sample and a joined click at once under ``wait``)."""
    imps = [(0, Impression(f"p{partition}-a", 1 * S, f"u{partition}", 7)),
            (1, Impression(f"p{partition}-b", 2 * S, f"v{partition}", 8))]
    return imps, [(0, Click(f"p{partition}-a", 3 * S))]


def test_history_calls_run_on_one_thread_in_the_sequential_order() -> None:
    history = FakeHistory()
    p = _pipeline(history)
    try:
        out = p._apply({0: _batch(0), 1: _batch(1)})
    finally:
        p._history_lane.shutdown(wait=True)
    # per partition: its joined click appended, then its sample's history read (what the loop did in sequence)
    assert [op for op, _, _ in history.calls] == ["append", "read", "append", "read"]
    assert {thread for _, _, thread in history.calls} != {threading.get_ident()}
    assert len({thread for _, _, thread in history.calls}) == 1
    assert sorted(out) == [0, 1] and all(a.records for a in out.values())  # each state chunk encoded
    assert p._history_tail is None  # nothing of the batch left on the thread
    assert sorted(p.producer.sent) == sorted([(p.kafka.samples_topic, 0), (p.kafka.samples_topic, 1)])


def test_a_failed_history_call_fails_the_batch_and_stops_the_calls_after_it() -> None:
    history = FakeHistory(fail=0)  # partition 0's append
    p = _pipeline(history)
    try:
        with pytest.raises(redis.ConnectionError):
            p._apply({0: _batch(0), 1: _batch(1)})
    finally:
        p._history_lane.shutdown(wait=True)
    assert [op for op, _, _ in history.calls] == ["append (failed)"]  # no read, no later partition's append
    assert p._history_tail is None
    assert p.producer.sent == []  # no sample written for a batch that failed
