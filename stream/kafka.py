"""Thin wrappers over confluent-kafka: client configs, topic creation, an acknowledged producer.

Nothing here relies on broker transactions (the local broker does not honour aborts): correctness
comes from idempotent producing, waiting for acknowledgements, and offsets stored with state.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from stream.errors import DeliveryFailed
from streamrec.settings import KafkaSettings

Headers = Sequence[tuple[str, bytes]]


def producer_config(kafka: KafkaSettings, **extra: Any) -> dict[str, Any]:
    conf: dict[str, Any] = {
        "bootstrap.servers": kafka.bootstrap_servers,
        "client.id": kafka.client_id,
        "enable.idempotence": True,
        "acks": "all",
        # murmur2 is what the Java client and aiokafka (faust) use: keys land on the same partition
        # whichever client produced them, which keeps impressions and clicks co-partitioned.
        "partitioner": "murmur2_random",
        "linger.ms": 20,
        "batch.num.messages": 10_000,
        "queue.buffering.max.messages": 1_000_000,
        "queue.buffering.max.kbytes": 1_048_576,
        "compression.type": "lz4",
    }
    conf.update(extra)
    return conf


def consumer_config(kafka: KafkaSettings, group_id: str, **extra: Any) -> dict[str, Any]:
    conf: dict[str, Any] = {
        "bootstrap.servers": kafka.bootstrap_servers,
        "client.id": kafka.client_id,
        "group.id": group_id,
        "session.timeout.ms": kafka.session_timeout_ms,
        "heartbeat.interval.ms": max(500, kafka.session_timeout_ms // 6),
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        # The local broker reports wrong high watermarks; the end of a partition is detected from
        # partition-EOF events instead (see environment.md).
        "enable.partition.eof": True,
    }
    conf.update(extra)
    return conf


def ensure_topics(kafka: KafkaSettings, topics: Iterable[str], partitions: int | None = None) -> None:
    """Create ``topics`` with ``partitions`` partitions if they do not exist (idempotent)."""
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    wanted = sorted(set(topics))
    existing = admin.list_topics(timeout=10).topics
    new = [
        NewTopic(t, num_partitions=partitions or kafka.partitions, replication_factor=kafka.replication_factor)
        for t in wanted
        if t not in existing
    ]
    if not new:
        return
    for fut in admin.create_topics(new, operation_timeout=10).values():
        try:
            fut.result()
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
    # Wait until metadata shows every partition (creation is asynchronous on some brokers).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        md = admin.list_topics(timeout=10).topics
        if all(t in md and md[t].partitions for t in wanted):
            return
        time.sleep(0.05)


@dataclass
class DeliveryReport:
    acked: dict[str, int] = field(default_factory=dict)  # topic -> messages acknowledged
    failed: int = 0
    first_error: str | None = None


class AckedProducer:
    """An idempotent producer that counts acknowledgements and surfaces delivery errors.

    ``send`` never drops a message on a full local queue: it serves delivery callbacks and retries.
    ``flush`` waits for every acknowledgement and raises :class:`DeliveryFailed` if any failed.
    """

    def __init__(self, kafka: KafkaSettings, **extra: Any) -> None:
        self._producer = Producer(producer_config(kafka, **extra))
        self._bootstrap = kafka.bootstrap_servers
        self.report = DeliveryReport()

    def _on_delivery(self, err: KafkaError | None, msg: Any) -> None:
        if err is not None:
            self.report.failed += 1
            if self.report.first_error is None:
                self.report.first_error = f"{msg.topic()}: {err.str()}"
            return
        topic = msg.topic()
        self.report.acked[topic] = self.report.acked.get(topic, 0) + 1

    def send(self, topic: str, value: bytes | None, key: bytes | str | None = None,
             headers: Headers | None = None, timestamp_ms: int | None = None) -> None:
        kwargs: dict[str, Any] = {"on_delivery": self._on_delivery}
        if headers:
            kwargs["headers"] = list(headers)
        if timestamp_ms is not None:
            kwargs["timestamp"] = timestamp_ms
        while True:
            try:
                self._producer.produce(topic, value, key, **kwargs)
                return
            except BufferError:
                self._producer.poll(0.05)

    def poll(self) -> None:
        self._producer.poll(0)

    def flush(self, timeout_s: float = 60.0) -> DeliveryReport:
        remaining = self._producer.flush(timeout_s)
        if remaining:
            self.report.failed += remaining
            self.report.first_error = (self.report.first_error
                                       or f"{remaining} messages unacknowledged after {timeout_s}s")
        if self.report.failed:
            raise DeliveryFailed(
                f"{self.report.failed} message(s) were not acknowledged by {self._bootstrap}; "
                f"first error: {self.report.first_error}. Is the broker up (`streamrec stack status`)?"
            )
        return self.report


def new_consumer(kafka: KafkaSettings, group_id: str, **extra: Any) -> Consumer:
    return Consumer(consumer_config(kafka, group_id, **extra))
