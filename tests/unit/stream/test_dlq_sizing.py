"""How a dead letter is cut to fit its topic (stream/dlq.py): pure sizing logic, a recording producer."""

from __future__ import annotations

from stream.config import KafkaSettings
from stream.dlq import DeadLetters
from stream.errors import BadMessage
from stream.kafka import MessageLimit, usable_bytes

LIMIT = 8000


class RecordingProducer:
    """The two attributes and the send that DeadLetters uses, recording each record."""

    max_message_bytes = 1_000_000
    max_message_setting = "[kafka.extra] message.max.bytes"

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes | None, bytes | None, list[tuple[str, bytes]]]] = []

    def send(self, topic: str, value: bytes | None, key: bytes | None, headers: list[tuple[str, bytes]]) -> None:
        self.sent.append((topic, value, key, headers))


def _dead_letters() -> tuple[DeadLetters, RecordingProducer, KafkaSettings]:
    kafka = KafkaSettings()
    producer = RecordingProducer()
    limits = {kafka.dlq_topic(kafka.impressions_topic): MessageLimit(LIMIT, "topic max.message.bytes")}
    return DeadLetters(kafka, producer, limits), producer, kafka  # type: ignore[arg-type]


def test_a_small_bad_value_under_a_huge_key_is_kept_whole_and_only_the_key_is_cut() -> None:
    """A 200-byte malformed event under a 20 kB key: the key took all the room and the value, the event itself,
    went to the dead-letter topic as 0 bytes (with ``dlq.value_truncated_from: 200``)."""
    dlq, producer, kafka = _dead_letters()
    value, key = b"{not json" + b"x" * 191, b"k" * 20_000
    dlq.send(kafka.impressions_topic, key, value, BadMessage("not valid JSON", kind="bad_json"), 0, 9)
    [(_, sent_value, sent_key, headers)] = producer.sent
    h = dict(headers)
    assert sent_value == value and "dlq.value_truncated_from" not in h
    assert h["dlq.key_truncated_from"] == b"20000" and sent_key and key.startswith(sent_key)
    assert len(sent_key) + len(sent_value) + sum(len(k) + len(v) for k, v in headers) <= usable_bytes(LIMIT)


def test_a_value_and_key_that_fit_are_sent_untouched() -> None:
    dlq, producer, kafka = _dead_letters()
    dlq.send(kafka.impressions_topic, b"\xff\xfe-not-utf8", b"\x00bad", BadMessage("r", kind="bad_json"))
    [(_, sent_value, sent_key, headers)] = producer.sent
    assert (sent_key, sent_value) == (b"\xff\xfe-not-utf8", b"\x00bad")
    assert not {"dlq.value_truncated_from", "dlq.key_truncated_from"} & dict(headers).keys()
