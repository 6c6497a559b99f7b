"""The learner's lag: samples-topic messages not trained yet, per partition (``streamrec_learner_lag_samples``).

Both daemons publish it after each checkpoint (``learner/daemon.py``, ``learner/sharded_daemon.py``), each for the
partitions it reads: one process every partition of the topic, a rank of the sharded learner its own (``p % N``,
``learner.distributed.partitions_of``), on its own ``/metrics``, so the ranks' series never share a label and summing
them over the ranks counts every partition once. A partition counts from the next message the learner trains to the
partition's end (its high watermark); one the learner has not trained from yet (no saved offset: a fresh learner,
a partition added while it reads) from its first record held, where its reader starts it
(``learner/kafka_dataset.py``). The partitions are the topic's as the broker lists them at the time, so one added
since the learner started counts before its reader finds it and before its first batch trains: a learner stuck
on such a partition shows its backlog, not no lag. Records below a partition's first record held (taken by
retention) are never trained and do not count. Best effort: a broker that does not answer leaves the last values.
A DataLoader worker's death is no broker's: torch raises it once, from its SIGCHLD handler, wherever the training
process is (here, returning from a watermark request); taken for a broker error, it was never raised again, and the
dead worker's partitions stalled for good while the live workers' idle batches kept the learner running.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaException, TopicPartition
from prometheus_client import Gauge

from learner.distributed import partitions_of
from learner.kafka_dataset import worker_died

LAG = Gauge("streamrec_learner_lag_samples", "Messages in samples not yet trained, per partition.", ["partition"])


def partition_lag(next_offset: int | None, low: int, high: int) -> int:
    """Messages of a partition not trained yet: from ``next_offset`` (the next to train; None: none trained and no
    saved offset, so its first record held), but not below ``low`` (the first record held), to ``high`` (its end)."""
    start = low if next_offset is None else max(next_offset, low)
    return max(0, high - start)


def publish_lag(consumer: Any, topic: str, offsets: Mapping[int, int], shard: tuple[int, int] = (0, 1),
                timeout_s: float = 2.0) -> None:
    """Set :data:`LAG` for each partition of ``topic`` that this reader owns (``shard``: its rank and the world
    size): the topic's partitions as ``consumer`` lists them now, and those in ``offsets`` (the next offset to train
    of each partition trained or saved; empty: the learner has not listed its topic, nothing is asked). One metadata
    request and one watermark request per partition; a broker that does not list the topic is asked nothing more (a
    broker away costs one ``timeout_s``, not one per partition)."""
    if not offsets:
        return
    try:
        listed = set(consumer.list_topics(topic, timeout=timeout_s).topics[topic].partitions)
    except (KafkaException, KeyError):
        return
    for p in partitions_of(sorted(listed | set(offsets)), *shard):
        try:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - lag is best effort
            if worker_died(exc):  # torch says it once, wherever the learner is: swallowed, never again (docstring)
                raise
            continue
        # A broker that reports the last batch's start as its high watermark under-counts by < 1 batch.
        LAG.labels(str(p)).set(partition_lag(offsets.get(p), low, high))
