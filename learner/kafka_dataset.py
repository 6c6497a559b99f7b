"""A ``torch.utils.data.IterableDataset`` over the ``samples`` topic.

Each Kafka message is one Arrow sample batch (``stream/samples.py``); messages are decoded and
turned into tensors without per-row Python (``learner/batch.py``), then joined into training
batches of about ``batch_rows`` rows. A message is never split: every yielded batch lists the
``(partition, offset, rows)`` of the messages it holds, which is what checkpoints record.

Partitions and start offsets are explicit (the checkpoint's), not a consumer group's: the learner
seeks to exactly where its model state stopped. With DataLoader workers, worker ``w`` of ``n`` reads
the partitions ``p`` with ``p % n == w``. A message that cannot be decoded or turned into tensors
(whatever the exception) goes to ``samples.dlq`` with the reason, and its offset still counts as
consumed, so it is never retried in a loop. ``suspects`` are messages that were in a batch whose
training failed (``stream/strikes.py``): each is yielded as a batch of its own, and one with a
poison reason is dead-lettered instead.

The dead-letter producer is made on the first message an iteration dead-letters (most iterations make
none, so they leave no Kafka client behind) and dropped when the iteration ends. A producer left to the
cyclic garbage collector may be collected in a forked DataLoader worker, where destroying the parent's
librdkafka client hangs or crashes; an ``AckedProducer`` that is no reference cycle is destroyed at once,
in the process that made it, when this drops it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from torch.utils.data import IterableDataset, get_worker_info

from learner.batch import TensorBatch, concat, to_tensors
from learner.features import FeatureConfig
from stream.config import KafkaSettings
from stream.dlq import DeadLetters
from stream.errors import BadMessage, clip
from stream.kafka import new_consumer
from stream.samples import SampleBatch


class KafkaSampleDataset(IterableDataset):
    def __init__(self, kafka: KafkaSettings, cfg: FeatureConfig, start: dict[int, int], batch_rows: int = 4096,
                 exit_when_idle_s: float | None = None, pin_memory: bool = False,
                 suspects: dict[tuple[int, int], str | None] | None = None) -> None:
        super().__init__()
        self.kafka, self.cfg, self.start = kafka, cfg, dict(start)
        self.batch_rows, self.exit_when_idle_s, self.pin = batch_rows, exit_when_idle_s, pin_memory
        self.suspects = dict(suspects or {})  # (partition, offset) -> poison reason, or None: train it alone

    def _my_partitions(self) -> list[int]:
        info = get_worker_info()
        parts = sorted(self.start)
        if info is None:
            return parts
        return [p for p in parts if p % info.num_workers == info.id]

    def __iter__(self) -> Iterator[TensorBatch]:
        parts = self._my_partitions()
        if not parts:
            return
        topic = self.kafka.samples_topic
        consumer = new_consumer(self.kafka, f"{self.kafka.client_id}-samples-reader", **{
            "fetch.max.bytes": 64 * 1024 * 1024, "max.partition.fetch.bytes": 16 * 1024 * 1024})
        dlq: DeadLetters | None = None  # made on the first dead letter
        consumer.assign([TopicPartition(topic, p, self.start[p]) for p in parts])
        pending: list[TensorBatch] = []
        rows = 0
        last_data = last_yield = time.monotonic()
        try:
            while True:
                msgs = consumer.consume(256, 0.2)
                for m in msgs:
                    err = m.error()
                    if err is not None:
                        if err.code() != KafkaError._PARTITION_EOF and err.fatal():
                            raise KafkaException(err)
                        continue
                    last_data = time.monotonic()
                    part, offset = m.partition(), m.offset()
                    assert part is not None and offset is not None  # set on every consumed message
                    pos = (part, offset)
                    suspect = pos in self.suspects
                    try:
                        if suspect and self.suspects[pos] is not None:
                            raise BadMessage(str(self.suspects[pos]), kind="poison")
                        sb = SampleBatch.decode(m.value())
                        tb = to_tensors(sb, self.cfg, [(*pos, len(sb))])
                    except Exception as exc:  # noqa: BLE001 - whatever a message does, it must not stop the learner
                        bad = exc if isinstance(exc, BadMessage) else BadMessage(
                            f"cannot be turned into tensors: {type(exc).__name__}: {clip(str(exc))}",
                            kind="undecodable")
                        if dlq is None:
                            dlq = DeadLetters(self.kafka)
                        dlq.send(topic, m.key(), m.value(), bad, *pos)
                        dlq.flush()
                        tb = to_tensors_empty(self.cfg, (*pos, 0))
                        suspect = False
                    if suspect:  # alone: if training it fails again, only it is blamed
                        if pending:
                            yield self._emit(pending)
                            pending, rows = [], 0
                        yield self._emit([tb])
                        last_yield = time.monotonic()
                        continue
                    pending.append(tb)
                    rows += len(tb)
                    if rows >= self.batch_rows:
                        yield self._emit(pending)
                        pending, rows = [], 0
                        last_yield = time.monotonic()
                if not msgs and pending:  # nothing more right now: train what we have
                    yield self._emit(pending)
                    pending, rows = [], 0
                    last_yield = time.monotonic()
                elif not msgs and time.monotonic() - last_yield >= 1.0:
                    # A heartbeat (no rows, no positions) while idle, so the consumer of this iterator can
                    # react to a stop signal and checkpoint on time even when no data arrives.
                    yield to_tensors_empty(self.cfg, None)
                    last_yield = time.monotonic()
                if (self.exit_when_idle_s is not None and not pending
                        and time.monotonic() - last_data >= self.exit_when_idle_s):
                    return
        finally:
            consumer.close()
            dlq = None  # every dead letter was flushed when sent; the producer goes with this iteration

    def _emit(self, pending: list[TensorBatch]) -> TensorBatch:
        tb = concat(pending, self.cfg.num_fields)
        return tb.pin_memory() if self.pin else tb


def to_tensors_empty(cfg: FeatureConfig, pos: tuple[int, int, int] | None) -> TensorBatch:
    """A zero-row batch: the position of a skipped (dead-lettered) message, or an idle heartbeat (None)."""
    import numpy as np

    return TensorBatch(torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                       torch.zeros((0, len(cfg.dense))), torch.zeros(0), np.zeros(0, object),
                       np.zeros(0, np.int64), [pos] if pos is not None else [])
