"""KafkaSink's reading of librdkafka's errors: an alert Kafka refuses for good (a delivery report of
MSG_SIZE_TOO_LARGE, TOPIC_AUTHORIZATION_FAILED ...) is dropped, counted and logged, and the alerts behind it go on;
a transient error (a timed-out message) is retried; a producer in a fatal state is replaced.

The local broker (Tansu) cannot be made to report these at delivery (a topic created with max.message.bytes=200
took a 1,866-byte alert), so a producer that reports librdkafka's own KafkaError values stands in for it; the sink's
queue, threads and error handling are the real ones. produce()-time MSG_SIZE_TOO_LARGE is covered against the real
broker in tests/integration/test_alert_delivery.py."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

import monitor.alerts as alerts_mod
from monitor.alerts import Alert, AlertState, KafkaSink, Severity, SinkSettings
from monitor.delivery import QueuedSink
from stream.config import KafkaSettings

FAST = SinkSettings(retry_backoff_s=0.01, retry_backoff_max_s=0.05)


def alert(n: int) -> Alert:
    return Alert(rule="cold_start_share", source="learner", severity=Severity.WARNING, state=AlertState.FIRING,
                 value=0.9, threshold=0.5, message=f"alert {n}", ts=1_700_000_000_000 + n)


class ReportingProducer:
    """Acknowledges every alert at flush() but those ``errors`` names (message -> the KafkaError reported, each
    once); ``raise_first``: produce() raises it until the producer is replaced."""

    made: list[ReportingProducer] = []

    def __init__(self, errors: dict[str, list[KafkaError]], raise_first: KafkaError | None = None) -> None:
        self.errors, self.raise_first = errors, raise_first
        self.pending: list[tuple[bytes, Any]] = []
        self.acked: list[str] = []

    def produce(self, topic: str, value: bytes, key: bytes, on_delivery: Any) -> None:
        if self.raise_first is not None:
            raise KafkaException(self.raise_first)
        self.pending.append((value, on_delivery))

    def flush(self, timeout: float) -> int:
        for value, cb in self.pending:
            msg = Alert.from_json(value).message
            err = self.errors[msg].pop(0) if self.errors.get(msg) else None
            if err is None:
                self.acked.append(msg)
            cb(err, None)
        self.pending = []
        return 0

    def purge(self, **_: Any) -> None:
        self.pending = []

    def poll(self, _: float) -> int:
        return 0


@pytest.fixture
def sink(monkeypatch: pytest.MonkeyPatch) -> KafkaSink:
    monkeypatch.setattr(alerts_mod, "check_access", lambda *a, **k: None)
    s = KafkaSink(KafkaSettings(bootstrap_servers="127.0.0.1:9"), "alerts", timeout_s=5)
    s._ensure_topic = lambda deadline: None  # type: ignore[method-assign]  # (no broker here)
    return s


def run(sink: KafkaSink, producers: list[ReportingProducer], batch: list[Alert]) -> QueuedSink:
    made = iter(producers)
    sink._new_producer = lambda: next(made)  # type: ignore[method-assign]
    queued = QueuedSink(sink, FAST)
    queued.send(batch)
    assert queued.wait_idle(10)
    queued.close(1)
    return queued


def test_an_alert_kafka_refuses_at_delivery_is_dropped_and_the_alerts_behind_it_are_delivered(sink) -> None:
    for code in (KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.TOPIC_AUTHORIZATION_FAILED):
        producer = ReportingProducer({"alert 2": [KafkaError(code)] * 100})
        queued = run(sink, [producer] * 100, [alert(1), alert(2), alert(3)])
        # before: "alert 2" stayed at the head of the queue and was retried for ever, "alert 3" never went
        assert queued.stats.dropped["rejected"] == 1 and queued.stats.delivered == 2
        assert producer.acked.count("alert 3") == 1 and "alert 2" not in producer.acked


def test_an_alert_a_transient_error_fails_is_retried_until_delivered(sink) -> None:
    producer = ReportingProducer({"alert 2": [KafkaError(KafkaError._MSG_TIMED_OUT)] * 2})
    queued = run(sink, [producer] * 10, [alert(1), alert(2)])
    assert queued.stats.dropped == {} and queued.stats.delivered == 2 and queued.stats.failed == 2


def test_a_producer_in_a_fatal_state_is_replaced_not_reused_for_ever(sink) -> None:
    dead = ReportingProducer({}, raise_first=KafkaError(KafkaError._FATAL, fatal=True))
    fresh = ReportingProducer({})
    queued = run(sink, [dead, fresh], [alert(1)])
    assert queued.stats.delivered == 1 and fresh.acked == ["alert 1"]


def test_the_codes_refused_for_good_are_the_named_librdkafka_ones() -> None:
    assert alerts_mod.REFUSED_FOR_GOOD == {
        KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE, KafkaError.INVALID_RECORD,
        KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED}
    assert not {KafkaError._MSG_TIMED_OUT, KafkaError._FATAL, KafkaError.UNKNOWN_TOPIC_OR_PART} & \
        alerts_mod.REFUSED_FOR_GOOD
