"""How a dead letter is cut to fit its topic (stream/dlq.py): pure sizing logic, a recording producer."""

from __future__ import annotations

from stream.config import KafkaSettings
from stream.dlq import DeadLetters
from stream.errors import BadMessage
from stream.kafka_limits import MessageLimit, usable_bytes

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


def _record_bytes(key: bytes | None, value: bytes | None, headers: list) -> int:
    """A record's key, value and headers, each header with its two length varints at their largest (5 bytes)."""
    return len(key or b"") + len(value or b"") + sum(len(k.encode()) + len(v or b"") + 10 for k, v in headers)


def test_the_original_headers_are_kept_in_front_of_ours_and_read_back_apart_from_a_forged_dlq_reason() -> None:
    """The source message's headers (a tracing id, a ``dlq.reason`` and ``dlq.value_truncated_from`` its producer
    forged, a null one) were dropped: a dead letter replayed to its topic was not the message sent. They are kept, in
    order and in front of ours, and the parser takes our reason and truncation, not the forged ones."""
    from stream.dlq import DeadLetter

    dlq, producer, kafka = _dead_letters()
    original = [("trace-id", b"abc"), ("dlq.reason", b"forged"), ("dlq.value_truncated_from", b"7"), ("n", None)]
    dlq.send(kafka.impressions_topic, b"k", b"{bad", BadMessage("not valid JSON", kind="bad_json"), 0, 9,
             headers=original)
    [(_, sent_value, sent_key, headers)] = producer.sent
    assert (sent_key, sent_value) == (b"k", b"{bad") and headers[:len(original)] == original
    letter = DeadLetter.from_headers(headers)
    assert (letter.reason, letter.kind, letter.source_offset) == ("not valid JSON", "bad_json", 9)
    assert letter.value_truncated_from is None and letter.headers_dropped == 0
    assert letter.original_headers == tuple(original)


def test_original_headers_too_large_for_the_dead_letter_topic_are_dropped_whole_and_counted() -> None:
    """900 kB of original headers (a topic of 8000 bytes): they must not make the dead letter refused. They are
    dropped whole (``dlq.headers_dropped: 3``), the key and value kept as before, the record under the limit."""
    from stream.dlq import DeadLetter

    dlq, producer, kafka = _dead_letters()
    original = [("a", b"x" * 300_000), ("b", b"y" * 300_000), ("c", b"z" * 300_000)]
    dlq.send(kafka.impressions_topic, b"k", b"{bad", BadMessage("r", kind="bad_json"), 0, 9, headers=original)
    [(_, sent_value, sent_key, headers)] = producer.sent
    assert (sent_key, sent_value) == (b"k", b"{bad")
    letter = DeadLetter.from_headers(headers)
    assert letter.headers_dropped == 3 and letter.original_headers == ()
    assert _record_bytes(sent_key, sent_value, headers) <= usable_bytes(LIMIT)


def test_original_headers_that_fit_only_without_the_whole_value_are_dropped_and_the_value_kept_as_before() -> None:
    """Headers of 2 kB beside a 5 kB value under an 8000-byte topic: the value (the event) keeps its room."""
    from stream.dlq import DeadLetter

    dlq, producer, kafka = _dead_letters()
    value = b"v" * 5000
    dlq.send(kafka.impressions_topic, b"k", value, BadMessage("r", kind="bad_json"), 0, 9,
             headers=[("h", b"x" * 2000)])
    [(_, sent_value, sent_key, headers)] = producer.sent
    assert sent_value == value and DeadLetter.from_headers(headers).headers_dropped == 1
    assert _record_bytes(sent_key, sent_value, headers) <= usable_bytes(LIMIT)


def test_a_dead_letter_of_many_tiny_original_headers_counts_their_framing() -> None:
    """700 empty headers: 700 one-byte names and up to 10 framing bytes each, 7.7 kB, over what an 8000-byte topic
    leaves: counted, so dropped (summing names and values alone, 700 bytes, would have kept them)."""
    from stream.dlq import DeadLetter

    dlq, producer, kafka = _dead_letters()
    dlq.send(kafka.impressions_topic, b"k", b"v" * 100, BadMessage("r", kind="bad_json"), 0, 9,
             headers=[("h", b"")] * 700)
    [(_, sent_value, sent_key, headers)] = producer.sent
    assert DeadLetter.from_headers(headers).headers_dropped == 700
    assert _record_bytes(sent_key, sent_value, headers) <= usable_bytes(LIMIT)


def test_original_headers_are_kept_beside_a_value_cut_anyway_when_dropping_them_saves_none_of_its_bytes() -> None:
    """A poison message near its topic's max.message.bytes (1 MB) with a tracing header, to a dead-letter topic of
    the same limit: the value is over the room and cut to ``TRUNCATED_BYTES`` whether the header stays or not, yet
    the header was dropped (``dlq.headers_dropped: 1``), lost for no byte of the event."""
    from stream.dlq import TRUNCATED_BYTES, DeadLetter

    kafka = KafkaSettings()
    producer = RecordingProducer()
    limit = 1_048_588
    dlq = DeadLetters(kafka, producer, {kafka.dlq_topic(kafka.impressions_topic):  # type: ignore[arg-type]
                                       MessageLimit(limit, "topic max.message.bytes")})
    value = b"v" * (limit - 100)
    dlq.send(kafka.impressions_topic, b"k", value, BadMessage("too large", kind="too_large"), 0, 9,
             headers=[("trace-id", b"abc")])
    [(_, sent_value, sent_key, headers)] = producer.sent
    letter = DeadLetter.from_headers(headers)
    assert sent_value == value[:TRUNCATED_BYTES] and letter.value_truncated_from == len(value)
    assert letter.original_headers == (("trace-id", b"abc"),) and letter.headers_dropped == 0
    assert _record_bytes(sent_key, sent_value, headers) + 61 <= limit  # (61: the record batch's header)


def test_original_headers_are_dropped_where_keeping_them_would_cut_more_of_a_truncated_value() -> None:
    """Under an 8000-byte topic a value over the room is cut to what is left: there the headers cost event bytes,
    so they still go (the rule the test above narrows, not reverses)."""
    from stream.dlq import DeadLetter

    dlq, producer, kafka = _dead_letters()
    value = b"v" * 50_000
    dlq.send(kafka.impressions_topic, b"k", value, BadMessage("r", kind="too_large"), 0, 9,
             headers=[("h", b"x" * 500)])
    [(_, sent_value, sent_key, headers)] = producer.sent
    letter = DeadLetter.from_headers(headers)
    assert letter.headers_dropped == 1 and value.startswith(sent_value) and len(sent_value) > 1000
    assert _record_bytes(sent_key, sent_value, headers) + 61 <= LIMIT  # (61: the record batch's header)
