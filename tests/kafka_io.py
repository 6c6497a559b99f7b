"""Test helpers that read topics to their end (``stream.kafka.read_to_end``), and make one again."""

from __future__ import annotations

import time
from dataclasses import dataclass

from confluent_kafka.admin import AdminClient

from stream.config import KafkaSettings
from stream.kafka import admin_config, read_to_end
from stream.kafka_topics import ensure_topics


@dataclass(frozen=True)
class Record:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]


def read_topic(kafka: KafkaSettings, topic: str, timeout_s: float = 30.0) -> list[Record]:
    """Every record of ``topic`` from the beginning to the end (partition EOF on every partition)."""
    out, stuck = read_topic_partly(kafka, topic, timeout_s)
    if stuck is not None:
        raise stuck
    return out


def read_topic_partly(kafka: KafkaSettings, topic: str,
                      timeout_s: float = 30.0) -> tuple[list[Record], TimeoutError | None]:
    """:func:`read_topic`, and where a partition did not reach its end within ``timeout_s``, what was read before
    with that ``TimeoutError`` (None: every partition reached its end): a broker that keeps a partition from its end
    for a reader is told apart from one that lost records."""
    out: list[Record] = []
    try:
        read_to_end(kafka, topic, lambda m: out.append(Record(m.partition(), m.offset(), m.key(), m.value(),
                                                              list(m.headers() or []))), timeout_s=timeout_s)
    except TimeoutError as exc:
        return out, exc
    return out, None


def make_again(kafka: KafkaSettings, topic: str, partitions: int) -> None:
    """Delete ``topic`` and create it again (new offsets from 0, a new topic id) with ``partitions`` partitions."""
    admin = AdminClient(admin_config(kafka))
    for fut in admin.delete_topics([topic], operation_timeout=10).values():
        fut.result()
    deadline = time.monotonic() + 10
    while topic in admin.list_topics(timeout=5).topics and time.monotonic() < deadline:
        time.sleep(0.1)
    ensure_topics(kafka, [topic], partitions=partitions)


class _RawHeaderKey(str):
    """A header key that aiokafka's pure-Python record builder writes as these bytes (``encode`` is all it calls)."""

    def __new__(cls, raw: bytes) -> _RawHeaderKey:
        key = super().__new__(cls, raw.decode("latin-1"))
        key.raw = raw
        return key

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:  # noqa: ARG002 - str's signature
        return self.raw


def produce_raw_header_key(kafka: KafkaSettings, topic: str, partition: int, key: bytes, value: bytes,
                           header_key: bytes) -> None:
    """One record whose header key is ``header_key`` as bytes (not UTF-8, as another producer may write): neither
    confluent-kafka nor aiokafka's compiled builder will write one, so aiokafka's pure-Python builder does."""
    import asyncio

    import aiokafka.producer.message_accumulator as accumulator
    import aiokafka.producer.producer as aio_producer
    from aiokafka import AIOKafkaProducer
    from aiokafka.record.default_records import _DefaultRecordBatchBuilderPy

    builders = accumulator.DefaultRecordBatchBuilder, aio_producer.DefaultRecordBatchBuilder
    accumulator.DefaultRecordBatchBuilder = aio_producer.DefaultRecordBatchBuilder = _DefaultRecordBatchBuilderPy

    async def send() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers)
        await producer.start()
        try:
            await producer.send_and_wait(topic, value, key=key, partition=partition,
                                         headers=[(_RawHeaderKey(header_key), b"1")])
        finally:
            await producer.stop()

    try:
        asyncio.run(send())
    finally:
        accumulator.DefaultRecordBatchBuilder, aio_producer.DefaultRecordBatchBuilder = builders
