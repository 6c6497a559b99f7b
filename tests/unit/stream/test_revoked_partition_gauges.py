"""A partition revoked from a join worker (or lost, or dropped for a rewind) takes its per-partition gauges with it:
watermark, oldest pending age, live state chunks, input paused (stream/joiner/metrics.py, ``forget``). They used to keep
their last value, so two workers exported the partition, the owner's live series beside the revoked worker's frozen
one: an alert on the max of the oldest pending age fired for ever on the stale series, a sum counted it twice. Driven
through each driver's own rebalance callback; the partitions the worker keeps keep their series."""

from __future__ import annotations

import asyncio
import shutil
from collections import Counter
from types import SimpleNamespace
from typing import Any

from confluent_kafka import TopicPartition
from faust.types import TP
from prometheus_client import generate_latest

from stream.config import KafkaSettings
from stream.joiner import metrics as m
from stream.joiner.backpressure import CLICKS
from stream.joiner.config import JoinerSettings
from stream.joiner.engine import JoinConfig, PartitionJoin
from stream.joiner.kafka_driver import KafkaJoinWorker
from stream.joiner.pipeline import JoinPipeline
from stream.joiner.totals import JoinTotals
from stream.joiner.worker import FaustJoinWorker

KAFKA = KafkaSettings(bootstrap_servers="127.0.0.1:9")
KEPT, REVOKED = 40, 41  # partition numbers no other test's gauges use
GAUGES = ("streamrec_join_watermark_ms", "streamrec_join_oldest_pending_age_seconds",
          "streamrec_join_state_live_chunks", "streamrec_join_input_paused")


def exported(partition: int) -> set[str]:
    """The per-partition gauges ``/metrics`` shows a series of for ``partition``."""
    lines = generate_latest().decode().splitlines()
    return {name for name in GAUGES for line in lines if line.startswith(name + "{") and
            f'partition="{partition}"' in line}


def pipeline() -> JoinPipeline:
    """A JoinPipeline with only what the rebalance callbacks use (no broker, no Redis): engines of KEPT and REVOKED
    with a watermark, their gauges exported as a batch exports them."""
    p = JoinPipeline.__new__(JoinPipeline)
    p.kafka, p.js, p.totals = KAFKA, JoinerSettings(), JoinTotals()
    p.engines = {part: PartitionJoin(part, JoinConfig(watermark_quorum=1)) for part in (KEPT, REVOKED)}
    for eng in p.engines.values():
        eng.max_ts = 1_700_000_000_000
    p._held_groups, p._held_list, p.held_counts, p._reached, p._last_click, p._parts = {}, [], {}, {}, {}, {}
    p.started_over, p._ids_asked = set(), {}
    p.strikes = SimpleNamespace(forget=lambda partitions: None)  # type: ignore[assignment]
    m.gauges(p.engines, Counter())
    return p


def paused_clicks(worker: Any) -> None:
    """Both partitions' clicks paused by the gate (counted as its own decision counts them), then by the driver."""
    keys = {(CLICKS, KEPT), (CLICKS, REVOKED)}
    worker.gate.count(keys, set())
    worker.gate.paused |= keys
    worker._sync_pauses()
    assert exported(KEPT) == exported(REVOKED) == set(GAUGES)


class Consumer:
    """What the kafka driver's revocation does with librdkafka's consumer."""

    def pause(self, partitions: list[TopicPartition]) -> None:
        pass

    def resume(self, partitions: list[TopicPartition]) -> None:
        pass


def test_a_partition_revoked_from_the_kafka_driver_leaves_no_gauge_series_and_the_kept_ones_stay() -> None:
    w = KafkaJoinWorker(pipeline(), KAFKA, JoinerSettings())
    w.consumer.close()
    w.consumer = Consumer()  # type: ignore[assignment]
    w._assigned = {KEPT, REVOKED}
    paused_clicks(w)
    w._on_revoke(w.consumer, [TopicPartition(t, REVOKED) for t in (KAFKA.impressions_topic, KAFKA.clicks_topic)])
    assert exported(REVOKED) == set()
    assert exported(KEPT) == set(GAUGES)


def test_a_partition_revoked_from_the_faust_driver_leaves_no_gauge_series_and_the_kept_ones_stay(
        monkeypatch: Any) -> None:
    consumer = SimpleNamespace(forget_kept=lambda tps: None, pause_partitions=lambda tps: None,
                               resume_partitions=lambda tps: None)
    monkeypatch.setattr(FaustJoinWorker, "_build_app", lambda _self: SimpleNamespace(consumer=consumer,
                                                                                 rebalancing=False))
    w = FaustJoinWorker(pipeline(), KAFKA, JoinerSettings())
    shutil.rmtree(w._datadir)
    w._assigned = {KEPT, REVOKED}
    paused_clicks(w)
    asyncio.run(w._on_revoked(None, {TP(t, REVOKED) for t in (KAFKA.impressions_topic, KAFKA.clicks_topic)}))
    assert exported(REVOKED) == set()
    assert exported(KEPT) == set(GAUGES)
