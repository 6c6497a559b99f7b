"""Dead-letter queue: malformed messages go to ``<topic>.dlq`` with the reason in headers.

The DLQ record keeps the original key and value bytes untouched, so an operator can fix and replay
it. Headers:

============================  ==============================================================
``dlq.reason``                human-readable reason (``field 'ts': got -5, expected ...``)
``dlq.kind``                  machine-readable class (``bad_json``, ``invalid_field``, ...)
``dlq.source.topic``          topic the message came from (or was meant for)
``dlq.source.partition``      its partition, ``-1`` when it never reached the broker
``dlq.source.offset``         its offset, ``-1`` when it never reached the broker
``dlq.value_truncated_from``  only where the value was too large to send whole: its size
                              (the record then holds its first ``TRUNCATED_BYTES``, or as many as
                              the producer's ``message.max.bytes`` leaves room for)
============================  ==============================================================
"""

from __future__ import annotations

from collections import Counter as Tally
from dataclasses import dataclass

from stream.config import KafkaSettings
from stream.errors import BadMessage, MessageTooLarge
from stream.kafka import AckedProducer, usable_bytes
from stream.metrics import DLQ_MESSAGES

TRUNCATED_BYTES = 65_536


@dataclass(frozen=True)
class DeadLetter:
    reason: str
    kind: str
    source_topic: str
    source_partition: int
    source_offset: int

    @classmethod
    def from_headers(cls, headers: list[tuple[str, bytes]] | None) -> DeadLetter:
        h = {k: v.decode() for k, v in headers or []}
        return cls(
            reason=h["dlq.reason"],
            kind=h["dlq.kind"],
            source_topic=h["dlq.source.topic"],
            source_partition=int(h["dlq.source.partition"]),
            source_offset=int(h["dlq.source.offset"]),
        )


class DeadLetters:
    """Sends bad messages to ``<topic><dlq_suffix>`` and counts them (per topic and kind)."""

    def __init__(self, kafka: KafkaSettings, producer: AckedProducer | None = None) -> None:
        self._kafka = kafka
        self._producer = producer or AckedProducer(kafka)
        self.counts: Tally[tuple[str, str]] = Tally()

    def send(self, topic: str, key: bytes | str | None, value: bytes | None, error: BadMessage,
             partition: int = -1, offset: int = -1) -> None:
        headers = [
            ("dlq.reason", error.reason.encode()),
            ("dlq.kind", error.kind.encode()),
            ("dlq.source.topic", topic.encode()),
            ("dlq.source.partition", str(partition).encode()),
            ("dlq.source.offset", str(offset).encode()),
        ]
        try:
            self._producer.send(self._kafka.dlq_topic(topic), value, key, headers=headers)
        except MessageTooLarge:
            # Keep what fits and say how much there was: the reason and the source offset still point to it.
            headers.append(("dlq.value_truncated_from", str(len(value or b"")).encode()))
            room = (usable_bytes(self._producer.max_message_bytes) - len(key or b"")
                    - sum(len(k) + len(v) for k, v in headers))
            self._producer.send(self._kafka.dlq_topic(topic), (value or b"")[:max(0, min(TRUNCATED_BYTES, room))], key,
                                headers=headers)
        self.counts[(topic, error.kind)] += 1
        DLQ_MESSAGES.labels(topic, error.kind).inc()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def flush(self) -> None:
        """Wait until every dead letter is acknowledged (raises ``DeliveryFailed`` otherwise)."""
        self._producer.flush()
