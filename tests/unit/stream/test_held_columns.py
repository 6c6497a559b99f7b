"""The records a batch holds past the frontier keep their event times as a column (``pipeline.Held``): passed again
with the next batches, only the new records' events are read, however long the held ones wait (on a replayed ML-1M
~50 k records wait per batch, and reading each one's time again with every batch cost seconds)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stream.config import KafkaSettings
from stream.joiner.config import JoinerSettings
from stream.joiner.engine import JoinConfig, PartitionJoin
from stream.joiner.pipeline import Held, JoinPipeline, JoinTotals, Record

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
    groups = {imps: _records(imps[0], range(100), [i * S for i in range(100)], reads),
              clicks: _records(clicks[0], range(3), [0, S, 2 * S], reads)}
    held = p._hold(groups, everything_behind, {})
    assert [r.offset for r in held] == list(range(4, 100))  # up to 3 s (the clicks' 2 s + the drift) joined now
    assert [r.offset for r in groups[imps][0]] == [0, 1, 2, 3]
    kept = p._held_groups[imps]
    assert isinstance(kept, Held) and kept.ts.dtype == np.int64 and kept.ts.tolist() == [i * S for i in range(4, 100)]

    # The next batch: the held records first (as process() passes them, with their columns), then new clicks.
    reads.clear()
    prior = p._held_groups
    p._held_groups = {}
    new_clicks = _records(clicks[0], range(3, 5), [3 * S, 4 * S], reads)
    groups = {imps: (list(prior[imps].records), list(prior[imps].events)), clicks: new_clicks}
    held = p._hold(groups, everything_behind, prior)
    assert sorted(reads) == [3 * S, 4 * S]  # only the new records' times were read
    assert [r.offset for r in groups[imps][0]] == [4, 5]  # the frontier moved with the clicks: 4 s + 1 s
    assert held[0].offset == 6 and p._held_groups[imps].ts.tolist() == [i * S for i in range(6, 100)]
