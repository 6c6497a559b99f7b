"""Test helpers that read topics to their end with a plain confluent-kafka consumer."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from stream.config import KafkaSettings


@dataclass(frozen=True)
class Record:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]


def read_topic(kafka: KafkaSettings, topic: str, timeout_s: float = 30.0) -> list[Record]:
    """Every record of ``topic`` from the beginning to the end (partition EOF on every partition)."""
    c = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": f"reader-{uuid.uuid4().hex}",
                  "enable.partition.eof": True, "enable.auto.commit": False})
    try:
        md = c.list_topics(topic, timeout=10).topics[topic]
        if md.error is not None:
            return []
        parts = sorted(md.partitions)
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        out: list[Record] = []
        at_eof: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(at_eof) < len(parts):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: no EOF on partitions {sorted(set(parts) - at_eof)}")
            for m in c.consume(10_000, 0.5):
                if m.error() is not None:
                    if m.error().code() == KafkaError._PARTITION_EOF:
                        at_eof.add(m.partition())
                    continue
                at_eof.discard(m.partition())
                out.append(Record(m.partition(), m.offset(), m.key(), m.value(), list(m.headers() or [])))
        return out
    finally:
        c.close()
