"""AckedProducer's renewal after a fatal librdkafka error, over a fake client (pure logic: a fatal state cannot be
caused against the test broker). The fake keeps what it was given until a flush or poll delivers it (a success is not
reported: ``delivery.report.only.error``), or, once made fatal, fails it as librdkafka does: ``error_cb`` with the fatal
error, the queued messages purged (``_PURGE_QUEUE`` reports), every later ``produce`` refused with ``_FATAL``."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from stream import kafka_producer
from stream.config import KafkaSettings
from stream.errors import DeliveryFailed
from stream.kafka_producer import AckedProducer

FATAL = KafkaError(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, "Fatal idempotent producer error", fatal=True)


class FakeMessage:
    def __init__(self, topic: str, value: bytes | None, key: Any) -> None:
        self._topic, self._value, self._key = topic, value, key

    def topic(self) -> str:
        return self._topic

    def value(self) -> bytes | None:
        return self._value

    def key(self) -> Any:
        return self._key


class FakeClient:
    """A librdkafka producer as AckedProducer uses it; ``fatal_in`` names the call ("flush", "poll") in which its
    fatal error shows first, and ``how`` whether the queued messages' reports carry it ("report") or only
    ``error_cb`` does, the queue purged ("error_cb")."""

    made: list[FakeClient] = []

    def __init__(self, conf: dict[str, Any]) -> None:
        self.conf = conf
        self.queued: list[FakeMessage] = []
        self.delivered: list[FakeMessage] = []
        self.fatal_in: str | None = None
        self.how = "report"
        self.dead = False
        self.calls: list[tuple[str, Any]] = []
        FakeClient.made.append(self)

    def produce(self, topic: str, value: bytes | None = None, key: Any = None, **kwargs: Any) -> None:
        if self.dead:
            raise KafkaException(KafkaError(KafkaError._FATAL, "Fatal error: producer fenced", fatal=True))
        self.queued.append(FakeMessage(topic, value, key))

    def _serve(self, call: str) -> None:
        if self.fatal_in == call and not self.dead:
            self.dead = True
            if "error_cb" in self.conf:
                self.conf["error_cb"](FATAL)
            err = FATAL if self.how == "report" else KafkaError(KafkaError._PURGE_QUEUE)
            for m in self.queued:
                self.conf["on_delivery"](err, m)
            self.queued = []
        if not self.dead:
            self.delivered += self.queued
            self.queued = []

    def poll(self, timeout: float = 0) -> int:
        self.calls.append(("poll", timeout))
        self._serve("poll")
        return 0

    def flush(self, timeout: float = 0) -> int:
        self.calls.append(("flush", timeout))
        self._serve("flush")
        return 0

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True) -> None:
        self.calls.append(("purge", (in_queue, in_flight)))
        err = FATAL if self.how == "report" else KafkaError(KafkaError._PURGE_QUEUE)
        for m in self.queued:  # served by the next poll or flush in librdkafka; at once here
            self.conf["on_delivery"](err, m)
        self.queued = []

    def close(self) -> bool:
        self.calls.append(("close", None))
        return True

    def __len__(self) -> int:
        return len(self.queued)


@pytest.fixture
def producer(monkeypatch: pytest.MonkeyPatch) -> AckedProducer:
    FakeClient.made = []
    monkeypatch.setattr(kafka_producer, "producer_config", lambda kafka, **extra: {"bootstrap.servers": "fake:9092"})
    monkeypatch.setattr(kafka_producer, "Producer", FakeClient)
    return AckedProducer(KafkaSettings())


@pytest.mark.parametrize("how", ["report", "error_cb"])
def test_a_fatal_error_first_seen_in_flush_renews_the_producer_there_not_at_the_next_send(
        producer: AckedProducer, how: str) -> None:
    """The fatal error showed first in flush (in its delivery reports, or only in error_cb with the queue purged):
    flush raised DeliveryFailed (the joiner rewound) but kept the dead client, so the batch done again failed once
    more at its first send (a second rewind) before that send renewed it."""
    producer.send("t", b"a")
    assert producer.flush().acked == {"t": 1}
    old = FakeClient.made[-1]
    old.fatal_in, old.how = "flush", how
    producer.send("t", b"b")
    with pytest.raises(DeliveryFailed):
        producer.flush()
    producer.send("t", b"c")  # the batch done again: on a new client, no second failure
    assert producer.flush().acked == {"t": 1}
    assert len(FakeClient.made) == 2 and [m.value() for m in FakeClient.made[-1].delivered] == [b"c"]
    assert producer.acked_total == {"t": 2}  # a and c; b never claimed


def test_a_fatal_error_first_seen_in_poll_renews_the_producer_and_raises(producer: AckedProducer) -> None:
    """A fatal error served by ``poll`` (the replay polls between chunks) was passed over; the messages the dead client
    held were then lost without a word until a later send raised."""
    producer.send("t", b"a")
    producer.flush()
    FakeClient.made[-1].fatal_in = "poll"
    producer.send("t", b"b")
    with pytest.raises(KafkaException):
        producer.poll()
    producer.send("t", b"c")
    assert producer.flush().acked == {"t": 1}
    assert producer.acked_total == {"t": 2}


@pytest.mark.parametrize("how", ["report", "error_cb"])
def test_a_renewed_producer_closes_the_old_one_bounded_and_counts_nothing_it_held(
        producer: AckedProducer, how: str) -> None:
    """A produce refused as fatal renewed the producer and dropped the old client unclosed (its librdkafka threads and
    queues kept while anything referred to it). Now it is purged, its reports served without waiting (``flush(0)``)
    and closed; the two messages it held count as neither acknowledged nor failed in the new producer's report."""
    producer.send("t", b"a")
    producer.flush()
    old = FakeClient.made[-1]
    old.how = how
    producer.send("t", b"b")
    producer.send("t", b"c")
    old.dead = True  # b and c still queued in it
    with pytest.raises(KafkaException):
        producer.send("t", b"d")
    assert [name for name, _ in old.calls[-3:]] == ["purge", "flush", "close"]
    assert old.calls[-2] == ("flush", 0)
    producer.send("t", b"e")
    assert producer.flush().acked == {"t": 1}  # e alone: no failure of b or c carried over
    assert producer.acked_total == {"t": 2}
    assert [m.value() for m in FakeClient.made[-1].delivered] == [b"e"]


def test_a_dead_producer_whose_purge_librdkafka_refuses_is_still_closed(producer: AckedProducer) -> None:
    """The old producer's purge, flush and close are each tried alone: a purge that raises (librdkafka refusing a
    producer in its fatal state) skipped the close, and the client this renewal was meant to free was kept."""
    producer.send("t", b"a")
    producer.flush()
    old = FakeClient.made[-1]

    def refused(*args: Any, **kwargs: Any) -> None:
        old.calls.append(("purge", "refused"))
        raise KafkaException(KafkaError(KafkaError._FATAL, "purge refused", fatal=True))

    old.purge = refused  # type: ignore[method-assign]
    old.dead = True
    with pytest.raises(KafkaException):
        producer.send("t", b"b")
    assert [name for name, _ in old.calls[-3:]] == ["purge", "flush", "close"]
    producer.send("t", b"c")
    assert producer.flush().acked == {"t": 1}
