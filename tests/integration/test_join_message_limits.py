"""The joiner against message size limits below what it writes by default (``JoinPipeline`` over the real broker of
the session stack): the limit it learns at start for the samples and state topics (the topic's
``max.message.bytes`` by DescribeConfigs, the producer's ``message.max.bytes``), its messages sized under it, a
sample alone over it dead-lettered, and a message refused as too large anyway stopping the worker with a
configuration error instead of a retry.

The local broker (Tansu) stores a topic's ``max.message.bytes`` and answers DescribeConfigs with it, but does not
enforce it (a 50 kB record goes into a topic of 10 kB): the tests that need a refusal get it from the producer's own
``message.max.bytes`` (``[kafka.extra]``), which librdkafka enforces on every ``produce``.
"""

from __future__ import annotations

import dataclasses
import gc
import uuid
from collections.abc import Callable, Iterator

import orjson
import pytest
from confluent_kafka import KafkaError
from confluent_kafka.admin import AdminClient, NewTopic

from stream.config import KafkaSettings, RedisSettings
from stream.dlq import DeadLetter
from stream.errors import ConfigError, MessageLimitError
from stream.joiner import pipeline as pipeline_module
from stream.joiner.config import JoinerSettings
from stream.joiner.pipeline import JoinPipeline
from stream.joiner.records import Record
from stream.joiner.state_log import state_topic
from stream.kafka import admin_config
from stream.kafka_limits import MessageLimit
from stream.limits import DEFAULT_LIMITS, EventLimits
from stream.samples import SampleBatch
from tests.bounded_teardown import close_all
from tests.integration.test_join_pipeline import T0, WINDOW_MS, click, imp
from tests.integration.test_join_recovery import worker
from tests.kafka_io import read_topic

LIMIT = 40_000  # bytes: far below the 900 kB the joiner writes by default


@pytest.fixture
def settings(group_id: str, kafka: KafkaSettings) -> JoinerSettings:
    return JoinerSettings(app_id=group_id, attribution_window_s=WINDOW_MS / 1000, allowed_lateness_s=0.0,
                          watermark_quorum=1, counts_flush_s=3600.0, late_clicks_topic=f"late-{kafka.samples_topic}",
                          poison_after=2, emission="wait", sample_flush_rows=100_000)


@pytest.fixture
def make(stack, settings: JoinerSettings) -> Iterator[Callable[..., JoinPipeline]]:
    """New pipelines (a new one = a restarted worker: the same Redis prefix, so its strikes); closed at teardown."""
    made: list[JoinPipeline] = []
    prefix = f"jl{uuid.uuid4().hex[:8]}"

    def new(kafka: KafkaSettings, limits: EventLimits = DEFAULT_LIMITS) -> JoinPipeline:
        p = JoinPipeline(kafka, RedisSettings(url=stack.redis_url, prefix=prefix), settings, limits)
        made.append(p)
        return p

    yield new
    close_all(p.close for p in made)


def tagged(kafka: KafkaSettings, n: int, tags: int = 40) -> list:
    """``n`` impressions of ``tags`` context tags each (~400 bytes of state and sample apiece), clicked."""
    out = [imp(kafka, 0, i, f"imp{i:05d}", T0 + i, tags=[f"t{i}-{j}" for j in range(tags)]) for i in range(n)]
    return out + [click(kafka, 0, i, f"imp{i:05d}", T0 + i + 1) for i in range(n)]


def sizes(kafka: KafkaSettings, topic: str) -> list[int]:
    return [len(r.value or b"") + len(r.key or b"") for r in read_topic(kafka, topic) if r.value is not None]


def test_a_producer_message_limit_below_the_record_size_sizes_samples_and_state_parts_under_it(
        kafka: KafkaSettings, make) -> None:
    """``[kafka.extra] message.max.bytes`` at 40 kB: a batch of 600 impressions made a samples message and a state
    chunk of ~250 kB each, every produce was refused (MessageTooLarge) and the batch failed, its messages given
    strikes, to be dead-lettered as poison after ``poison_after`` tries; now the joiner learns the limit at start and
    writes every message under it, and a restarted worker restores all of it."""
    kafka = dataclasses.replace(kafka, extra={"message.max.bytes": str(LIMIT)})
    p = make(kafka)
    p.process(tagged(kafka, 600))
    assert p.strikes.counts == {}
    samples, state = sizes(kafka, kafka.samples_topic), sizes(kafka, state_topic(p.js.app_id))
    assert len(samples) > 1 and max(samples) <= LIMIT
    assert len(state) > 1 and max(state) <= LIMIT
    assert sum(SampleBatch.decode(r.value).batch.num_rows for r in read_topic(kafka, kafka.samples_topic)) == 600
    again = make(kafka)
    again.restore({0})
    assert again.engines[0].offsets == [599, 599] and len(again.engines[0].pending) == 600


def test_a_topic_max_message_bytes_read_by_describe_configs_bounds_what_the_joiner_writes_to_it(
        kafka: KafkaSettings, make, settings: JoinerSettings) -> None:
    """The state and samples topics created with ``max.message.bytes=40000`` (Apache Kafka refuses anything bigger
    with MSG_SIZE_TOO_LARGE, which the joiner took for an outage and retried for ever): the joiner reads the limit
    with DescribeConfigs and writes under it. (Tansu answers DescribeConfigs but does not enforce the limit: the
    records' sizes show what Kafka would have refused.)"""
    create(kafka, NewTopic(state_topic(settings.app_id), kafka.partitions, 1, config={"cleanup.policy": "compact",
                                                                     "max.message.bytes": str(LIMIT)}),
           NewTopic(kafka.samples_topic, kafka.partitions, 1, config={"max.message.bytes": str(LIMIT)}))
    p = make(kafka)
    assert p.message_limits[kafka.samples_topic] == MessageLimit(LIMIT, "topic max.message.bytes")
    p.process(tagged(kafka, 600))
    samples, state = sizes(kafka, kafka.samples_topic), sizes(kafka, state_topic(p.js.app_id))
    assert len(samples) > 1 and max(samples) <= LIMIT
    assert len(state) > 1 and max(state) <= LIMIT


def create(kafka: KafkaSettings, *topics: NewTopic) -> None:
    admin = AdminClient(admin_config(kafka))
    for fut in admin.create_topics(list(topics), operation_timeout=10).values():
        fut.result()


def test_one_sample_over_the_samples_topic_limit_is_dead_lettered_with_the_limit_in_its_reason(
        kafka: KafkaSettings, make) -> None:
    create(kafka, NewTopic(kafka.samples_topic, kafka.partitions, 1, config={"max.message.bytes": "8000"}))
    p = make(kafka)
    big = imp(kafka, 0, 0, "big", T0, tags=[f"tag{i}" for i in range(1000)])  # ~9 kB of int64s in its sample
    p.process([big, imp(kafka, 0, 1, "small", T0 + 1), click(kafka, 0, 0, "big", T0 + 2),
               click(kafka, 0, 1, "small", T0 + 3)])
    [rec] = read_topic(kafka, kafka.dlq_topic(kafka.samples_topic))
    reason = dict(rec.headers)["dlq.reason"].decode()
    assert rec.key == b"big" and "8000 bytes, topic max.message.bytes" in reason
    assert [SampleBatch.decode(r.value).impression_ids for r in read_topic(kafka, kafka.samples_topic)] == [["small"]]


@pytest.mark.parametrize("entry", ["process", "process_new"])  # the kafka driver's call, the faust driver's
def test_an_impression_whose_state_alone_is_over_the_state_topic_limit_is_dead_lettered_in_its_batch_the_rest_joined(
        kafka: KafkaSettings, make, settings: JoinerSettings, entry: str) -> None:
    """Its state part cannot be cut smaller. It was a StateTooLarge that failed the whole batch: every record got a
    strike, and only ``poison_after`` restarts later was the impression, processed alone, dead-lettered (``poison``).
    Now it goes to the dead-letter queue (``too_large``, the state topic's limit in the reason) in the batch that finds
    it, which goes on: every other impression and click of the batch (of both partitions) joined once, the click on
    it that waited from an earlier batch and the one in the batch reported as orphans, nothing of it in the state."""
    kafka = dataclasses.replace(kafka, extra={"message.max.bytes": "8000"})
    p = make(kafka)
    run = getattr(p, entry)
    run([click(kafka, 0, 0, "big", T0 + 2)])  # its click first: it waits for the impression
    run([imp(kafka, 0, 0, "a", T0), imp(kafka, 0, 1, "big", T0 + 1, tags=[f"tag{i}" for i in range(1000)]),
         imp(kafka, 0, 2, "b", T0 + 3), imp(kafka, 1, 0, "c", T0 + 1),
         click(kafka, 0, 1, "a", T0 + 4), click(kafka, 0, 2, "big", T0 + 5), click(kafka, 1, 0, "c", T0 + 6)])
    assert p.strikes.counts == {}
    assert p.processed == {(kafka.impressions_topic, 0): 3, (kafka.clicks_topic, 0): 3,
                           (kafka.impressions_topic, 1): 1, (kafka.clicks_topic, 1): 1}
    [rec] = read_topic(kafka, kafka.dlq_topic(kafka.impressions_topic))
    dl = DeadLetter.from_headers(rec.headers)
    big = imp(kafka, 0, 1, "big", T0 + 1, tags=[f"tag{i}" for i in range(1000)])
    assert (rec.key, dl.kind, dl.source_partition, dl.source_offset) == (b"big", "too_large", 0, 1)
    assert big.value.startswith(rec.value)  # (over the 8000 bytes the dead-letter topic takes too: cut, headers say)
    assert dict(rec.headers)["dlq.value_truncated_from"] == str(len(big.value)).encode()
    assert state_topic(p.js.app_id) in dl.reason and "8000" in dl.reason
    assert "big" not in p.engines[0].pending
    again = make(kafka)  # a restarted worker: the state log holds no trace of it either
    again.restore({0, 1})
    assert set(again.engines[0].pending) == {"a", "b"} and set(again.engines[1].pending) == {"c"}
    p.drain()
    samples = [(i, int(label)) for r in read_topic(kafka, kafka.samples_topic)
               for i, label in zip(SampleBatch.decode(r.value).impression_ids,
                                   SampleBatch.decode(r.value).column("label").tolist(), strict=True)]
    assert sorted(samples) == [("a", 1), ("b", 0), ("c", 1)]
    late = [orjson.loads(r.value) for r in read_topic(kafka, settings.late_clicks_topic)]
    assert sorted((u["impression_id"], u["click_ts"], u["reason"]) for u in late) == [
        ("big", T0 + 2, "orphan"), ("big", T0 + 5, "orphan")]
    s = p.totals.summary()
    assert (s["state_too_large"], s["dead_lettered"], s["positives"]) == (1, 1, 2)


def test_a_message_refused_as_too_large_after_sizing_is_a_configuration_error_naming_the_topic_not_strikes(
        kafka: KafkaSettings, make, monkeypatch: pytest.MonkeyPatch) -> None:
    """A broker whose limit is lower than the one learned (one that does not answer DescribeConfigs, a limit
    lowered while the joiner runs): the refusal stops the worker with a ConfigError (exit 2) naming the topic, the
    size and what to set, and gives the batch's innocent records no strikes. It was a DeliveryFailed, an outage to the
    worker, which rewound and read the batch again for ever."""
    kafka = dataclasses.replace(kafka, extra={"message.max.bytes": str(LIMIT)})
    real = pipeline_module.message_limits
    monkeypatch.setattr(pipeline_module, "message_limits", lambda *a, **kw: {  # a limit the broker does not keep
        t: MessageLimit(1_000_000, "topic max.message.bytes") for t in real(*a, **kw)})
    p = make(kafka)
    with pytest.raises(ConfigError, match=rf"{kafka.samples_topic}.*max\.message\.bytes") as got:
        p.process(tagged(kafka, 600))
    assert "\n" not in str(got.value)
    assert p.strikes.counts == {}


class _Refused:
    """What librdkafka's delivery report carries for a record the broker refused as too large."""

    def __init__(self, topic: str, value: bytes) -> None:
        self._topic, self._value = topic, value

    def topic(self) -> str:
        return self._topic

    def value(self) -> bytes:
        return self._value

    def key(self) -> bytes:
        return b"0"


def test_a_samples_message_the_broker_refuses_as_too_large_stops_the_kafka_driver_instead_of_rewinding_for_ever(
        kafka: KafkaSettings, make, monkeypatch: pytest.MonkeyPatch) -> None:
    """Apache Kafka refuses a record over the topic's max.message.bytes at delivery (MSG_SIZE_TOO_LARGE in the
    delivery report; Tansu does not enforce the limit, so the report is the broker's answer, given here). The flush
    raised DeliveryFailed, an outage to the worker: it rewound, read the batch again and was refused again, for ever,
    without a strike or a clear line. Now it stops with a MessageLimitError (exit 2) naming the topic and the
    setting."""
    p = make(kafka)
    send = p.producer.send

    def refused_by_the_broker(topic: str, value: bytes | None, *args: object, **kwargs: object) -> None:
        send(topic, value, *args, **kwargs)  # type: ignore[arg-type]
        if topic == kafka.samples_topic:
            p.producer._on_error(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), _Refused(topic, value or b""))

    monkeypatch.setattr(p.producer, "send", refused_by_the_broker)
    w = worker(p, kafka)
    try:
        with pytest.raises(MessageLimitError, match=rf"{kafka.samples_topic} was refused by the broker as too large.*"
                                                    rf"--entity-name {kafka.samples_topic}"):
            w._process(tagged(kafka, 10), None)
        assert w.recoveries == 0 and w.consumer.commits == [] and p.strikes.counts == {}
    finally:
        w.consumer.close()


def test_a_limit_too_small_to_write_the_join_state_under_stops_the_joiner_at_start_naming_topic_and_setting(
        kafka: KafkaSettings, make) -> None:
    with pytest.raises(ConfigError, match=r"takes records of at most 5000 bytes \(\[kafka\.extra\] message\.max\.bytes"
                                          r"\); the joiner needs at least \d+: raise \[kafka\.extra\] message\.max"):
        make(dataclasses.replace(kafka, extra={"message.max.bytes": "5000"}))


def test_a_joiner_refused_at_start_leaves_the_processs_garbage_collector_as_it_found_it(
        kafka: KafkaSettings, make) -> None:
    """The pipeline paced the collector (gc_every_s) before its start-up checks, and only close() gives it back: one
    refused at start left automatic full collections off for the rest of the process (every later test of that
    pytest worker ran without them)."""
    found = gc.get_threshold()
    with pytest.raises(ConfigError, match="takes records of at most 5000 bytes"):
        make(dataclasses.replace(kafka, extra={"message.max.bytes": "5000"}))
    assert gc.get_threshold() == found


def record_bytes(rec) -> int:  # noqa: ANN001 - a tests.kafka_io record
    """What a record weighs against a topic's limit, but the framing: key, value and headers."""
    return len(rec.key or b"") + len(rec.value or b"") + sum(len(k) + len(v) for k, v in rec.headers or [])


def test_a_dead_letter_topic_max_message_bytes_bounds_the_dead_letters_the_joiner_writes_to_it(
        kafka: KafkaSettings, make) -> None:
    """``impressions.dlq`` created with ``max.message.bytes=8000``: a 30 kB malformed impression went to it whole
    (only the producer's limit was known to the dead letters; Apache Kafka refuses such a record, and the worker
    stopped). Now its limit is learned at start and the dead letter cut under it, ``dlq.value_truncated_from`` saying
    how much there was; the good record beside it is joined."""
    dlq = kafka.dlq_topic(kafka.impressions_topic)
    create(kafka, NewTopic(dlq, 1, 1, config={"max.message.bytes": "8000"}))
    p = make(kafka)
    assert p.dead_letters.limit(dlq) == MessageLimit(8000, "topic max.message.bytes")
    bad = b"{" + b" " * 30_000  # not JSON
    p.process([Record(kafka.impressions_topic, 0, 0, b"bad", bad), imp(kafka, 0, 1, "good", T0)])
    [rec] = read_topic(kafka, dlq)
    assert record_bytes(rec) <= 8000 and bad.startswith(rec.value) and rec.key == b"bad"
    assert dict(rec.headers)["dlq.value_truncated_from"] == b"30001"
    assert DeadLetter.from_headers(rec.headers).kind == "bad_json"
    assert "good" in p.engines[0].pending


def test_a_late_click_over_the_late_clicks_topic_limit_is_dead_lettered_not_written_over_it(
        kafka: KafkaSettings, make, settings: JoinerSettings) -> None:
    """``late_clicks`` created at the least limit the joiner takes (6144 bytes) and ids allowed up to 4000 characters:
    an orphan click on a 3000-character id made a 6 kB late-click record, written as it was (its topic's limit was not
    learned). Now it goes to ``late_clicks.dlq`` (``too_large``, the limit in the reason); the short one beside it to
    ``late_clicks``."""
    create(kafka, NewTopic(settings.late_clicks_topic, kafka.partitions, 1, config={"max.message.bytes": "6144"}))
    p = make(kafka, EventLimits(max_str_len=4000))
    long_id = "x" * 3000
    p.process([imp(kafka, 0, 0, "a", T0), click(kafka, 0, 0, long_id, T0 + 1), click(kafka, 0, 1, "ghost", T0 + 2)])
    p.drain()
    late = read_topic(kafka, settings.late_clicks_topic)
    assert [orjson.loads(r.value)["impression_id"] for r in late] == ["ghost"]
    assert max(map(record_bytes, late)) <= 6144
    [rec] = read_topic(kafka, kafka.dlq_topic(settings.late_clicks_topic))
    dl = DeadLetter.from_headers(rec.headers)
    assert (rec.key, dl.kind) == (long_id.encode(), "too_large") and "6144" in dl.reason
    assert orjson.loads(rec.value) == {"impression_id": long_id, "click_ts": T0 + 1, "reason": "orphan", "partition": 0}
    assert p.totals.summary()["late_clicks_too_large"] == 1


def test_a_dead_letter_topic_too_small_for_a_dead_letters_headers_stops_the_joiner_at_start_naming_it(
        kafka: KafkaSettings, make) -> None:
    dlq = kafka.dlq_topic(kafka.clicks_topic)
    create(kafka, NewTopic(dlq, 1, 1, config={"max.message.bytes": "3000"}))
    with pytest.raises(ConfigError, match=rf"topic {dlq} takes records of at most 3000 bytes \(topic max\.message\."
                                          rf"bytes\).*--entity-name {dlq}"):
        make(kafka)


@pytest.mark.parametrize("topic", ["dlq", "late"])
def test_a_dead_letter_or_late_click_the_broker_refuses_as_too_large_stops_the_kafka_driver_naming_its_learned_limit(
        kafka: KafkaSettings, make, settings: JoinerSettings, monkeypatch: pytest.MonkeyPatch, topic: str) -> None:
    """As for a samples message (above): the broker's refusal of a record sized under the limit learned for its topic
    is a MessageLimitError (exit 2) naming the topic and that limit; nothing is committed, no strikes are given, the
    worker does not rewind to send it again."""
    refused_topic = kafka.dlq_topic(kafka.impressions_topic) if topic == "dlq" else settings.late_clicks_topic
    p = make(kafka)
    send = p.producer.send

    def refused_by_the_broker(to: str, value: bytes | None, *args: object, **kwargs: object) -> None:
        send(to, value, *args, **kwargs)  # type: ignore[arg-type]
        if to == refused_topic:
            p.producer._on_error(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), _Refused(to, value or b""))

    monkeypatch.setattr(p.producer, "send", refused_by_the_broker)
    w = worker(p, kafka)
    learned = p.message_limits[refused_topic].bytes
    try:
        with pytest.raises(MessageLimitError, match=rf"{refused_topic} was refused by the broker as too large.*sized "
                                                    rf"under {learned} bytes.*--entity-name {refused_topic}"):
            w._process([Record(kafka.impressions_topic, 0, 0, b"bad", b"not json"), imp(kafka, 0, 1, "a", T0),
                        click(kafka, 0, 0, "ghost", T0 + 1), click(kafka, 0, 1, "a", T0 + WINDOW_MS * 3)], None)
        assert w.recoveries == 0 and w.consumer.commits == [] and p.strikes.counts == {}
    finally:
        w.consumer.close()
