"""Prometheus metrics of the joiner."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from contextlib import suppress
from typing import TYPE_CHECKING

from prometheus_client import Counter as PCounter
from prometheus_client import Gauge

from stream.joiner.backpressure import CLICKS as CLICKS_INPUT
from stream.joiner.backpressure import IMPRESSIONS, PAUSED
from stream.metrics import DLQ_MESSAGES, EVENTS

if TYPE_CHECKING:
    from stream.joiner.engine import PartitionJoin

__all__ = ["ASSIGN_RETRIES", "BATCHES_FAILED", "DLQ_MESSAGES", "counted", "forget", "gauges", "held"]

SAMPLES = PCounter("streamrec_join_samples_total", "Samples written, by label.", ["label"])
CLICKS = PCounter("streamrec_join_clicks_total", "Clicks by outcome (joined, late, orphan, duplicate, "
                  "before_impression).", ["outcome"])
COVERAGE = Gauge("streamrec_join_click_coverage", "Clicks joined / clicks seen since the worker started.")
PENDING = Gauge("streamrec_join_pending_impressions", "Impressions waiting inside their attribution window.")
WATERMARK = Gauge("streamrec_join_watermark_ms", "Event-time watermark per partition.", ["partition"])
OLDEST_PENDING = Gauge("streamrec_join_oldest_pending_age_seconds", "Event time from the oldest impression still "
                       "inside its attribution window to the partition's impression input time, per partition (0: none "
                       "waits). "
                       "Above the window, expiry is stuck: the watermark is held back (a click input that stalled).",
                       ["partition"])
HELD = Gauge("streamrec_join_held_records", "Records read but held back past their partition's event-time frontier "
             "(either driver's hold, stream/joiner/backpressure.py), by input, over the worker's partitions: memory "
             "the worker holds until the other input catches up.", ["input"])

SNAPSHOTS = PCounter("streamrec_join_state_snapshots_total", "State chunks written that hold a partition's whole join "
                     "state, each retiring every chunk before it (stream/joiner/engine.py, PartitionJoin._compact: "
                     "once the live chunks outweigh twice the state). Many a minute: a partition whose event time "
                     "stands still (an input stalled) compacting over and over.")
LIVE_CHUNKS = Gauge("streamrec_join_state_live_chunks", "Chunks of the join state log not retired (tombstoned) yet, "
                    "per partition: what a restore of the partition reads. Compaction keeps it bounded.", ["partition"])

BATCHES_FAILED = PCounter("streamrec_join_batches_failed_total", "Tries of a batch that failed before its state was "
                          "durable (an outage, a producer error: the worker rewinds and does the batch again from its "
                          "input, or stops). What such a try counted is dropped: the other streamrec_join_* counters "
                          "and streamrec_events_total{stage=\"join\"} count each batch once, when it is durable "
                          "(stream/joiner/totals.py). streamrec_dlq_messages_total counts dead letters sent, a retry's "
                          "again.")

ASSIGN_RETRIES = PCounter("streamrec_join_assign_retries_total", "Times the kafka driver could not read the partition "
                          "layout or the start positions (the group's committed offsets) of partitions assigned to it "
                          "and asked again: the broker unreachable or slow during a rebalance.")

TOPIC_CHANGED = PCounter("streamrec_join_topic_changed_total", "Partitions restored whose state log's offsets were of "
                         "another input topic of that name (another topic id: deleted and created again, another "
                         "cluster): that input read from its first record, by input.", ["input"])

REDIS_EMPTIED = PCounter("streamrec_join_redis_emptied_total", "Times the joiner found Redis had lost its keys under "
                         "the prefix (stream/keyspace.py: restarted without persistence, flushed; on a Redis Cluster "
                         "the node of that hash tag's slot), by tag: click histories and that kind's day counts start "
                         "again from empty.", ["tag"])


INPUTS = (IMPRESSIONS, CLICKS_INPUT)


def held(counts: dict[str, int]) -> None:
    """The held records per input (absent: none)."""
    for kind in INPUTS:
        HELD.labels(kind).set(counts.get(kind, 0))


PER_PARTITION = (WATERMARK, OLDEST_PENDING, LIVE_CHUNKS)  # the gauges labelled by partition alone (and PAUSED)


def forget(partitions: Iterable[int]) -> None:
    """Remove the per-partition gauges' series of ``partitions``, whose engines this worker dropped (revoked, lost, or
    a rewind that restores them with the next batch): a series kept would go on exporting the last value of a partition
    that another worker owns now, frozen beside the owner's live one (an alert taking the max fires on it for ever, a
    sum counts the partition twice). The drivers call it after their last pause sync of them, which sets a resumed
    input's :data:`PAUSED` to 0. Counters stay: they are this worker's totals and never go back."""
    for p in partitions:
        labels = [(gauge, (str(p),)) for gauge in PER_PARTITION] + [(PAUSED, (kind, str(p))) for kind in INPUTS]
        for gauge, values in labels:
            with suppress(KeyError):  # never set (no watermark yet, never paused): older prometheus_client raises
                gauge.remove(*values)


def counted(done: Counter[str], totals: Counter[str]) -> None:
    """A durable batch's counts (``JoinTotals.batch_done``: what it staged, once, whatever tries failed before it) added
    to the counters; the click coverage from the run's totals."""
    EVENTS.labels("join", "impressions").inc(done["impressions"])
    EVENTS.labels("join", "clicks").inc(done["clicks"])
    SAMPLES.labels("1").inc(done["positives"])
    SAMPLES.labels("0").inc(done["samples"] - done["positives"])
    for outcome in ("joined", "late", "orphan", "duplicate", "before_impression"):
        if done[f"{outcome}_clicks"]:
            CLICKS.labels(outcome).inc(done[f"{outcome}_clicks"])
    if done["snapshots"]:
        SNAPSHOTS.inc(done["snapshots"])
    if totals["clicks"]:
        COVERAGE.set(totals["joined_clicks"] / totals["clicks"])


def gauges(engines: dict[int, PartitionJoin], totals: Counter[str]) -> None:
    """The gauges after a partition's join, live (a failed batch's engines are dropped and restored, and these set
    again): pending impressions, and per partition its watermark, oldest pending age and live state chunks."""
    PENDING.set(totals["pending_impressions"])
    for p, eng in engines.items():
        if eng.watermark is not None:
            WATERMARK.labels(str(p)).set(eng.watermark)
        oldest, newest = eng.oldest_pending_ts(), eng.topic_max[0]
        OLDEST_PENDING.labels(str(p)).set(0.0 if oldest is None or newest is None else max(0, newest - oldest) / 1000)
        LIVE_CHUNKS.labels(str(p)).set(eng.live_chunks)
