"""A validating consumer: decodes events per topic, dead-letters bad ones, never dies on one.

Partitions are assigned explicitly (no group join: the local broker needs half the session timeout
for one) and resume from the group's committed offsets. Offsets are committed only after the caller
has handled a batch *and* its dead letters are acknowledged (at-least-once, nothing lost).

The end of input is detected from partition-EOF events, not from high watermarks (which the local
broker reports wrongly).
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, KafkaError, KafkaException, TopicPartition

from stream.config import KafkaSettings
from stream.dlq import DeadLetters
from stream.errors import BadMessage
from stream.kafka import Headers, headers_of, new_consumer, resume_offsets
from stream.metrics import EVENTS

# decoder(value, broker_ts_ms=message timestamp or None, key=message key or None); raises BadMessage for a bad message
Decoder = Callable[..., Any]


@dataclass(frozen=True, slots=True)
class Decoded:
    topic: str
    partition: int
    offset: int
    event: Any


class EventReader:
    """Reads ``decoders.keys()`` topics; yields batches of :class:`Decoded` events.

    Use as a context manager; ``close()`` runs in ``finally``.
    """

    def __init__(self, kafka: KafkaSettings, group_id: str, decoders: Mapping[str, Decoder],
                 dead_letters: DeadLetters | None = None, stage: str = "reader") -> None:
        self._kafka = kafka
        self._decoders = dict(decoders)
        self._consumer = new_consumer(kafka, group_id)
        self._dlq = dead_letters or DeadLetters(kafka)
        self._stage = stage
        self._pending: dict[tuple[str, int], int] = {}  # next offset to commit per partition
        self._at_eof: set[tuple[str, int]] = set()
        self._partitions: list[tuple[str, int]] = []
        self.seen = 0  # messages read, valid or not
        self.valid: Tally[str] = Tally()
        self.valid_by_partition: Tally[tuple[str, int]] = Tally()
        self._assign()

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> EventReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._consumer.close()

    @property
    def dead_letters(self) -> DeadLetters:
        return self._dlq

    def _assign(self) -> None:
        md = self._consumer.list_topics(timeout=10)
        tps: list[TopicPartition] = []
        for topic in self._decoders:
            meta = md.topics.get(topic)
            if meta is None or meta.error is not None or not meta.partitions:
                raise KafkaException(f"topic {topic!r} does not exist on {self._kafka.bootstrap_servers}")
            tps.extend(TopicPartition(topic, p) for p in sorted(meta.partitions))
        self._partitions = [(tp.topic, tp.partition) for tp in tps]
        start = resume_offsets(self._consumer, tps, self._stage)
        # Records before the committed offsets may come again (see resume_offsets): skip them.
        self._skip_below = {(tp.topic, tp.partition): c.offset for tp, c in
                            zip(start, self._consumer.committed(tps, timeout=10), strict=True) if c.offset >= 0}
        self._consumer.assign(start)

    # -- reading -----------------------------------------------------------------------------
    @property
    def caught_up(self) -> bool:
        """True once every assigned partition reported EOF after its last message."""
        return len(self._at_eof) == len(self._partitions)

    def poll_batch(self, max_messages: int = 5000, timeout_s: float = 0.5) -> list[Decoded]:
        out: list[Decoded] = []
        for msg in self._consumer.consume(max_messages, timeout_s):
            # a consumed message always names its topic and partition (the stubs say Optional)
            topic, partition = cast(str, msg.topic()), cast(int, msg.partition())
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    self._at_eof.add((topic, partition))
                    continue
                if not err.retriable() and err.fatal():
                    raise KafkaException(err)
                continue  # transient errors are retried by librdkafka
            offset = cast(int, msg.offset())
            if offset < self._skip_below.get((topic, partition), -1):
                continue
            self.seen += 1
            self._at_eof.discard((topic, partition))
            kind, ts = msg.timestamp()
            headers: Headers | None = None  # read once: a header key that is not UTF-8 is bad_header, as in the joiner
            try:
                headers = headers_of(msg)
                event = self._decoders[topic](msg.value(), broker_ts_ms=ts if kind != TIMESTAMP_NOT_AVAILABLE else -1,
                                              key=msg.key())
            except BadMessage as exc:
                self._dlq.send(topic, msg.key(), msg.value(), exc, partition, offset, headers)
                self._pending[(topic, partition)] = offset + 1
                continue
            # Another exception propagates: this message is not marked read, so no commit can skip it.
            out.append(Decoded(topic, partition, offset, event))
            self._pending[(topic, partition)] = offset + 1
            self.valid[topic] += 1
            self.valid_by_partition[(topic, partition)] += 1
        for topic, n in Tally(d.topic for d in out).items():
            EVENTS.labels(self._stage, topic).inc(n)
        return out

    def commit(self) -> None:
        """Commit everything read so far, after its dead letters are acknowledged."""
        if not self._pending:
            return
        self._dlq.flush()
        self._consumer.commit(
            offsets=[TopicPartition(t, p, o) for (t, p), o in self._pending.items()], asynchronous=False
        )
        self._pending.clear()

    def read_to_end(self, handle: Callable[[list[Decoded]], None] | None = None,
                    idle_timeout_s: float = 30.0, commit_every: int = 100_000) -> None:
        """Read until every partition is at its end, handing each batch to ``handle``; commit as it goes.

        Raises ``TimeoutError`` if neither a message nor an end-of-partition arrives for
        ``idle_timeout_s`` (the broker is gone, or a partition never reports its end).
        """
        last_progress = time.monotonic()
        since_commit = 0
        while not self.caught_up:
            before = (self.seen, len(self._at_eof))
            batch = self.poll_batch()
            if (self.seen, len(self._at_eof)) != before:
                last_progress = time.monotonic()
            if handle is not None and batch:
                handle(batch)
            since_commit += self.seen - before[0]
            if since_commit >= commit_every:
                self.commit()
                since_commit = 0
            if time.monotonic() - last_progress > idle_timeout_s:
                missing = sorted(set(self._partitions) - self._at_eof)
                raise TimeoutError(f"no data and no end-of-partition for {idle_timeout_s}s on {missing}")
        self.commit()
