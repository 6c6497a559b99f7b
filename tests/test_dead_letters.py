"""Malformed messages go to <topic>.dlq with their reason; consumers never stop; nothing is lost."""

from __future__ import annotations

import json

import pytest

from stream.dlq import DeadLetter
from stream.event_reader import EventReader
from stream.events import Click, Impression, decode_click, decode_impression
from stream.kafka import AckedProducer, ensure_topics
from stream.replay.publisher import publish
from stream.replay.synthetic import build_synthetic
from streamrec.cli import main
from streamrec.settings import ClickDelay, KafkaSettings, SyntheticSettings
from tests.kafka_io import read_topic

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
