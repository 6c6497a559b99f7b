"""A broker that cannot be reached: librdkafka's connection-failure lines (about 20 a second, 220 before a command
gave up) are held back to one per line and minute, and the error line a command ends in names the bootstrap
servers, what connecting saw and the setting, instead of a bare KafkaError{code=_TRANSPORT,...}."""

from __future__ import annotations

import logging
import socket

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException

from stream import kafka_access, kafka_topics
from stream.config import KafkaSettings
from stream.kafka import consumer_config
from stream.kafka_access import describe_error, librdkafka_log


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_error_line_names_the_servers_why_and_the_setting() -> None:
    servers = f"127.0.0.1:{closed_port()}"
    consumer = Consumer(consumer_config(KafkaSettings(bootstrap_servers=servers), "g-unreachable"))
    try:
        with pytest.raises(KafkaException) as info:
            consumer.list_topics(timeout=1)
    finally:
        consumer.close()
    line = describe_error(info.value)
    assert line.startswith(f"Kafka at {servers} cannot be reached (Connect to ipv4#{servers} failed: Connection "
                           "refused): ")
    assert line.endswith("([kafka] bootstrap_servers / --bootstrap-servers)")
    other = KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "not allowed"))
    assert describe_error(other) == str(other)  # not the broker's absence: as it was


def test_librdkafka_lines_go_through_logging_with_repeats_held_back(capfd: pytest.CaptureFixture[str],
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    servers = f"127.0.0.1:{closed_port()}"
    consumer = Consumer(consumer_config(KafkaSettings(bootstrap_servers=servers), "g-held-back"))
    try:
        with caplog.at_level(logging.INFO, logger=librdkafka_log.name):
            for _ in range(15):
                consumer.poll(0.1)  # logs are served here; librdkafka reconnects many times meanwhile
    finally:
        consumer.close()
    fails = [r for r in caplog.records if r.name == librdkafka_log.name and "Connection refused" in r.getMessage()]
    assert len(fails) == 1
    assert "|FAIL|" not in capfd.readouterr().err  # nothing written past logging by librdkafka itself


def test_a_held_back_line_passes_again_after_the_interval_with_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    hold = kafka_access._HoldRepeats()
    now = [1000.0]
    monkeypatch.setattr(kafka_access.time, "monotonic", lambda: now[0])

    def record(client: str, after: str) -> logging.LogRecord:
        return logging.LogRecord("x", logging.ERROR, __file__, 1, "%s", (f"FAIL [rdkafka#{client}] [thrd:b]: b: "
                                 f"Connect to ipv4#b failed: Connection refused (after {after}ms in state CONNECT)",),
                                 None)

    assert hold.filter(record("consumer-1", "0"))
    assert not any(hold.filter(record(f"consumer-{i}", str(i))) for i in range(5))
    now[0] += kafka_access.REPEAT_EVERY_S
    again = record("consumer-9", "3")
    assert hold.filter(again) and again.getMessage().endswith("(5 more like it held back)")


def test_the_command_line_ends_in_that_line(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from streamrec.cli import main
    from streamrec.commands import audit

    servers = f"127.0.0.1:{closed_port()}"

    def run(args: object) -> int:  # what audit's reader meets: its client's metadata request times out
        consumer_config(KafkaSettings(bootstrap_servers=servers), "g-cli")
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "Failed to get metadata: Local: Broker transport "
                                        "failure"))

    monkeypatch.setattr(audit, "run", run)
    assert main(["audit"]) == 1
    assert capsys.readouterr().err == (
        f"streamrec audit: error: Kafka at {servers} cannot be reached (Connect to ipv4#{servers} failed: Connection "
        "refused): Failed to get metadata: Local: Broker transport failure; is the broker up, and is that the right "
        "address? ([kafka] bootstrap_servers / --bootstrap-servers)\n")


class _Admin:
    """An AdminClient whose broker cannot be asked while ``down`` (each call of topic_identities makes one)."""
    down = True

    def __init__(self, _config: dict) -> None:
        pass

    def list_topics(self, timeout: float) -> object:
        if _Admin.down:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "broker down"))
        return type("Md", (), {"cluster_id": "c"})()

    def describe_topics(self, topics: object, request_timeout: float) -> dict:
        class Done:
            def result(self) -> object:
                return type("Desc", (), {"topic_id": None})()
        return {t: Done() for t in topics.topic_names}  # type: ignore[attr-defined]


def test_topic_ids_that_cannot_be_read_are_said_once_until_read_again(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(kafka_topics, "AdminClient", _Admin)
    monkeypatch.setattr(kafka_topics, "admin_config", lambda kafka: {})
    monkeypatch.setattr(kafka_topics, "_ids_unread", set())  # (none said before)
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9")  # never contacted
    _Admin.down = True

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    with caplog.at_level(logging.DEBUG, logger=kafka_topics.log.name):
        for _ in range(3):  # a joiner's periodic check while the broker is down
            assert kafka_topics.topic_identities(kafka, ["imps", "clicks"]) == {"imps": {}, "clicks": {}}
        assert len(warnings()) == 1 and "imps, clicks" in warnings()[0] and "said once" in warnings()[0]
        _Admin.down = False
        assert kafka_topics.topic_identities(kafka, ["imps", "clicks"]) == {"imps": {"cluster_id": "c"},
                                                                            "clicks": {"cluster_id": "c"}}
        assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
            "the id of topic imps is read again", "the id of topic clicks is read again"]
        _Admin.down = True  # down again: said again
        kafka_topics.topic_identities(kafka, ["imps", "clicks"])
        assert len(warnings()) == 2
