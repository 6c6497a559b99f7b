"""Test helpers that read topics to their end (``stream.kafka.read_to_end``), and make one again."""

from __future__ import annotations

import time
from dataclasses import dataclass

from confluent_kafka.admin import AdminClient

from stream.config import KafkaSettings
from stream.kafka import admin_config, ensure_topics, read_to_end


@dataclass(frozen=True)
class Record:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]


def read_topic(kafka: KafkaSettings, topic: str, timeout_s: float = 30.0) -> list[Record]:
    """Every record of ``topic`` from the beginning to the end (partition EOF on every partition)."""
    out: list[Record] = []
    read_to_end(kafka, topic, lambda m: out.append(Record(m.partition(), m.offset(), m.key(), m.value(),
                                                          list(m.headers() or []))), timeout_s=timeout_s)
    return out


def make_again(kafka: KafkaSettings, topic: str, partitions: int) -> None:
    """Delete ``topic`` and create it again (new offsets from 0, a new topic id) with ``partitions`` partitions."""
    admin = AdminClient(admin_config(kafka))
    for fut in admin.delete_topics([topic], operation_timeout=10).values():
        fut.result()
    deadline = time.monotonic() + 10
    while topic in admin.list_topics(timeout=5).topics and time.monotonic() < deadline:
        time.sleep(0.1)
    ensure_topics(kafka, [topic], partitions=partitions)
