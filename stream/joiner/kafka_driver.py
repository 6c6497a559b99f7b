"""``streamrec join --driver kafka``: :class:`~stream.joiner.pipeline.JoinPipeline` on a plain
confluent-kafka consumer, for throughput (faust's per-event asyncio machinery caps one worker at
~6-13 k events/s on two cores; this loop is bounded by the join itself, see bench/joiner.py).

Same semantics as the faust driver: a consumer group over ``impressions`` and ``clicks`` with the
range assignor (partition p of both topics goes to the same member, the topics being
co-partitioned), batches of ``batch_max`` messages, and offsets committed only after
:meth:`JoinPipeline.process` made the batch's outputs and state durable. Revoked partitions are
forgotten after a final commit of what was processed; assigned ones are restored from the state log
on first use. An exception in a batch stops the worker: its offsets are never committed, not even
by the revocation that ``close()`` triggers in ``finally`` (the batch's messages got their strikes,
see ``stream/strikes.py``; the process exits non-zero for its supervisor to restart it).
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Consumer, KafkaError, KafkaException, TopicPartition

from stream.joiner.pipeline import JoinPipeline, Record
from stream.kafka import consumer_config, resume_offsets
from streamrec.settings import JoinerSettings, KafkaSettings

log = logging.getLogger("streamrec.join")


class KafkaJoinWorker:
    def __init__(self, pipeline: JoinPipeline, kafka: KafkaSettings, js: JoinerSettings) -> None:
        self.pipeline, self.kafka, self.js = pipeline, kafka, js
        self._stop = False
        self._offsets: dict[tuple[str, int], int] = {}  # next offset to commit: processed batches only
        self.consumer = Consumer(consumer_config(
            kafka, js.app_id, **{"partition.assignment.strategy": "range", "enable.partition.eof": False,
                                 "fetch.max.bytes": 16 * 1024 * 1024}))

    def _commit(self) -> None:
        if self._offsets:
            self.consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in self._offsets.items()],
                                 asynchronous=False)
            self._offsets.clear()

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._commit()
        self.pipeline.forget({tp.partition for tp in partitions if tp.topic == self.kafka.impressions_topic})

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        log.info("assigned %s", sorted((tp.topic, tp.partition) for tp in partitions))
        consumer.assign(resume_offsets(consumer, partitions))
        self._idle_since = time.monotonic()

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.consumer.subscribe([self.kafka.impressions_topic, self.kafka.clicks_topic],
                                on_assign=self._on_assign, on_revoke=self._on_revoke)
        self._idle_since = time.monotonic()
        limit = self.js.exit_when_idle_s
        try:
            while not self._stop:
                msgs = self.consumer.consume(self.js.batch_max, self.js.batch_within_s)
                records = []
                for msg in msgs:
                    err = msg.error()
                    if err is not None:
                        if err.fatal():
                            raise KafkaException(err)
                        if err.code() != KafkaError._PARTITION_EOF:
                            log.warning("consumer: %s", err)
                        continue
                    kind, ts = msg.timestamp()
                    records.append(Record(msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value(),
                                          ts if kind != TIMESTAMP_NOT_AVAILABLE else None))
                if records:
                    self.pipeline.process(records)  # raises: nothing of this batch is ever committed
                    for r in records:
                        self._offsets[(r.topic, r.partition)] = r.offset + 1
                    self._commit()
                    self._idle_since = time.monotonic()
                elif limit is not None and time.monotonic() - self._idle_since >= limit and self.consumer.assignment():
                    break
            if self.js.drain_at_exit and not self._stop:  # input complete, not a signal
                self.pipeline.drain()
            self._commit()
        finally:
            self.consumer.close()
        return 0

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stop = True
