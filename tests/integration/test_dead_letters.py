"""Malformed messages go to <topic>.dlq with their reason; consumers never stop; nothing is lost."""

from __future__ import annotations

import json

import pytest

from stream.config import KafkaSettings
from stream.dlq import DeadLetter
from stream.event_reader import EventReader
from stream.events import Click, Impression, decode_click, decode_impression
from stream.kafka_producer import AckedProducer
from stream.kafka_topics import ensure_topics
from stream.replay.config import ClickDelay, SyntheticSettings
from stream.replay.publisher import publish
from stream.replay.synthetic import build_synthetic
from streamrec.cli import main
from tests.kafka_io import produce_raw_header_key, read_topic

POISON = [
    (b"{not json", "bad_json", None),
    (b'{"schema_version":1,"impression_id":"x","ts":-3,"user_id":1,"item_id":2}', "invalid_field", "ts"),
    (b'{"schema_version":1,"impression_id":"x","ts":3,"user_id":-1,"item_id":2}', "invalid_field", "user_id"),
    (b'{"schema_version":1,"impression_id":"x","ts":3,"item_id":2}', "invalid_field", "user_id"),
    (b'{"schema_version":1,"impression_id":"x","ts":3,"user_id":1,"item_id":2,"dense":{"p":NaN}}', "bad_json", None),
    (None, "empty", None),
]


def _decoders(kafka: KafkaSettings) -> dict:
    return {kafka.impressions_topic: decode_impression, kafka.clicks_topic: decode_click}


def test_poison_messages_are_dead_lettered_and_the_reader_goes_on(kafka: KafkaSettings, group_id: str) -> None:
    ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic])
    p = AckedProducer(kafka)
    for i in range(50):
        p.send(kafka.impressions_topic, Impression(f"i{i}", 1000 + i, f"u{i}", i).encode(), f"i{i}")
        if i < len(POISON):
            p.send(kafka.impressions_topic, POISON[i][0], f"bad{i}")
    for raw, _, _ in POISON:
        p.send(kafka.clicks_topic, raw, "c-bad")
    p.send(kafka.clicks_topic, Click("i3", 5000).encode(), "i3")
    p.flush()

    with EventReader(kafka, group_id, _decoders(kafka)) as reader:
        reader.read_to_end()
        assert reader.valid == {kafka.impressions_topic: 50, kafka.clicks_topic: 1}
        assert reader.dead_letters.total == 2 * len(POISON)
        assert reader.seen == 50 + 1 + reader.dead_letters.total  # nothing lost

    for topic in (kafka.impressions_topic, kafka.clicks_topic):
        dlq = read_topic(kafka, kafka.dlq_topic(topic))
        assert len(dlq) == len(POISON)
        by_value = {r.value: DeadLetter.from_headers(r.headers) for r in dlq}
        for raw, kind, field in POISON:
            letter = by_value[raw]  # original bytes kept untouched
            assert letter.source_topic == topic and letter.source_offset >= 0 and letter.reason
            if topic == kafka.impressions_topic:
                assert letter.kind == kind
                if field:
                    assert repr(field) in letter.reason and "expected" in letter.reason

    # Offsets were committed after the dead letters were acknowledged: a restart reads nothing twice.
    with EventReader(kafka, group_id, _decoders(kafka)) as again:
        again.read_to_end()
        assert again.seen == 0
    assert len(read_topic(kafka, kafka.dlq_topic(kafka.impressions_topic))) == len(POISON)  # no re-send


def test_the_reader_dead_letters_an_event_keyed_other_than_its_impression_id(kafka: KafkaSettings,
                                                                              group_id: str) -> None:
    """The audit reader applies the key rule of the joiner (``stream.events.check_key``): a key that is not the
    event's impression_id is ``key_mismatch``; no key is accepted."""
    ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic])
    p = AckedProducer(kafka)
    p.send(kafka.impressions_topic, Impression("a", 1000, "u", 1).encode(), "a")
    p.send(kafka.impressions_topic, Impression("b", 1000, "u", 1).encode(), "user-u")
    p.send(kafka.impressions_topic, Impression("c", 1000, "u", 1).encode(), None, partition=0)
    p.send(kafka.clicks_topic, Click("a", 2000).encode(), "not-a")
    p.flush()
    with EventReader(kafka, group_id, _decoders(kafka)) as reader:
        reader.read_to_end()
        assert reader.valid == {kafka.impressions_topic: 2}
    for topic, value in ((kafka.impressions_topic, Impression("b", 1000, "u", 1).encode()),
                         (kafka.clicks_topic, Click("a", 2000).encode())):
        [rec] = read_topic(kafka, kafka.dlq_topic(topic))
        assert rec.value == value and DeadLetter.from_headers(rec.headers).kind == "key_mismatch"


def test_synthetic_malformed_share_lands_in_the_dlq_exactly(kafka: KafkaSettings, group_id: str,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    table = build_synthetic(SyntheticSettings(impressions=5000, malformed_share=0.05), ClickDelay(), seed=2)
    summary = publish(table, kafka, "synthetic")
    assert summary.malformed_published == table.stats["malformed"] > 0

    monkeypatch.setenv("STREAMREC_KAFKA_IMPRESSIONS_TOPIC", kafka.impressions_topic)
    monkeypatch.setenv("STREAMREC_KAFKA_CLICKS_TOPIC", kafka.clicks_topic)
    assert main(["audit", "--group", group_id, "--json", "--bootstrap-servers", kafka.bootstrap_servers]) == 0
    audit = json.loads(capsys.readouterr().out)
    assert audit["dead_lettered_total"] == table.stats["malformed"]
    assert audit["valid"] == {kafka.impressions_topic: 5000, kafka.clicks_topic: summary.clicks}
    dlq = read_topic(kafka, kafka.dlq_topic(kafka.impressions_topic)) + read_topic(
        kafka, kafka.dlq_topic(kafka.clicks_topic))
    assert len(dlq) == table.stats["malformed"]
    assert all(DeadLetter.from_headers(r.headers).reason for r in dlq)


def test_an_audit_whose_impressions_and_clicks_topics_are_one_topic_is_refused_not_dead_lettering_every_impression(
        kafka: KafkaSettings, group_id: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """STREAMREC_KAFKA_CLICKS_TOPIC set to the impressions topic: the audit's decoders (topic -> decoder) kept one
    entry, the click decoder, so every valid impression was dead-lettered as an invalid click and committed past
    (exit 0). Now exit 2 naming the two settings, and nothing read, written or committed."""
    table = build_synthetic(SyntheticSettings(impressions=20), ClickDelay(), seed=2)
    publish(table, kafka, "synthetic")
    monkeypatch.setenv("STREAMREC_KAFKA_IMPRESSIONS_TOPIC", kafka.impressions_topic)
    monkeypatch.setenv("STREAMREC_KAFKA_CLICKS_TOPIC", kafka.impressions_topic)
    assert main(["audit", "--group", group_id, "--json", "--bootstrap-servers", kafka.bootstrap_servers]) == 2
    err = capsys.readouterr().err
    assert f"impressions_topic and clicks_topic are both {kafka.impressions_topic!r}" in err
    assert read_topic(kafka, kafka.dlq_topic(kafka.impressions_topic)) == []


def test_event_log_rows_a_source_cannot_use_are_dead_lettered_with_reasons(
        kafka: KafkaSettings, tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "my_log.csv"
    log.write_text("uid,iid,when,clk,device\n"
                   "u1,10,1700000000,1,ios\n"
                   ",11,1700000001,0,ios\n"          # no user: rejected
                   "u3,-4,1700000002,0,web\n"        # negative id: rejected
                   "u4,12,yesterday,1,web\n"         # bad time: rejected
                   "u5,13,1700000004,0,android\n")
    monkeypatch.setenv("STREAMREC_KAFKA_IMPRESSIONS_TOPIC", kafka.impressions_topic)
    monkeypatch.setenv("STREAMREC_KAFKA_CLICKS_TOPIC", kafka.clicks_topic)
    rc = main(["replay", "--dataset", str(log), "--json", "--no-progress", "--bootstrap-servers",
               kafka.bootstrap_servers, "--user-col", "uid", "--item-col", "iid", "--time-col", "when",
               "--time-unit", "s", "--clicked-col", "clk", "--feature-cols", "device"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["impressions"], out["clicks"], out["dead_lettered"]) == (2, 1, 3)
    dlq = read_topic(kafka, kafka.dlq_topic(kafka.impressions_topic))
    fields = sorted(DeadLetter.from_headers(r.headers).reason.split("'")[1] for r in dlq)
    assert fields == ["item_id", "ts", "user_id"]
    assert all(DeadLetter.from_headers(r.headers).source_partition == -1 for r in dlq)  # never reached the topic
    imps = [decode_impression(r.value) for r in read_topic(kafka, kafka.impressions_topic)]
    assert sorted(i.user_id for i in imps) == ["u1", "u5"] and imps[0].context["device"] in ("ios", "android")


def test_a_missing_column_is_a_usage_error_naming_it(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "x.csv"
    log.write_text("user,item,ts\n1,2,3\n")
    assert main(["replay", "--dataset", str(log), "--no-progress", "--bootstrap-servers", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "user_id" in err and "--user-col" in err


def test_unreachable_broker_surfaces_delivery_errors() -> None:
    from stream.errors import DeliveryFailed
    from stream.kafka_producer import AckedProducer

    dead = KafkaSettings(bootstrap_servers=f"127.0.0.1:{__import__('streamrec.stack').stack.free_port()}")
    p = AckedProducer(dead, **{"message.timeout.ms": 1500})
    p.send("t", b"v", b"k")
    with pytest.raises(DeliveryFailed, match="not acknowledged by 127.0.0.1"):
        p.flush(10)


def test_a_dead_letter_too_large_to_send_whole_is_truncated_with_its_size_not_a_producer_error(
        kafka: KafkaSettings) -> None:
    from stream.dlq import TRUNCATED_BYTES, DeadLetters
    from stream.errors import BadMessage

    ensure_topics(kafka, [kafka.dlq_topic(kafka.impressions_topic)])
    dlq = DeadLetters(kafka, AckedProducer(kafka, **{"message.max.bytes": 200_000}))
    huge = b"x" * 1_000_000
    dlq.send(kafka.impressions_topic, b"k", huge, BadMessage("too big", kind="too_large"), 2, 77)
    dlq.flush()
    [rec] = read_topic(kafka, kafka.dlq_topic(kafka.impressions_topic))
    headers = dict(rec.headers)
    assert headers["dlq.value_truncated_from"] == b"1000000" and rec.value == huge[:TRUNCATED_BYTES]
    assert DeadLetter.from_headers(rec.headers).source_offset == 77


def _dlq_topic_of(kafka: KafkaSettings, limit: int) -> str:
    """``impressions.dlq`` created with ``max.message.bytes=limit`` (reported by DescribeConfigs; Tansu stores the
    limit without enforcing it, so a test reads the records' sizes)."""
    from confluent_kafka.admin import AdminClient, NewTopic

    from stream.kafka import admin_config

    topic = kafka.dlq_topic(kafka.impressions_topic)
    admin = AdminClient(admin_config(kafka))
    for fut in admin.create_topics([NewTopic(topic, 1, 1, config={"max.message.bytes": str(limit)})],
                                   operation_timeout=10).values():
        fut.result()
    return topic


def test_dead_letters_of_any_process_are_sized_under_the_dead_letter_topic_limit_learned_at_the_first_one(
        kafka: KafkaSettings) -> None:
    """The learner's and the event reader's DeadLetters (no limit given): a value was cut only when the producer
    refused it, so a dead-letter topic of 8000 bytes got a 50 kB record (Apache Kafka refuses it at delivery). Now the
    topic's limit is learned at the first dead letter and everything sized under it; a key that leaves no room is cut
    too (``dlq.key_truncated_from``)."""
    from stream.dlq import DeadLetters
    from stream.errors import BadMessage
    from stream.kafka_limits import MessageLimit

    topic = _dlq_topic_of(kafka, 8000)
    dlq = DeadLetters(kafka)
    value, key = b"v" * 50_000, b"k" * 20_000
    dlq.send(kafka.impressions_topic, b"small", value, BadMessage("r" * 10_000, kind="too_large"), 1, 5)
    dlq.send(kafka.impressions_topic, key, value, BadMessage("huge key", kind="too_large"), 1, 6)
    dlq.flush()
    assert dlq.limit(topic) == MessageLimit(8000, "topic max.message.bytes")
    first, second = read_topic(kafka, topic)
    for rec in (first, second):
        assert len(rec.key) + len(rec.value) + sum(len(k) + len(v) for k, v in rec.headers) <= 8000
        assert dict(rec.headers)["dlq.value_truncated_from"] == b"50000" and rec.value == value[:len(rec.value)]
    assert first.key == b"small" and len(first.value) > 1000 and "dlq.key_truncated_from" not in dict(first.headers)
    assert DeadLetter.from_headers(first.headers).reason.endswith("...")  # the reason is bounded too
    assert dict(second.headers)["dlq.key_truncated_from"] == b"20000" and key.startswith(second.key)
    assert DeadLetter.from_headers(second.headers).source_offset == 6


def test_a_dead_letter_topic_too_small_for_the_headers_is_a_configuration_error_naming_it(
        kafka: KafkaSettings) -> None:
    from stream.dlq import DeadLetters
    from stream.errors import BadMessage, ConfigError

    topic = _dlq_topic_of(kafka, 3000)
    with pytest.raises(ConfigError, match=rf"dead-letter topic {topic} takes records of at most 3000 bytes.*"
                                          rf"--entity-name {topic}"):
        DeadLetters(kafka).send(kafka.impressions_topic, b"k", b"v", BadMessage("bad", kind="bad_json"))


def test_a_dead_letter_the_broker_refuses_as_too_large_is_a_configuration_error_at_the_flush_not_an_outage(
        kafka: KafkaSettings) -> None:
    """The refusal (MSG_SIZE_TOO_LARGE in the delivery report; Tansu does not enforce limits, so the report is given
    here) raised MessageTooLarge out of the learner's and the event reader's flush: exit 1, a restart that reads the
    message again and is refused again, for ever. Now it is a MessageLimitError (a ConfigError: exit 2) naming the
    topic, the limit it was sized under and what to set."""
    from confluent_kafka import KafkaError

    from stream.dlq import DeadLetters
    from stream.errors import BadMessage, MessageLimitError

    topic = _dlq_topic_of(kafka, 100_000)
    producer = AckedProducer(kafka)
    dlq = DeadLetters(kafka, producer)
    dlq.send(kafka.impressions_topic, b"k", b"v" * 1000, BadMessage("bad", kind="bad_json"))

    class Refused:
        def topic(self) -> str:
            return topic

        def value(self) -> bytes:
            return b"v" * 1000

        def key(self) -> bytes:
            return b"k"

    producer._on_error(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), Refused())
    with pytest.raises(MessageLimitError, match=rf"{topic} was refused by the broker as too large.*sized under "
                                                rf"100000 bytes.*--entity-name {topic}"):
        dlq.flush()


def test_a_dead_letter_keeps_the_source_message_headers_as_kafka_stored_them(kafka: KafkaSettings,
                                                                              group_id: str) -> None:
    """A malformed impression with its producer's headers (a tracing id, a forged ``dlq.reason``, a null value): the
    event reader's dead letter had only our ``dlq.*`` headers, so replaying it after a fix sent another message. The
    broker now holds the original headers first, in order, then ours; the parser reads ours, not the forged one."""
    ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic])
    original = [("trace-id", b"t-1"), ("dlq.reason", b"forged"), ("empty", None)]
    p = AckedProducer(kafka)
    p.send(kafka.impressions_topic, b"{not json", "bad", headers=original)  # type: ignore[arg-type]
    p.flush()
    with EventReader(kafka, group_id, _decoders(kafka)) as reader:
        reader.read_to_end()
    [rec] = read_topic(kafka, kafka.dlq_topic(kafka.impressions_topic))
    assert rec.headers[:3] == original and (rec.key, rec.value) == (b"bad", b"{not json")
    letter = DeadLetter.from_headers(rec.headers)
    assert letter.kind == "bad_json" and letter.reason != "forged" and letter.original_headers == tuple(original)


def test_the_reader_dead_letters_a_message_whose_header_key_is_not_utf8_without_its_headers(kafka: KafkaSettings,
                                                                                            group_id: str) -> None:
    """Another producer's header key that is not UTF-8, on a valid click and on malformed JSON: the reader passed the
    click as valid (the joiner dead-letters it: ``bad_header``), and dead-lettering the malformed one read
    confluent-kafka's broken headers, a SystemError or a segfault at every run of ``streamrec audit``."""
    ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic], partitions=1)
    p = AckedProducer(kafka)
    p.send(kafka.impressions_topic, Impression("a", 1000, "u", 1).encode(), "a")
    p.flush()
    produce_raw_header_key(kafka, kafka.impressions_topic, 0, b"bad", b"{not json", b"\xff\xfe")
    produce_raw_header_key(kafka, kafka.clicks_topic, 0, b"a", Click("a", 2000).encode(), b"\xc3(")
    p.send(kafka.impressions_topic, Impression("b", 1000, "u", 1).encode(), "b", headers=[("trace", b"t")])
    p.flush()
    with EventReader(kafka, group_id, _decoders(kafka)) as reader:
        reader.read_to_end()
        assert reader.valid == {kafka.impressions_topic: 2} and reader.dead_letters.total == 2
    for topic, value in ((kafka.impressions_topic, b"{not json"), (kafka.clicks_topic, Click("a", 2000).encode())):
        [rec] = read_topic(kafka, kafka.dlq_topic(topic))
        letter = DeadLetter.from_headers(rec.headers)
        assert rec.value == value and letter.kind == "bad_header" and "not UTF-8" in letter.reason
        assert letter.original_headers == ()  # not kept: they cannot be read
    with EventReader(kafka, group_id, _decoders(kafka)) as again:  # committed past them: not dead-lettered twice
        again.read_to_end()
        assert again.seen == 0
