"""stream/joiner/pipeline.py: day counts written by the writer thread; a failed write keeps its counts buffered."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from stream.features import hash_value
from stream.joiner.pipeline import JoinPipeline


class FakeCounts:
    def __init__(self, fail_first: bool) -> None:
        self.fail, self.calls, self.threads = fail_first, [], set()

    def record(self, kind: str, event: str, ids: list[int], ts: list[int], names: dict) -> None:
        self.threads.add(threading.get_ident())
        if self.fail:
            self.fail = False
            raise redis.ConnectionError("redis went away")
        self.calls.append((kind, event, list(ids), list(ts), dict(names)))


def pipeline_with(counts: FakeCounts) -> JoinPipeline:
    """Only the counting part of a pipeline (no broker, no Redis)."""
    p = JoinPipeline.__new__(JoinPipeline)
    p.counts = counts  # type: ignore[assignment]
    p._counts_buffer, p._names_buffer = {}, {"item": set(), "user": set()}
    p._counts_flushed = time.monotonic()
    p._counts_writer = ThreadPoolExecutor(max_workers=1)
    p._flushing = None
    return p


def buffer(p: JoinPipeline, ids: list[int], ts: list[int], raw: str) -> None:
    got = p._counts_buffer.setdefault(("item", "impression"), ([], []))
    got[0].extend(ids)
    got[1].extend(ts)
    p._names_buffer["item"].add(raw)


def test_counts_are_written_by_the_writer_thread_with_their_names() -> None:
    counts = FakeCounts(fail_first=False)
    p = pipeline_with(counts)
    try:
        written_by_the_writer(p, counts)
    finally:
        p._counts_writer.shutdown(wait=True)


def written_by_the_writer(p: JoinPipeline, counts: FakeCounts) -> None:
    buffer(p, [1, 2], [10, 20], "a")
    p._start_flush()
    assert p._counts_buffer == {} and p._names_buffer == {"item": set(), "user": set()}  # buffering afresh
    p.flush_counts()
    assert counts.calls == [("item", "impression", [1, 2], [10, 20], {hash_value("a"): "a"})]
    assert threading.get_ident() not in counts.threads


def test_a_failed_write_raises_and_its_counts_are_written_with_the_next_flush_ahead_of_newer_ones() -> None:
    counts = FakeCounts(fail_first=True)
    p = pipeline_with(counts)
    try:
        failed_then_rewritten(p, counts)
    finally:
        p._counts_writer.shutdown(wait=True)


def failed_then_rewritten(p: JoinPipeline, counts: FakeCounts) -> None:
    buffer(p, [1, 2], [10, 20], "a")
    p._start_flush()
    buffer(p, [3], [30], "b")  # counted while the write was in flight
    with pytest.raises(redis.ConnectionError):
        p._finish_flush()
    assert p._counts_buffer == {("item", "impression"): ([1, 2, 3], [10, 20, 30])}
    assert p._names_buffer["item"] == {"a", "b"}
    p.flush_counts()
    assert [c[2] for c in counts.calls] == [[1, 2, 3]]  # written once, nothing lost
