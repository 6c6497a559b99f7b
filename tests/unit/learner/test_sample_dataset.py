"""KafkaSampleDataset over an in-memory consumer: how bad and costly messages leave its batches."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import re
import time
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from torch.utils.data import IterableDataset, get_worker_info

import learner.kafka_dataset as kd
from learner.features import FeatureConfig, FieldSpec
from stream.config import KafkaSettings
from stream.metrics import INPUT_LOST
from stream.samples import WATERMARK_HEADER, SampleBatch, watermark_header
from stream.unfetched import UNFETCHED_GRACE_S

CFG = FeatureConfig((FieldSpec("user_id", "single", 50), FieldSpec("item_id", "single", 40),
                     FieldSpec("history", "sequence", 40, shares="item_id")), embedding_dim=4)


class Msg:
    def __init__(self, part: int, off: int, value: bytes | None, headers: list[tuple[str, bytes | None]] | None = None,
                 ) -> None:
        self._p, self._o, self._v, self._h = part, off, value, headers

    def error(self) -> None:
        return None

    def partition(self) -> int:
        return self._p

    def offset(self) -> int:
        return self._o

    def value(self) -> bytes | None:
        return self._v

    def key(self) -> None:
        return None

    def headers(self) -> list[tuple[str, bytes | None]] | None:  # (confluent-kafka's: None without headers)
        return self._h


HOLE = b"no record at this offset"  # a transaction's control record, a compacted-away record: a gap, nothing deleted


class Consumer:
    def __init__(self, parts: dict[int, list[bytes | None]], low: dict[int, int] | None = None,
                 jumps: dict[int, tuple[int, int]] | None = None) -> None:
        self.parts, self.pos = parts, {p: 0 for p in parts}
        self.low = low or {}  # partition -> its first offset still held (retention deleted the ones before)
        # partition -> (at, low): when the reader's fetch reaches offset ``at``, retention has deleted the records
        # before ``low``; librdkafka's fetch gets OFFSET_OUT_OF_RANGE and resets to the earliest offset, silently
        self.jumps = dict(jumps or {})

    def get_watermark_offsets(self, tp: Any, timeout: float | None = None, cached: bool = False) -> tuple[int, int]:
        return self.low.get(tp.partition, 0), len(self.parts[tp.partition])

    def position(self, tps: list[Any]) -> list[Any]:  # the next offset to hand out (librdkafka's, once one came)
        return [SimpleNamespace(offset=self.pos.get(tp.partition, -1001)) for tp in tps]

    def assign(self, tps: list[Any]) -> None:
        for tp in tps:  # an offset below what retention left: librdkafka's silent reset to the earliest one
            self.pos[tp.partition] = max(tp.offset, self.low.get(tp.partition, 0))

    def consume(self, n: int, timeout: float) -> list[Msg]:
        out: list[Msg] = []
        for p in sorted(self.pos):
            while self.pos[p] < len(self.parts[p]) and len(out) < n:
                if p in self.jumps and self.pos[p] >= self.jumps[p][0]:
                    if out and out[-1].partition() == p:
                        break  # this fetch ends here: the next one gets OFFSET_OUT_OF_RANGE
                    self.low[p] = self.pos[p] = self.jumps.pop(p)[1]
                    continue
                entry = self.parts[p][self.pos[p]]  # a value, or (value, headers)
                if entry is not HOLE:
                    out.append(Msg(p, self.pos[p], *entry) if isinstance(entry, tuple) else Msg(p, self.pos[p], entry))
                self.pos[p] += 1
        if not out:
            time.sleep(0.01)
        return out

    def pause(self, tps: list[Any]) -> None: ...

    def resume(self, tps: list[Any]) -> None: ...

    def close(self) -> None: ...


class DeadLetters:
    sent: list[tuple[int, int, str, str]] = []

    def __init__(self, kafka: KafkaSettings) -> None: ...

    def send(self, topic: str, key: Any, value: Any, error: Any, partition: int = -1, offset: int = -1,
             headers: Any = None) -> None:
        DeadLetters.sent.append((partition, offset, error.kind, error.reason))

    def flush(self) -> None: ...


def read(monkeypatch: pytest.MonkeyPatch, parts: dict[int, list[bytes | None]], max_values: int | None = None,
         start: dict[int, int] | None = None, low: dict[int, int] | None = None,
         jumps: dict[int, tuple[int, int]] | None = None,
         **kw: Any) -> tuple[list[kd.TensorBatch], list[tuple[int, int, str, str]]]:
    """The batches (with positions) a dataset over ``parts`` yields until idle (from ``start``, 0 by default, with
    retention having left the records from ``low`` on, and deleting more while it reads: ``jumps``), and its dead
    letters."""
    consumer = Consumer(parts, low, jumps)
    monkeypatch.setattr(kd, "new_consumer", lambda *a, **k: consumer)
    monkeypatch.setattr(kd, "has_more", lambda c, topic, p, unknown=False: c.pos[p] < len(parts[p]))
    monkeypatch.setattr(kd, "DeadLetters", DeadLetters)
    DeadLetters.sent = []
    ds = kd.KafkaSampleDataset(KafkaSettings(), CFG, start or {p: 0 for p in parts}, exit_when_idle_s=0.05, **kw)
    if max_values is not None:
        ds.max_values = max_values
    return [b for b in ds if b.positions], DeadLetters.sent


def sample(start: int, n: int = 1, history: int = 2, **over: Any) -> bytes:
    cols: dict[str, Any] = dict(
        impression_id=[f"i{start + k}" for k in range(n)], ts=1_700_000_000_000 + (start + np.arange(n)) * 1000,
        label=np.zeros(n), label_delay_ms=np.zeros(n), user_id=np.arange(n) + 1, item_id=np.arange(n) + 2,
        history=[list(range(1, history + 1))] * n)
    cols.update(over)
    return SampleBatch.from_columns(**cols).encode()


def test_a_checkpoint_offset_below_what_retention_left_is_logged_counted_and_read_from_the_first_record_held(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A learner down longer than the samples topic's retention resumes at checkpoint offsets whose records are gone:
    librdkafka's reset to the earliest offset skipped them without a word (stream/retention.py)."""
    lost = INPUT_LOST.labels("learner", KafkaSettings().samples_topic)
    before = lost._value.get()
    parts: dict[int, list[bytes | None]] = {0: [sample(k) for k in range(6)], 1: [sample(10 + k) for k in range(3)]}
    with caplog.at_level(logging.ERROR, logger="streamrec.retention"):
        batches, _ = read(monkeypatch, parts, start={0: 1, 1: 2}, low={0: 4, 1: 0})
    # offsets 1..3 of partition 0 pass as one zero-row batch at 3 (the next checkpoint starts at 4: not counted again)
    assert sorted(pos for b in batches for pos in b.positions) == [(0, 3, 0), (0, 4, 1), (0, 5, 1), (1, 2, 1)]
    assert lost._value.get() == before + 3
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "learner" in line and "partition 0, offsets 1..3" in line and "retention" in line


def test_a_partition_without_a_saved_offset_starting_below_retention_is_no_loss_now_or_at_the_next_start(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A fresh learner (or a partition new to its checkpoint) starts at 0 on a topic whose first records retention
    has deleted: it was owed nothing before its first run, so nothing is said or counted; a saved 0 still is."""
    lost = INPUT_LOST.labels("learner", KafkaSettings().samples_topic)
    before = lost._value.get()
    parts: dict[int, list[bytes | None]] = {0: [sample(k) for k in range(6)], 1: [sample(10 + k) for k in range(3)]}
    with caplog.at_level(logging.ERROR, logger="streamrec.retention"):
        batches, _ = read(monkeypatch, parts, low={0: 4, 1: 1}, unsaved=[0])
    # partition 0 starts at its first record, offsets 0..3 passed silently (a zero-row batch at 3: the next checkpoint
    # saves 4, not the 0 a second start took for a saved offset and counted as lost)
    assert sorted(pos for b in batches for pos in b.positions) == [(0, 3, 0), (0, 4, 1), (0, 5, 1), (1, 0, 0),
                                                                    (1, 1, 1), (1, 2, 1)]
    assert lost._value.get() == before + 1  # partition 1's saved 0, not partition 0's start
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "partition 1, offsets 0..0" in line


@pytest.mark.parametrize("merge", [False, True])
def test_records_deleted_while_the_learner_reads_are_logged_counted_and_passed_but_a_gap_without_loss_is_not(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, merge: bool) -> None:
    """A learner whose lag grows past the samples topic's retention while it runs: its fetch of partition 0 at
    offset 2 finds offsets up to 5 deleted and librdkafka resets it to 6 without a word. Partition 1 has no records
    at 1 and 2 (control records: nothing deleted) and at 5, the first record held after retention deleted 3 and 4."""
    lost = INPUT_LOST.labels("learner", KafkaSettings().samples_topic)
    before = lost._value.get()
    parts: dict[int, list[bytes | None]] = {
        0: [sample(k) for k in range(8)], 1: [sample(10), HOLE, HOLE, sample(13), HOLE, HOLE, sample(16)]}
    with caplog.at_level(logging.ERROR, logger="streamrec.retention"):
        batches, _ = read(monkeypatch, parts, jumps={0: (2, 6), 1: (4, 5)}, merge=merge)
    # what was lost passes as a zero-row batch at the last of it, before the next record read
    assert sorted(pos for b in batches for pos in b.positions) == [
        (0, 0, 1), (0, 1, 1), (0, 5, 0), (0, 6, 1), (0, 7, 1), (1, 0, 1), (1, 3, 1), (1, 4, 0), (1, 6, 1)]
    assert lost._value.get() == before + 4 + 1
    zero, one = sorted((r.getMessage() for r in caplog.records if r.levelno == logging.ERROR),
                       key=lambda line: "partition 1" in line)
    assert "4 record(s) of" in zero and "partition 0, offsets 2..5" in zero and "fell behind" in zero
    assert "1 record(s) of" in one and "partition 1, offsets 4..4" in one and "goes on from offset 6" in one


def test_a_fresh_partition_whose_first_offset_the_broker_did_not_say_is_no_loss_when_reading_starts_there(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Its start stayed at 0, expected as such: librdkafka's start at the first record held looked like a gap, and
    every record before it was said and counted lost (the review)."""
    from confluent_kafka import KafkaError, KafkaException

    calls = [0]
    real = Consumer.get_watermark_offsets

    def first_call_times_out(self: Consumer, tp: Any, timeout: float | None = None, cached: bool = False,
                             ) -> tuple[int, int]:
        calls[0] += 1
        if calls[0] == 1:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "timed out"))
        return real(self, tp, timeout, cached)

    monkeypatch.setattr(Consumer, "get_watermark_offsets", first_call_times_out)
    lost = INPUT_LOST.labels("learner", KafkaSettings().samples_topic)
    before = lost._value.get()
    with caplog.at_level(logging.ERROR, logger="streamrec.retention"):
        batches, _ = read(monkeypatch, {0: [sample(k) for k in range(6)]}, low={0: 4}, unsaved=[0])
    assert [pos[:2] for b in batches for pos in b.positions] == [(0, 4), (0, 5)]
    assert lost._value.get() == before and not [r for r in caplog.records if r.levelno == logging.ERROR]


def test_a_training_batch_closes_at_its_value_bound_not_only_at_batch_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows alone did not bound a batch's memory: 4096 one-row messages of a million history ids each were one
    batch."""
    consumer_parts = {0: [sample(k, history=6) for k in range(4)]}
    batches, dead = read(monkeypatch, consumer_parts, max_values=10, batch_rows=4096, merge=False)
    assert not dead
    assert [b.positions for b in batches] == [[(0, 0, 1), (0, 1, 1)], [(0, 2, 1), (0, 3, 1)]]


@pytest.mark.parametrize("merge", [False, True])
def test_a_message_with_a_row_past_future_ts_s_is_dead_lettered_and_its_neighbours_train(
        monkeypatch: pytest.MonkeyPatch, merge: bool) -> None:
    """A far-future ts moved the learner's event time: user buckets decayed to zero, ids evicted under a TTL."""
    now = int(time.time() * 1000)
    ahead = sample(50, n=2, ts=np.array([now - 60_000, now + 2 * 3_600_000]))
    parts = {0: [sample(0), ahead, sample(1)], 1: [sample(2), sample(3)]}
    batches, dead = read(monkeypatch, parts, batch_rows=1, merge=merge, future_ts_s=3600.0)
    assert [(p, o, kind) for p, o, kind, _ in dead] == [(0, 1, "future_ts")]
    assert re.search(r"column 'ts': a row 7\d\d\d s ahead of the learner's clock, over \[learner\] future_ts_s=3600",
                     dead[0][3])
    trained = sorted((p, o) for b in batches for p, o, rows in b.positions if rows)
    assert trained == [(0, 0), (0, 2), (1, 0), (1, 1)]


@pytest.mark.parametrize("merge", [False, True])
def test_a_message_with_a_malformed_watermark_header_is_dead_lettered_with_its_reason(
        monkeypatch: pytest.MonkeyPatch, merge: bool) -> None:
    """The joiner writes one 8-byte ``streamrec-watermark`` header on every samples message. One of another length,
    without a value, or two that disagree was taken for no header at all, in silence (not dead-lettered, counted or
    logged): the partition's batch went by the click clock, which closes windows the joiner still has open."""
    malformed: list[list[tuple[str, bytes | None]]] = [
        [(WATERMARK_HEADER, b"\x00" * 7)], [(WATERMARK_HEADER, None)],
        [watermark_header(1000), watermark_header(2000)]]
    parts: dict[int, list[Any]] = {0: [(sample(0), [watermark_header(500)])]
                                   + [(sample(1 + k), h) for k, h in enumerate(malformed)]
                                   + [(sample(9), [watermark_header(900)])]}
    batches, dead = read(monkeypatch, parts, batch_rows=1, merge=merge)
    assert [(p, o, kind) for p, o, kind, _ in dead] == [(0, 1, "bad_header"), (0, 2, "bad_header"),
                                                        (0, 3, "bad_header")]
    assert "7 bytes" in dead[0][3] and "no value" in dead[1][3] and "2 streamrec-watermark headers" in dead[2][3]
    trained = [([pos for pos in b.positions if pos[2]], b.watermarks) for b in batches if len(b)]
    assert trained == [([(0, 0, 1)], {0: 500}), ([(0, 4, 1)], {0: 900})]


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize(("ahead_ms", "kind", "reason"), [
    ((1 << 63) - 1, "bad_value", "past 4102444800000"),  # int64 max: no joiner's event time, whatever the clock
    (2 * 3_600_000, "future_ts", r"7\d\d\d s ahead of the learner's clock, over \[learner\] future_ts_s=3600")])
def test_a_watermark_header_ahead_of_any_event_time_the_joiner_takes_is_dead_lettered(
        monkeypatch: pytest.MonkeyPatch, merge: bool, ahead_ms: int, kind: str, reason: str) -> None:
    """A watermark closes every impression of its partition with ``ts + window <= watermark``, and a partition's
    watermark never goes back (learner/served.py): one header of int64 max served every impression of the partition,
    pending and to come, as a 0 at once, their delayed positives counted unmatched, for the rest of the run. The
    joiner's watermark is an event time it took (``[limits] future_ts_s``): one further ahead is a forgery or a bug."""
    now = int(time.time() * 1000)
    wm = ahead_ms if ahead_ms > now else now + ahead_ms
    parts: dict[int, list[Any]] = {0: [(sample(0), [watermark_header(500)]), (sample(1), [watermark_header(wm)]),
                                       (sample(2), [watermark_header(900)])]}
    batches, dead = read(monkeypatch, parts, batch_rows=1, merge=merge, future_ts_s=3600.0)
    assert [(p, o, k) for p, o, k, _ in dead] == [(0, 1, kind)]
    assert re.search(reason, dead[0][3]) and "streamrec-watermark" in dead[0][3]
    trained = [([pos for pos in b.positions if pos[2]], b.watermarks) for b in batches if len(b)]
    assert trained == [([(0, 0, 1)], {0: 500}), ([(0, 2, 1)], {0: 900})]

@pytest.mark.parametrize("merge", [False, True])
def test_a_message_with_a_label_delay_over_the_attribution_window_is_dead_lettered(
        monkeypatch: pytest.MonkeyPatch, merge: bool) -> None:
    """The joiner writes no delay over its window; one of 10^12 ms moved the calibration clock (ts + delay) decades
    ahead of a replay: every later impression matured at once, fitted as a 0 before its click came."""
    long = sample(50, n=2, label=np.array([1, 1]), label_delay_ms=np.array([60_000, 10**12]))
    parts = {0: [sample(0), long, sample(1)], 1: [sample(2)]}
    batches, dead = read(monkeypatch, parts, batch_rows=1, merge=merge, max_label_delay_s=1800.0)
    assert [(p, o, kind) for p, o, kind, _ in dead] == [(0, 1, "bad_value")]
    assert "column 'label_delay_ms': a delay of 1000000000 s, over [learner] attribution_window_s=1800" in dead[0][3]
    assert sorted((p, o) for b in batches for p, o, rows in b.positions if rows) == [(0, 0), (0, 2), (1, 0)]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class StallingConsumer(Consumer):
    """The learner's consumer of a live stream around a stall: one message a poll (each poll 50 ms), a poll with
    nothing waits out its timeout; the poll ``stall_at`` is where the process was stopped for ``stall_s``: it returns
    nothing (librdkafka's fetcher was stopped too), and the messages that arrived meanwhile come with the next polls."""

    def __init__(self, clock: Clock, parts: dict[int, list[bytes | None]], stall_at: int, stall_s: float) -> None:
        super().__init__(parts)
        self.clock, self.stall_at, self.stall_s, self.polls = clock, stall_at, stall_s, 0

    def consume(self, n: int, timeout: float) -> list[Msg]:
        self.polls += 1
        if self.polls == self.stall_at:
            self.clock.t += self.stall_s
            return []
        out = [Msg(p, self.pos[p], self.parts[p][self.pos[p]]) for p in sorted(self.pos)
               if self.pos[p] < len(self.parts[p])][:1]
        for m in out:
            self.pos[m.partition()] += 1
        self.clock.t += 0.05 if out else timeout
        return out


def idle_run(monkeypatch: pytest.MonkeyPatch, stall_at: int, stall_s: float, step_s: float = 0.0,
             ) -> tuple[list[tuple[int, int]], float]:
    """The messages a dataset with ``exit_when_idle_s=10`` trains of 6 in a live stream stalled as in
    :class:`StallingConsumer` (on a fake clock; each batch handed on takes ``step_s`` to train), and when it ends."""
    clock = Clock()
    monkeypatch.setattr(kd.time, "monotonic", clock)
    consumer = StallingConsumer(clock, {0: [sample(k) for k in range(6)]}, stall_at, stall_s)
    monkeypatch.setattr(kd, "new_consumer", lambda *a, **k: consumer)
    ds = kd.KafkaSampleDataset(KafkaSettings(), CFG, {0: 0}, batch_rows=1, exit_when_idle_s=10.0)
    trained = []
    for b in ds:
        trained += [(p, o) for p, o, rows in b.positions if rows]
        clock.t += step_s
    return trained, clock.t


def test_a_stall_past_the_idle_limit_is_not_idleness_and_the_samples_of_the_stall_are_trained(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A learner stopped for 12 s (SIGSTOP, a long GC pause) with ``--exit-when-idle 10`` while samples kept
    arriving took the stall for idleness: the first poll after it came back empty and the run ended, "input idle",
    without the samples of the stall (the frozen-learner fault test, tests/integration/test_faults.py)."""
    trained, end = idle_run(monkeypatch, stall_at=4, stall_s=12.0)
    assert trained == [(0, k) for k in range(6)]
    assert end == pytest.approx(12.0 + 6 * 0.05 + 10.0, abs=0.5)  # then 10 s of polls that brought nothing


def test_idleness_without_a_stall_ends_the_run_at_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    trained, end = idle_run(monkeypatch, stall_at=0, stall_s=0.0)
    assert trained == [(0, k) for k in range(6)] and end == pytest.approx(6 * 0.05 + 10.0, abs=0.5)


def test_a_slow_training_step_at_every_heartbeat_still_lets_an_idle_run_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each batch handed on, the idle heartbeats too, takes 3 s (a slow checkpoint each time): every gap between
    polls is over the stall bound, and the run must still end, not poll for ever."""
    trained, _ = idle_run(monkeypatch, stall_at=0, stall_s=0.0, step_s=3.0)
    assert trained == [(0, k) for k in range(6)]


def test_a_consumer_close_that_fails_as_an_error_ends_the_reading_does_not_hide_that_error(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # The finally's close() replaced the error in flight: a fatal consume error surfaced as close's RuntimeError, and
    # the daemon classified the wrong failure.
    class Failing(Consumer):
        def consume(self, n: int, timeout: float) -> list[Msg]:
            raise kd.KafkaException(kd.KafkaError(kd.KafkaError._FATAL, "fenced", fatal=True))

        def close(self) -> None:
            raise RuntimeError("Consumer closed")

    consumer = Failing({0: [sample(0)]})
    monkeypatch.setattr(kd, "new_consumer", lambda *a, **k: consumer)
    monkeypatch.setattr(kd, "has_more", lambda c, topic, p, unknown=False: True)
    monkeypatch.setattr(kd, "DeadLetters", DeadLetters)
    ds = kd.KafkaSampleDataset(KafkaSettings(), CFG, {0: 0}, exit_when_idle_s=0.05)
    with caplog.at_level(logging.WARNING, logger=kd.log.name), pytest.raises(kd.KafkaException, match="fenced"):
        list(ds)
    assert "closing the consumer of partitions" in caplog.text and "Consumer closed" in caplog.text


def test_a_consumer_close_that_fails_after_a_clean_end_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    class Failing(Consumer):
        def close(self) -> None:
            raise RuntimeError("Consumer closed")

    consumer = Failing({0: [sample(0)]})
    monkeypatch.setattr(kd, "new_consumer", lambda *a, **k: consumer)
    monkeypatch.setattr(kd, "has_more", lambda c, topic, p, unknown=False: c.pos[p] < 1)
    monkeypatch.setattr(kd, "DeadLetters", DeadLetters)
    ds = kd.KafkaSampleDataset(KafkaSettings(), CFG, {0: 0}, exit_when_idle_s=0.05)
    with pytest.raises(RuntimeError, match="Consumer closed"):
        list(ds)


@pytest.mark.parametrize("merge", [False, True])
def test_the_watermark_a_drain_writes_a_window_past_its_newest_event_is_taken_not_dead_lettered(
        monkeypatch: pytest.MonkeyPatch, merge: bool) -> None:
    """At exit (``drain_at_exit``) the engine moves event time past every window: the last samples message, with every
    pending impression as a 0, carries the watermark newest event + window (stream/joiner/engine.py). Events of now
    under a 2-hour window made it 7,200 s ahead of the clock: dead-lettered as ``future_ts`` at ``future_ts_s=3600``,
    the drain's samples never trained. The bound is ``future_ts_s`` + the window (``max_label_delay_s``)."""
    from stream.events import Impression
    from stream.joiner.engine import JoinConfig, PartitionJoin

    engine = PartitionJoin(0, JoinConfig(window_ms=7_200_000))
    now = int(time.time() * 1000)
    engine.apply([(0, Impression(impression_id="i0", ts=now, user_id="u", item_id="i"))], [])
    engine.apply([], [], drain=True)
    assert engine.watermark is not None and engine.watermark - now >= 7_200_000
    parts: dict[int, list[Any]] = {0: [(sample(0, ts=[now]), [watermark_header(engine.watermark)])]}
    batches, dead = read(monkeypatch, parts, batch_rows=1, merge=merge, future_ts_s=3600.0, max_label_delay_s=7200.0)
    assert dead == []
    assert [b.watermarks for b in batches if len(b)] == [{0: engine.watermark}]


class GrowingConsumer(Consumer):
    """The learner's consumer of a samples topic that grows while it reads (an operator adds partitions: the local
    broker cannot, it has no CreatePartitions): the partitions of ``later`` exist, with their records, from the fake
    clock's ``at`` on. Each poll takes 0.05 s, one with nothing its timeout. Counts the metadata requests."""

    def __init__(self, clock: Clock, parts: dict[int, list[bytes | None]], later: dict[int, list[bytes | None]],
                 at: float, low: dict[int, int] | None = None) -> None:
        super().__init__(dict(parts), low)
        self.clock, self.later, self.at, self.metadata_requests = clock, later, at, 0
        self.parts.update(later)
        self.assigned: list[list[tuple[int, int]]] = []

    def list_topics(self, topic: str, timeout: float | None = None) -> Any:
        self.metadata_requests += 1
        parts = set(self.parts) - (set(self.later) if self.clock.t < self.at else set())
        return SimpleNamespace(topics={topic: SimpleNamespace(partitions=dict.fromkeys(parts), error=None)})

    def assign(self, tps: list[Any]) -> None:
        self.pos = {}
        super().assign(tps)
        self.assigned.append([(tp.partition, tp.offset) for tp in tps])

    def incremental_assign(self, tps: list[Any]) -> None:
        assert not {tp.partition for tp in tps} & set(self.pos), "assigned twice"
        super().assign(tps)
        self.assigned.append([(tp.partition, tp.offset) for tp in tps])

    def consume(self, n: int, timeout: float) -> list[Msg]:
        out = [Msg(p, o, self.parts[p][o]) for p in sorted(self.pos) for o in range(self.pos[p], len(self.parts[p]))]
        for m in out[:n]:
            self.pos[m.partition()] = m.offset() + 1
        self.clock.t += 0.05 if out else timeout
        return out[:n]


def grow(monkeypatch: pytest.MonkeyPatch, parts: dict[int, list[bytes | None]],
         later: dict[int, list[bytes | None]], low: dict[int, int] | None = None,
         consumer_type: type[GrowingConsumer] = GrowingConsumer, **kw: Any,
         ) -> tuple[kd.KafkaSampleDataset, GrowingConsumer]:
    """A dataset reading ``parts`` (the whole topic when it was listed, ``listed``) until 60 s idle on a fake clock,
    while ``later`` is added to the topic at 40 s; and its consumer."""
    clock = Clock()
    monkeypatch.setattr(kd.time, "monotonic", clock)
    consumer = consumer_type(clock, parts, later, at=40.0, low=low)
    monkeypatch.setattr(kd, "new_consumer", lambda *a, **k: consumer)
    monkeypatch.setattr(kd, "has_more", lambda c, topic, p, unknown=False: c.pos[p] < len(c.parts[p]))
    ds = kd.KafkaSampleDataset(KafkaSettings(), CFG, kw.pop("start", {p: 0 for p in parts}), exit_when_idle_s=60.0,
                               listed=kw.pop("listed", list(parts)), unsaved=kw.pop("unsaved", list(parts)), **kw)
    return ds, consumer


def grow_run(monkeypatch: pytest.MonkeyPatch, parts: dict[int, list[bytes | None]],
             later: dict[int, list[bytes | None]], low: dict[int, int] | None = None, **kw: Any,
             ) -> tuple[list[tuple[int, int, int]], GrowingConsumer]:
    """Every position the dataset of :func:`grow` hands on; and its consumer."""
    ds, consumer = grow(monkeypatch, parts, later, low, **kw)
    positions = [pos for b in ds for pos in b.positions]
    return positions, consumer


@pytest.mark.parametrize("before", [1, 2], ids=["one-partition-unmerged", "two-partitions-merged"])
def test_a_samples_partition_added_while_the_learner_reads_is_read_from_its_first_record_held(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, before: int) -> None:
    """A partition added to the samples topic while the learner ran was read only after a restart: its samples
    waited, silently. Now the reader asks for the topic's partitions every PARTITION_CHECK_S (not at every poll),
    assigns a new one at its first record held (a record before it deleted already passes as a zero-row batch, as
    for a partition without a saved offset at the start), merges it in event time and says so once."""
    parts = {p: [sample(10 * p + k) for k in range(3)] for p in range(before)}
    new = before
    caplog.set_level(logging.INFO, logger="streamrec.train")
    lost_before = INPUT_LOST.labels("learner", KafkaSettings().samples_topic)._value.get()
    positions, consumer = grow_run(monkeypatch, parts, {new: [sample(100 + k) for k in range(4)]}, low={new: 1})
    assert [pos for pos in positions if pos[0] == new] == [(new, 0, 0), (new, 1, 1), (new, 2, 1), (new, 3, 1)]
    assert sorted(pos for pos in positions if pos[0] != new and pos[2]) == [(p, k, 1) for p in parts for k in range(3)]
    assert consumer.assigned[-1] == [(new, 1)]  # added to what it reads, at its first record held
    assert 1 <= consumer.metadata_requests <= consumer.clock.t / kd.PARTITION_CHECK_S + 1
    said = [r for r in caplog.records if r.levelno == logging.INFO and "added" in r.getMessage()]
    assert len(said) == 1 and f"[{new}]" in said[0].getMessage()
    assert INPUT_LOST.labels("learner", KafkaSettings().samples_topic)._value.get() == lost_before  # nothing owed


def test_a_reader_given_no_partition_list_reads_only_its_start_partitions(monkeypatch: pytest.MonkeyPatch) -> None:
    positions, consumer = grow_run(monkeypatch, {0: [sample(0)]}, {1: [sample(1)]}, listed=None)
    assert {p for p, _, _ in positions} == {0} and consumer.metadata_requests == 0


def test_a_partition_added_while_the_learner_reads_goes_to_its_rank_then_its_dataloader_worker(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same ownership as at the start: rank r of N reads the partitions p % N == r, its DataLoader worker w of n
    those of them with (p // N) % n == w (learner/distributed.py). Rank 1 of 2, worker 1 of 3, over a topic of 2
    partitions grown to 6: it starts with none of its own (partition 1 is worker 0's) and still watches, then reads 3
    (1, 5: other workers; 0, 2, 4: rank 0)."""
    monkeypatch.setattr(kd, "get_worker_info", lambda: SimpleNamespace(num_workers=3, id=1))
    later = {p: [sample(10 * p)] for p in range(2, 6)}
    positions, consumer = grow_run(monkeypatch, {1: [sample(1)]}, later, start={1: 0}, listed=[0, 1], unsaved=[1],
                                   shard=(1, 2))
    assert {p for p, _, _ in positions} == {3}
    assert consumer.assigned == [[], [(3, 0)]]


def test_a_dataloader_workers_batches_say_the_partitions_it_reads_those_added_while_it_reads_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What a hung worker is named with (learner/worker_stall.py): the training process knew only the start's split,
    and a partition the worker took on later was missing from the stall's list the operator acts on."""
    monkeypatch.setattr(kd, "get_worker_info", lambda: SimpleNamespace(num_workers=1, id=0))
    ds, _ = grow(monkeypatch, {0: [sample(0)]}, {1: [sample(1)]})
    said = [(b.positions, b.worker_partitions) for b in ds]
    assert said[0] == ([(0, 0, 1)], (0,))
    assert ([(1, 0, 1)], (0, 1)) in said and said[-1][1] == (0, 1)


class SlowBroker(GrowingConsumer):
    """A broker up but slow: each watermark query (one per partition at a start) takes ``SLOW_S`` of the fake clock,
    and one for a partition without a saved offset runs out its timeout."""

    SLOW_S = 9.0
    fresh: frozenset[int] = frozenset()  # the partitions without a saved offset (set by the test)

    def get_watermark_offsets(self, tp: Any, timeout: float | None = None, cached: bool = False) -> tuple[int, int]:
        if cached:  # what the last fetch said: no broker call
            return super().get_watermark_offsets(tp, timeout, cached)
        if tp.partition in self.fresh:
            assert timeout is not None
            self.clock.t += timeout
            raise kd.KafkaException(kd.KafkaError(kd.KafkaError._TIMED_OUT))
        self.clock.t += self.SLOW_S
        return super().get_watermark_offsets(tp, timeout)


@pytest.mark.parametrize("saved", [False, True],
                         ids=["fresh-partitions-timing-out", "saved-partitions-answered-slowly"])
def test_a_reader_starting_on_a_slow_broker_hands_over_a_heartbeat_between_its_broker_calls(
        monkeypatch: pytest.MonkeyPatch, saved: bool) -> None:
    """A DataLoader worker starting on a slow broker asks for each partition's first offset (up to 10 s each) before
    its first batch: with 8 partitions it handed nothing over for 80 s, and a ``[learner] worker_stall_s`` below that
    named a healthy worker hung and stopped the learner. Now no more than one broker call passes without a hand-over,
    while a worker hung inside one call still hands nothing over (learner/worker_stall.py)."""
    parts = {p: [sample(p)] for p in range(8)}
    monkeypatch.setattr(SlowBroker, "fresh", frozenset() if saved else frozenset(parts))
    ds, _ = grow(monkeypatch, parts, {}, consumer_type=SlowBroker, listed=None, unsaved=[] if saved else list(parts))
    clock = kd.time.monotonic
    handed, positions = [0.0], []
    for b in ds:
        handed.append(clock())
        positions += b.positions
    assert max(b - a for a, b in zip(handed[:-1], handed[1:], strict=True)) <= 10.0
    assert sorted(positions) == [(p, 0, 1) for p in parts]  # and it reads them all


def test_a_reading_closed_at_a_start_heartbeat_closes_its_consumer_and_a_failing_close_is_logged_not_raised(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The iteration closed at a heartbeat between the start's broker calls (a learner stopped while a worker starts
    on a slow broker): its consumer is closed, and a close that fails is logged as the main loop's is (the start's own
    close raised it out of the generator's close in place of the GeneratorExit, a worker's end failing on it)."""
    closed: list[bool] = []

    class FailingClose(SlowBroker):
        def close(self) -> None:
            closed.append(True)
            raise RuntimeError("Consumer closed")

    parts = {p: [sample(p)] for p in range(4)}
    monkeypatch.setattr(SlowBroker, "fresh", frozenset())
    ds, consumer = grow(monkeypatch, parts, {}, consumer_type=FailingClose, listed=None, unsaved=[])
    batches = iter(ds)
    first = next(batches)
    assert first.positions == [] and consumer.assigned == []  # a heartbeat of the start, nothing assigned yet
    with caplog.at_level(logging.WARNING, logger=kd.log.name):
        batches.close()  # type: ignore[attr-defined]
    assert closed == [True]
    assert "closing the consumer of partitions [0, 1, 2, 3] failed too" in caplog.text


def test_a_run_of_dead_letters_written_on_a_slow_broker_hands_over_a_heartbeat_between_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each dead letter is flushed before the next message (up to its timeout): 20 undecodable messages in one fetch
    on a slow broker handed nothing over for 100 s, and a DataLoader worker was named hung (learner/worker_stall.py)."""
    ds, consumer = grow(monkeypatch, {0: [b"not samples"] * 20}, {}, listed=None)

    class SlowDeadLetters(DeadLetters):
        def flush(self) -> None:
            consumer.clock.t += 5.0

    monkeypatch.setattr(kd, "DeadLetters", SlowDeadLetters)
    DeadLetters.sent = []
    handed = [0.0]
    for _ in ds:
        handed.append(consumer.clock.t)
    assert max(b - a for a, b in zip(handed[:-1], handed[1:], strict=True)) < 2 * 5.0  # never two flushes
    assert [(p, o) for p, o, _, _ in DeadLetters.sent] == [(0, o) for o in range(20)]  # each dead-lettered once


@pytest.mark.parametrize(("shard", "partitions", "shares"), [((1, 2), [1, 3, 5, 7], [[1, 5], [3, 7]]),
                                                            ((0, 1), [0, 1, 2, 3], [[0, 2], [1, 3]])])
def test_every_dataloader_worker_of_a_rank_reads_its_share_of_the_ranks_partitions(
        monkeypatch: pytest.MonkeyPatch, shard: tuple[int, int], partitions: list[int], shares: list[list[int]],
) -> None:
    """Rank 1 of 2 reads the odd partitions; its 2 workers dealt them by ``p % 2``: worker 0 read none and sat idle,
    worker 1 read all four. Now each reads half, in the sharded learner as in one process (one rule for both)."""
    ds = kd.KafkaSampleDataset(KafkaSettings(), CFG, {p: 0 for p in partitions}, shard=shard)
    got = []
    for w in range(len(shares)):
        monkeypatch.setattr(kd, "get_worker_info", lambda w=w: SimpleNamespace(num_workers=len(shares), id=w))
        got.append(ds._my_partitions())
    assert got == shares


@pytest.mark.parametrize("workers", [2, 0])
def test_records_lost_to_retention_that_a_dataloader_worker_finds_are_counted_once_in_the_training_process(
        monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    """With ``num_workers > 0`` the reader, and the retention counter it increments, ran in the DataLoader workers:
    the learner's /metrics (the training process's registry) never counted a record lost. Partition 0 (worker 0)
    resumes at a saved offset below its first record held (3 lost), partition 1 (worker 1) falls behind retention
    while it reads (2 lost): each batch carries what its worker counted, counted by the training process; without
    workers, counted once as before."""
    from torch.utils.data import DataLoader

    from learner.worker_counters import count_worker_counters

    lost = INPUT_LOST.labels("learner", KafkaSettings().samples_topic)
    before = lost._value.get()
    parts: dict[int, list[bytes | None]] = {0: [sample(k) for k in range(6)], 1: [sample(10 + k) for k in range(6)]}

    def assigned_only(*a: Any, **k: Any) -> Consumer:  # one per reader (worker): it reads what it is assigned
        consumer = Consumer(parts, {0: 4}, {1: (2, 4)})
        consumer.pos = {}
        return consumer

    monkeypatch.setattr(kd, "new_consumer", assigned_only)
    monkeypatch.setattr(kd, "has_more", lambda c, topic, p, unknown=False: c.pos[p] < len(parts[p]))
    ds = kd.KafkaSampleDataset(KafkaSettings(), CFG, {0: 1, 1: 0}, exit_when_idle_s=0.05)
    positions = []
    for batch in DataLoader(ds, batch_size=None, num_workers=workers):
        count_worker_counters(batch)
        positions += batch.positions
    assert sorted(positions) == [(0, 3, 0), (0, 4, 1), (0, 5, 1), (1, 0, 1), (1, 1, 1), (1, 3, 0), (1, 4, 1),
                                 (1, 5, 1)]
    assert lost._value.get() == before + 3 + 2


class OneIdleWorker(IterableDataset):
    """Worker 0 has nothing to read until ``go`` is set (a worker caught up, or with no partition); worker 1 has a
    backlog of ``BACKLOG`` batches. Bounded, so that a loader that waits for worker 0 ends in a failed assertion, not
    a hang."""

    BACKLOG = 5

    def __init__(self, go: Any) -> None:
        super().__init__()
        self.go = go

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        assert info is not None
        if info.id == 0:
            self.go.wait(30)
            yield 0
            return
        yield from [1] * self.BACKLOG


def test_a_dataloader_worker_with_nothing_to_read_does_not_hold_back_the_backlog_of_another() -> None:
    """An in-order DataLoader takes one batch of each worker in turn: a worker with nothing to read (its partitions
    caught up, or none of them) held a worker with a backlog to its idle heartbeat, one batch a second. The learners'
    loader hands on each batch as its worker has it: the backlog is all trained before the idle worker says a word."""
    go = multiprocessing.get_context("fork").Event()
    got = []
    for worker in kd.sample_loader(OneIdleWorker(go), num_workers=2, prefetch_factor=2, pin_memory=False):
        got.append(int(worker))
        if got.count(1) == OneIdleWorker.BACKLOG:
            go.set()  # the idle worker's partition gets a record only now
    assert got == [1] * OneIdleWorker.BACKLOG + [0]


class Cycle:
    """Cyclic garbage, as a Kafka client in a reference cycle is: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.mark.parametrize("workers", [2, 0])
def test_the_learners_loader_collects_cyclic_garbage_before_it_forks_dataloader_workers(workers: int) -> None:
    """A librdkafka client left in a reference cycle, collected in a forked DataLoader worker, hangs or crashes it
    (module docstring). The one-process daemon collected before its loader; the sharded one did not. The loader both
    use does, when it has workers to fork (without, nothing is forked: no collection a batch would wait for)."""
    gc.disable()  # the collector runs only where the code under test calls it
    try:
        garbage = weakref.ref(Cycle())
        kd.sample_loader(OneIdleWorker(None), num_workers=workers, prefetch_factor=2, pin_memory=False)
        assert (garbage() is None) == (workers > 0)
    finally:
        gc.enable()
        gc.collect()


def test_the_loaders_workers_are_forked_whatever_the_default_start_method_so_a_sasl_password_reaches_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Secret pickles empty (stream/secrets.py): under forkserver (Python 3.14's Linux default) or spawn the dataset,
    its Kafka settings with it, was pickled into each worker and the SASL password arrived as ""."""
    import multiprocessing
    import pickle

    from stream.config import KafkaSettings
    from stream.secrets import Secret

    kafka = KafkaSettings(security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_username="u",
                          sasl_password=Secret("s3cret"))
    assert pickle.loads(pickle.dumps(kafka)).sasl_password.reveal() == ""  # what a pickled worker would get
    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: "forkserver")
    loader = kd.sample_loader(OneIdleWorker(None), num_workers=2, prefetch_factor=2, pin_memory=False)
    assert loader.multiprocessing_context.get_start_method() == "fork"
    assert kd.sample_loader(OneIdleWorker(None), num_workers=0, prefetch_factor=2,
                            pin_memory=False).multiprocessing_context is None


class SlowFirstFetch(Consumer):
    """librdkafka's consumer at a start whose first fetch is slow (a 105 MB response under load, a slow broker, a group
    join): each poll that hands out nothing waits out its timeout on the fake clock; the high watermark its fetcher saw
    (``cached=True``) is unknown until ``known_at`` (None: never), no record comes before ``records_at`` (None: never),
    and the position is unknown until a record is handed out, as librdkafka's."""

    def __init__(self, clock: Clock, parts: dict[int, list[bytes | None]], known_at: float | None,
                 records_at: float | None) -> None:
        super().__init__(parts)
        self.clock, self.known_at, self.records_at = clock, known_at, records_at
        self.pos, self.handed = {}, {}  # it reads what it is assigned

    def get_watermark_offsets(self, tp: Any, timeout: float | None = None, cached: bool = False) -> tuple[int, int]:
        if cached and (self.known_at is None or self.clock.t < self.known_at):
            return -1001, -1001  # no fetch answered since the assignment
        return super().get_watermark_offsets(tp, timeout, cached)

    def position(self, tps: list[Any]) -> list[Any]:
        return [SimpleNamespace(offset=self.handed.get(tp.partition, -1001)) for tp in tps]

    def consume(self, n: int, timeout: float) -> list[Msg]:
        assert self.clock.t < 600.0, "still polling after 600 s (fake clock) with nothing to read: waiting for ever"
        out = [] if self.records_at is None or self.clock.t < self.records_at else super().consume(n, timeout)
        for m in out:
            self.handed[m.partition()] = m.offset() + 1
        self.clock.t += 0.05 if out else timeout
        return out


def slow_first_fetch(monkeypatch: pytest.MonkeyPatch, known_at: float | None, records_at: float | None,
                     start: int = 0, worker: bool = False, loader_workers: int = 0,
                     ) -> tuple[list[tuple[int, int]], float]:
    """The messages a reader with ``exit_when_idle_s=1`` of partitions 0 and 1 (3 samples each; as DataLoader worker 1
    of 2: partition 1 only) trains over :class:`SlowFirstFetch`, started at ``start``, read through a DataLoader with
    ``loader_workers`` worker processes if any; and when it ends (in this process)."""
    clock = Clock()
    monkeypatch.setattr(kd.time, "monotonic", clock)
    if worker:
        monkeypatch.setattr(kd, "get_worker_info", lambda: SimpleNamespace(num_workers=2, id=1))
    consumer = SlowFirstFetch(clock, {p: [sample(10 * p + k) for k in range(3)] for p in (0, 1)}, known_at, records_at)
    monkeypatch.setattr(kd, "new_consumer", lambda *a, **k: consumer)
    ds = kd.KafkaSampleDataset(KafkaSettings(), CFG, {0: start, 1: start}, exit_when_idle_s=1.0)
    batches = iter(kd.sample_loader(ds, loader_workers, 2, False) if loader_workers else ds)
    try:
        trained = [(p, o) for b in batches for p, o, rows in b.positions if rows]
    finally:  # its workers (their queue's feeder thread) shut down now, the error raised or not
        getattr(batches, "_shutdown_workers", lambda: None)()
    return sorted(trained), clock.t


@pytest.mark.parametrize("worker", [False, True], ids=["one-process", "dataloader-worker"])
def test_a_bounded_run_waits_out_a_first_fetch_slower_than_its_idle_limit_and_trains_its_input(
        monkeypatch: pytest.MonkeyPatch, worker: bool) -> None:
    """A first fetch slower than ``exit_when_idle_s`` (a 105 MB response under load: test_kafka_dataset's receive-limit
    test) ended the run "idle" with nothing read, and it reported success. Now the idle exit waits while a partition's
    end is unknown (no fetch answered: 0-5 s, within Unfetched's grace) and while it is known to have more (5-8 s: the
    watermark says 3, nothing handed out yet, the position the assigned start); a DataLoader worker the same."""
    trained, end = slow_first_fetch(monkeypatch, known_at=5.0, records_at=8.0, worker=worker)
    assert trained == [(p, k) for p in ((1,) if worker else (0, 1)) for k in range(3)]
    assert end >= 8.0 + 1.0  # then idle for its limit


@pytest.mark.parametrize("loader_workers", [0, 1], ids=["in-process", "in-a-dataloader-worker"])
def test_a_bounded_run_whose_partitions_are_never_fetched_fails_naming_them_not_ends_as_complete(
        monkeypatch: pytest.MonkeyPatch, loader_workers: int) -> None:
    """Every fetch failing (a broker that never answers): past Unfetched's grace the run fails, naming the topic, the
    partitions, the broker and the fix, instead of exiting 0 as if its input were trained (it ended at 1 s with
    nothing read); raised in a DataLoader worker, the training process gets the same error."""
    with pytest.raises(kd.SamplesNeverFetched) as err:
        slow_first_fetch(monkeypatch, known_at=None, records_at=None, loader_workers=loader_workers)
    said = str(err.value)
    kafka = KafkaSettings()
    assert f"{kafka.samples_topic} partition(s) [0, 1] were never fetched" in said
    assert f"bootstrap_servers={kafka.bootstrap_servers}" in said and "fix the broker" in said
    assert f"in {UNFETCHED_GRACE_S + 1.0:.0f} s" in said  # the grace, after the idle limit


def test_a_partition_assigned_at_its_end_is_idle_once_its_end_is_known_not_waited_on_for_ever(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """librdkafka's position stays unknown while nothing is handed out: the start the reader assigned (3, the end)
    stands in for it, so a caught-up reader ends at its limit (counted as "more" it would poll for ever)."""
    trained, end = slow_first_fetch(monkeypatch, known_at=0.5, records_at=None, start=3)
    assert trained == [] and end < UNFETCHED_GRACE_S
