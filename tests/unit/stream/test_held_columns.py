"""The records a batch holds past the frontier stay in ``records.Held``, with their event times as a column: with the
next batches only the new records' events are read and the held ones are neither walked nor copied, however long they
wait (on a replayed ML-1M ~75 k records wait per batch; reading each one's time again, or copying the held lists, with
every batch cost seconds)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stream.config import KafkaSettings
from stream.joiner.config import JoinerSettings
from stream.joiner.engine import JoinConfig, PartitionJoin
from stream.joiner.pipeline import JoinPipeline
from stream.joiner.records import Held, Record
from stream.joiner.totals import JoinTotals

KAFKA = KafkaSettings()
S = 1000  # ms


@dataclass
class CountedEvent:
    """An event whose event time counts its reads."""

    _ts: int
    reads: list[int]

    @property
    def ts(self) -> int:
        self.reads.append(self._ts)
        return self._ts


def _pipeline() -> JoinPipeline:
    """A JoinPipeline with only what the hold reads (no broker, no Redis): one partition's engine."""
    p = JoinPipeline.__new__(JoinPipeline)
    p.kafka, p.js = KAFKA, JoinerSettings(max_input_drift_s=1.0)
    p.engines = {0: PartitionJoin(0, JoinConfig(watermark_quorum=1))}
    p.totals, p._held_groups, p._reached = JoinTotals(), {}, {}
    return p


def _records(topic: str, offsets: range, times: list[int], reads: list[int]):
    recs = [Record(topic, 0, o, None, None) for o in offsets]
    return recs, [CountedEvent(t, reads) for t in times]


def test_held_records_times_are_kept_as_a_column_and_not_read_again() -> None:
    p, reads = _pipeline(), []
    imps = KAFKA.impressions_topic, 0
    clicks = KAFKA.clicks_topic, 0
    everything_behind = lambda kind, partition: True  # noqa: E731 - both inputs have more to read
    # Impressions run 100 s ahead of the clicks read so far: past the frontier (clicks' time + 1 s) they are held.
    p._held_groups_add(*_records(imps[0], range(100), [i * S for i in range(100)], reads))
    p._held_groups_add(*_records(clicks[0], range(3), [0, S, 2 * S], reads))
    groups = p._take(everything_behind)
    assert [r.offset for r in groups[imps][0]] == [0, 1, 2, 3]  # up to 3 s (the clicks' 2 s + the drift) joined now
    kept = p._held_groups[imps]
    assert isinstance(kept, Held) and kept.ts.dtype == np.int64 and kept.ts.tolist() == [i * S for i in range(4, 100)]
    assert [r.offset for r in kept.held()[0]] == list(range(4, 100)) and len(p._held_groups[clicks]) == 0

    # The next batch: new clicks only; the held impressions come first without being passed again.
    reads.clear()
    p._held_groups_add(*_records(clicks[0], range(3, 5), [3 * S, 4 * S], reads))
    groups = p._take(everything_behind)
    assert sorted(reads) == [3 * S, 4 * S]  # only the new records' times were read
    assert [r.offset for r in groups[imps][0]] == [4, 5]  # the frontier moved with the clicks: 4 s + 1 s
    assert kept.held()[0][0].offset == 6 and kept.ts.tolist() == [i * S for i in range(6, 100)]


def test_a_held_record_is_neither_copied_nor_walked_while_it_waits() -> None:
    """The held records' list is the same object batch after batch (appended to, taken from the front by moving
    ``lo``), until the taken front is compacted away; nothing but the new records' times is read."""
    h, reads = Held(), []
    recs, events = _records(KAFKA.impressions_topic, range(10), list(range(10)), reads)
    h.add(recs, events)
    lists = h.records, h.events
    assert h.take(3)[0] == recs[:3] and len(h) == 7 and h.ts.tolist() == list(range(3, 10))
    more, more_events = _records(KAFKA.impressions_topic, range(10, 12), [10, 11], reads)
    reads.clear()
    h.add(more, more_events)
    h.compact()  # 3 taken: far fewer than Held._COMPACT, kept at the front
    assert (h.records, h.events) == lists and h.records is lists[0] and h.lo == 3
    assert sorted(reads) == [10, 11] and h.held()[0] == recs[3:] + more
    h.take(len(h))
    h.compact()  # all taken: fresh lists
    assert len(h) == 0 and h.lo == 0 and h.records == [] and h.records is not lists[0]


def test_a_failed_batch_leaves_the_held_records_as_they_were() -> None:
    """``snapshot`` / ``restore``: what a failed batch appended and took is undone, so the next try (and the strikes)
    see exactly the records held before it."""
    h, reads = Held(), []
    h.add(*_records(KAFKA.clicks_topic, range(5), list(range(5)), reads))
    h.take(2)
    h.compact()
    before = h.snapshot()
    h.add(*_records(KAFKA.clicks_topic, range(5, 8), [5, 6, 7], reads))
    h.take(4)
    h.restore(before)
    assert [r.offset for r in h.held()[0]] == [2, 3, 4] and h.ts.tolist() == [2, 3, 4] and len(h) == 3
