"""Test helpers that read topics to their end (``stream.kafka.read_to_end``)."""

from __future__ import annotations

from dataclasses import dataclass

from stream.config import KafkaSettings
from stream.kafka import read_to_end


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
