"""``stream/joiner/pipeline.py`` (JoinPipeline) against the real broker and Redis of the session stack.

The pipeline's own contract, without a driver (no faust, no consumer loop): a batch of raw records in,
labelled samples (with the user's history before the impression) to ``samples`` partition p, late and
orphan clicks to ``late_clicks``, malformed records to ``<topic>.dlq`` with their reason, histories and
day counts to Redis, state chunks to the compacted state log; ``restore``/``forget`` of partitions,
``drain`` at the end of input, strikes and ``poison`` for a record that keeps failing, no strikes for an
infrastructure failure, ``totals.summary()`` and ``close()``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
import redis
from prometheus_client import REGISTRY

import stream.joiner.engine as engine
from stream.config import KafkaSettings, RedisSettings
from stream.counts import DailyCounts
from stream.dlq import DeadLetter
from stream.events import Click, Impression
from stream.features import hash_value
from stream.history import UserHistory
from stream.joiner.config import JoinerSettings
from stream.joiner.pipeline import JoinPipeline
from stream.joiner.records import Record
from stream.samples import SampleBatch, watermark_of
from tests.bounded_teardown import close_all
from tests.kafka_io import read_topic

T0 = 1_700_000_000_000  # event time base (2023-11-14), ms
WINDOW_MS = 10_000


@dataclass(frozen=True)
class Row:
    partition: int
    impression_id: str
    label: int
    label_delay_ms: int
    user: int
    history: list[int]


def sample_rows(kafka: KafkaSettings) -> list[Row]:
    out = []
    for rec in read_topic(kafka, kafka.samples_topic):
        b = SampleBatch.decode(rec.value)
        values, offsets = b.lists("history")
        for i, imp in enumerate(b.impression_ids):
            out.append(Row(rec.partition, imp, int(b.column("label")[i]), int(b.column("label_delay_ms")[i]),
                           int(b.column("user_id")[i]), values[offsets[i]:offsets[i + 1]].tolist()))
    return out


def imp(kafka: KafkaSettings, partition: int, offset: int, imp_id: str, ts: int, user: str = "u", item: str = "i",
        **context: object) -> Record:
    value = Impression(imp_id, ts, user, item, context=dict(context)).encode()  # type: ignore[arg-type]
    return Record(kafka.impressions_topic, partition, offset, imp_id.encode(), value)


def click(kafka: KafkaSettings, partition: int, offset: int, imp_id: str, ts: int) -> Record:
    return Record(kafka.clicks_topic, partition, offset, imp_id.encode(), Click(imp_id, ts).encode())


@pytest.fixture
def prefix() -> str:
    return f"jp{uuid.uuid4().hex[:8]}"


@pytest.fixture
def settings(group_id: str, kafka: KafkaSettings) -> JoinerSettings:
    # One event is a quorum and no lateness: event time follows the events exactly, so expiry is predictable.
    return JoinerSettings(app_id=group_id, attribution_window_s=WINDOW_MS / 1000, allowed_lateness_s=0.0,
                          watermark_quorum=1, counts_flush_s=3600.0, late_clicks_topic=f"late-{kafka.samples_topic}",
                          poison_after=2, emission="wait")  # one sample per impression; test_join_policies: all


@pytest.fixture
def make(kafka: KafkaSettings, stack, prefix: str, settings: JoinerSettings,
         ) -> Iterator[Callable[..., JoinPipeline]]:
    """New pipelines on the test's topics (a new one = a restarted worker); all closed at teardown."""
    made: list[JoinPipeline] = []

    def new(**changes: object) -> JoinPipeline:
        js = JoinerSettings(**{**settings.__dict__, **changes})
        p = JoinPipeline(kafka, RedisSettings(url=stack.redis_url, prefix=prefix), js)
        made.append(p)
        return p

    yield new
    close_all(p.close for p in made)


# -- tests ----------------------------------------------------------------------------------------------
def test_a_batch_of_impressions_and_clicks_gives_one_labelled_sample_per_impression_with_history(
        kafka: KafkaSettings, make, redis_client: redis.Redis, prefix: str) -> None:
    p = make()
    p.process([
        imp(kafka, 0, 0, "a", T0, user="u1", item="i1"),
        imp(kafka, 0, 1, "b", T0 + 1000, user="u2", item="i2"),
        imp(kafka, 0, 2, "c", T0 + 2000, user="u3", item="i3"),
        imp(kafka, 0, 3, "d", T0 + 5000, user="u1", item="i4"),
        click(kafka, 0, 0, "a", T0 + 500),
        click(kafka, 0, 1, "a", T0 + 600),  # a second click on a: a duplicate, no second sample
    ])
    rows = sample_rows(kafka)
    # the positive goes out at its click; the others wait for their window (event time has not passed it)
    assert rows == [Row(0, "a", 1, 500, hash_value("u1"), [])]  # its own click is not its history
    assert UserHistory(redis_client, prefix=prefix, max_len=200).recent(hash_value("u1")) == [hash_value("i1")]
    assert p.totals.summary()["pending_impressions"] == 4  # a too, labelled but inside its window (late clicks)

    p.drain()  # end of input: every pending impression expires, a negative
    rows = sample_rows(kafka)
    by_id = {r.impression_id: r for r in rows}
    assert len(rows) == 4 and set(by_id) == {"a", "b", "c", "d"}  # exactly one sample per impression
    assert {i: (r.label, r.label_delay_ms) for i, r in by_id.items()} == {
        "a": (1, 500), "b": (0, WINDOW_MS), "c": (0, WINDOW_MS), "d": (0, WINDOW_MS)}
    assert by_id["d"].history == [hash_value("i1")]  # u1's click at T0+500, before d's impression at T0+5000
    assert by_id["b"].history == [] and {r.partition for r in rows} == {0}  # samples[p] for input partition p
    s = p.totals.summary()
    assert {k: s[k] for k in ("events", "impressions", "clicks", "samples", "positives", "negatives",
                              "duplicate_clicks", "late_clicks", "orphan_clicks", "dead_lettered",
                              "pending_impressions", "click_coverage")} == {
        "events": 6, "impressions": 4, "clicks": 2, "samples": 4, "positives": 1, "negatives": 3,
        "duplicate_clicks": 1, "late_clicks": 0, "orphan_clicks": 0, "dead_lettered": 0,
        "pending_impressions": 0, "click_coverage": 0.5}
    assert s["process_s"] > 0 and {"decode", "join", "redis", "flush"} <= set(s["stage_s"])


def test_the_joiners_history_appends_expire_after_redis_history_ttl_days(
        kafka: KafkaSettings, stack, redis_client: redis.Redis, prefix: str, settings: JoinerSettings) -> None:
    """``[redis] history_ttl_days`` reaches the joiner's history writer (``streamrec join`` builds this pipeline)."""
    p = JoinPipeline(kafka, RedisSettings(url=stack.redis_url, prefix=prefix, history_ttl_days=3), settings)
    try:
        p.process([imp(kafka, 0, 0, "a", T0, user="u1", item="i1"), click(kafka, 0, 0, "a", T0 + 500)])
    finally:
        p.close()
    ttl = redis_client.ttl(UserHistory(redis_client, prefix=prefix).key(hash_value("u1")))
    assert 3 * 86_400 - 60 < ttl <= 3 * 86_400


def test_late_and_orphan_clicks_are_written_to_late_clicks_with_their_reason(kafka: KafkaSettings, make,
                                                                             settings: JoinerSettings) -> None:
    p = make()
    p.process([imp(kafka, 2, 0, "x", T0), click(kafka, 2, 0, "ghost", T0 + 200)])  # ghost's impression never comes
    p.drain()
    p.process([click(kafka, 2, 1, "x", T0 + 300)])  # x has expired (a negative): its click is late
    late = read_topic(kafka, settings.late_clicks_topic)
    assert sorted((r.partition, r.key, orjson.loads(r.value)["reason"]) for r in late) == [
        (2, b"ghost", "orphan"), (2, b"x", "late")]
    assert {orjson.loads(r.value)["impression_id"]: orjson.loads(r.value)["click_ts"] for r in late} == {
        "ghost": T0 + 200, "x": T0 + 300}
    assert [(r.impression_id, r.label) for r in sample_rows(kafka)] == [("x", 0)]  # a late click changes no label
    s = p.totals.summary()
    assert (s["late_clicks"], s["orphan_clicks"], s["clicks"], s["click_coverage"]) == (1, 1, 2, 0.0)


def test_malformed_records_are_dead_lettered_with_reasons_and_the_rest_of_the_batch_is_joined(
        kafka: KafkaSettings, make) -> None:
    p = make()
    negative_ts = orjson.dumps({"schema_version": 1, "impression_id": "neg", "ts": -5, "user_id": 1, "item_id": 2})
    future = Impression("future", T0 + 7_200_000, 1, 2).encode()
    p.process([
        Record(kafka.impressions_topic, 1, 0, b"k0", b"{not json"),
        imp(kafka, 1, 1, "ok", T0),
        Record(kafka.impressions_topic, 1, 2, b"k2", negative_ts),
        Record(kafka.clicks_topic, 1, 0, b"k3", None),
        Record(kafka.impressions_topic, 1, 3, b"k4", future, timestamp=T0),  # 2 h ahead of its broker time
        click(kafka, 1, 1, "ok", T0 + 10),
    ])
    letters = {r.key: (r.value, DeadLetter.from_headers(r.headers))
               for t in (kafka.impressions_topic, kafka.clicks_topic) for r in read_topic(kafka, kafka.dlq_topic(t))}
    assert set(letters) == {b"k0", b"k2", b"k3", b"k4"}
    value, dl = letters[b"k0"]
    assert (value, dl.kind, dl.source_topic, dl.source_partition, dl.source_offset) == (
        b"{not json", "bad_json", kafka.impressions_topic, 1, 0)
    assert dl.reason.startswith("not valid JSON")
    value, dl = letters[b"k2"]
    assert (value, dl.kind, dl.source_offset) == (negative_ts, "invalid_field", 2)
    assert dl.reason.startswith("field 'ts': got -5, expected an integer of milliseconds")
    value, dl = letters[b"k3"]
    assert (value, dl.kind, dl.source_topic, dl.reason) == (
        None, "empty", kafka.clicks_topic, "message has no value (tombstone)")
    dl = letters[b"k4"][1]
    assert dl.kind == "future_ts" and "ahead of the message's broker timestamp" in dl.reason
    assert [(r.impression_id, r.label) for r in sample_rows(kafka)] == [("ok", 1)]  # the good ones still joined
    s = p.totals.summary()
    assert (s["dead_lettered"], s["impressions"], s["clicks"], s["events"]) == (4, 1, 1, 6)


def test_a_producer_clock_years_ahead_stamping_create_time_and_ts_alike_is_future_ts_and_moves_no_event_time(
        kafka: KafkaSettings, make) -> None:
    """The broker keeps a producer's CreateTime (the topic's default timestamp type), so a producer whose clock is ten
    years ahead stamps its message as far ahead as its ``ts``: bounded by that timestamp alone, the event passed and
    (one event is this test's quorum) moved the partition's event time ten years on: ``a`` closed at once as a
    negative and its click was late. The bound is capped at the joiner's wall clock."""
    from confluent_kafka import TIMESTAMP_CREATE_TIME, Message, Producer

    from stream.kafka import producer_config, read_to_end
    from stream.kafka_topics import ensure_topics

    ahead = int(time.time() * 1000) + 10 * 365 * 86_400_000
    ensure_topics(kafka, [kafka.impressions_topic])
    producer = Producer(producer_config(kafka))
    producer.produce(kafka.impressions_topic, Impression("s", ahead, "u", "i").encode(), b"s", partition=0,
                     timestamp=ahead)
    assert producer.flush(30) == 0
    got: list[Message] = []
    read_to_end(kafka, kafka.impressions_topic, got.append)
    assert [m.timestamp() for m in got] == [(TIMESTAMP_CREATE_TIME, ahead)]  # the broker kept the producer's clock
    steered = Record(kafka.impressions_topic, 0, got[0].offset(), got[0].key(), got[0].value(),
                     timestamp=got[0].timestamp()[1])
    p = make()
    p.process([imp(kafka, 0, 1, "a", T0), steered])
    p.process([click(kafka, 0, 0, "a", T0 + 100)])
    p.drain()
    letters = [(r.key, DeadLetter.from_headers(r.headers)) for r in read_topic(kafka, kafka.dlq_topic(
        kafka.impressions_topic))]
    assert [(key, dl.kind) for key, dl in letters] == [(b"s", "future_ts")]
    assert "ahead of this machine's clock" in letters[0][1].reason
    assert [(r.impression_id, r.label) for r in sample_rows(kafka)] == [("a", 1)]
    assert p.totals.summary()["late_clicks"] == 0


def test_forget_drops_a_partition_and_the_next_batch_restores_it_from_the_state_log(
        kafka: KafkaSettings, make, settings: JoinerSettings) -> None:
    from stream.joiner.state_log import FENCE_SPAN, chunk_key, claim_key, state_topic

    p = make()
    p.process([imp(kafka, 3, 0, "y", T0, user="u9")])
    assert set(p.engines) == {3} and "y" in p.engines[3].pending
    # this owner's claim, then the batch's chunk (numbered past the fenced seqs), on p3
    assert [r.key for r in read_topic(kafka, state_topic(settings.app_id))] == [claim_key(3), chunk_key(3, FENCE_SPAN)]
    p.forget({3})  # revoked: the in-memory state goes, the state log keeps it
    assert p.engines == {}
    # redelivered from the last commit: y again (skipped, its offset is in the restored state) and its click
    p.process([imp(kafka, 3, 0, "y", T0, user="u9"), click(kafka, 3, 0, "y", T0 + 100)])
    assert [(r.impression_id, r.label, r.label_delay_ms) for r in sample_rows(kafka)] == [("y", 1, 100)]
    s = p.totals.summary()
    assert (s["redelivered_skipped"], s["duplicate_impressions"]) == (1, 0)

    q = make()  # a restarted worker: everything it knows comes from the state log
    q.restore({3, 0})
    eng = q.engines[3]
    assert eng.pending["y"].click_ts == T0 + 100 and eng.offsets == [0, 0] and q.engines[0].pending == {}
    q.restore({3})
    assert q.engines[3] is eng  # a partition held already is not read again
    q.drain()
    assert len(sample_rows(kafka)) == 1  # y was labelled before the restart: no second sample for it


def test_a_malformed_event_the_kafka_driver_reads_is_dead_lettered_with_its_kafka_headers(
        kafka: KafkaSettings, make) -> None:
    """A malformed impression and click produced with headers (a tracing id, a forged ``dlq.reason``): the joiner's
    records had no headers, so its dead letters dropped them. The kafka driver's records carry them and the dead
    letters keep them in front of ours."""
    from confluent_kafka import Consumer, TopicPartition

    from stream.joiner.kafka_driver import _records
    from stream.kafka import consumer_config
    from stream.kafka_producer import AckedProducer

    original = [("trace-id", b"t-1"), ("dlq.reason", b"forged")]
    producer = AckedProducer(kafka)
    for topic in (kafka.impressions_topic, kafka.clicks_topic):
        producer.send(topic, b"{not json", b"bad", original, partition=0)
    producer.flush()
    consumer = Consumer(consumer_config(kafka, f"{uuid.uuid4().hex}", **{"enable.partition.eof": False}))
    consumer.assign([TopicPartition(t, 0, 0) for t in (kafka.impressions_topic, kafka.clicks_topic)])
    msgs: list = []
    try:
        while len(msgs) < 2:
            msgs += [m for m in consumer.consume(10, 0.5) if m.error() is None]
    finally:
        consumer.close()
    make().process(_records(msgs))
    for topic in (kafka.impressions_topic, kafka.clicks_topic):
        [rec] = read_topic(kafka, kafka.dlq_topic(topic))
        dl = DeadLetter.from_headers(rec.headers)
        assert (dl.kind, dl.original_headers) == ("bad_json", tuple(original)) and rec.headers[:2] == original


def test_a_sample_too_large_for_one_message_is_dead_lettered_not_a_producer_error(kafka: KafkaSettings,
                                                                                  make) -> None:
    p = make(max_sample_bytes=4_000)
    tags = [f"tag{i}" for i in range(1000)]  # 1000 hashed int64s: over 8 kB encoded
    p.process([imp(kafka, 0, 0, "early", T0 - 1), click(kafka, 0, 0, "early", T0 - 1)])  # both inputs: a watermark
    before = p.engines[0].watermark  # the watermark before the batch that makes the big sample
    assert before is not None
    p.process([imp(kafka, 0, 1, "big", T0, tags=tags), imp(kafka, 0, 2, "small", T0 + 1, tags=["t"])])
    p.drain()
    assert [r.impression_id for r in sample_rows(kafka)] == ["early", "small"]
    [rec] = read_topic(kafka, kafka.dlq_topic(kafka.samples_topic))
    # a replay to the samples topic reads as a message of its batch (not the last): the watermark before the batch;
    # without the header it read as from a joiner before the header (watermark_of: None)
    assert watermark_of(rec.headers) == before
    dl = DeadLetter.from_headers(rec.headers)
    assert (rec.key, dl.kind, dl.source_topic, dl.source_partition) == (b"big", "too_large", kafka.samples_topic, 0)
    assert "over max_sample_bytes=4000" in dl.reason
    assert SampleBatch.decode(rec.value).impression_ids == ["big"]  # the sample itself, to replay with larger limits
    assert p.totals.summary()["samples_too_large"] == 1


@pytest.fixture
def boom_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The join fails on an impression whose context has ``boom``: a poison record. (At the engine's hashing of a
    batch's contexts: ``hash_context`` itself no longer sees columns without None, ``context_block.hashed_rows``.)"""
    real = engine.hashed_rows

    def hashed_rows(contexts: list[dict], hash_context: Any) -> Any:
        if any("boom" in c for c in contexts):
            raise ValueError("cannot hash this context")
        return real(contexts, hash_context)

    monkeypatch.setattr(engine, "hashed_rows", hashed_rows)


def test_a_record_that_keeps_failing_gets_strikes_is_tried_alone_then_dead_lettered_as_poison(
        kafka: KafkaSettings, make, redis_client: redis.Redis, prefix: str, settings: JoinerSettings,
        boom_fails: None) -> None:
    batch = [imp(kafka, 0, 0, "ok0", T0), imp(kafka, 0, 1, "bad", T0 + 1, boom=1), imp(kafka, 0, 2, "ok2", T0 + 2)]
    strikes_key = f"{prefix}:strikes:{settings.app_id}"
    with pytest.raises(ValueError, match="cannot hash"):
        make().process(batch)
    assert redis_client.hlen(strikes_key) == 3  # every record of the failed batch, durably
    with pytest.raises(ValueError, match="cannot hash"):
        make().process(batch)  # a restarted worker: suspects go alone; ok0 passes, bad fails again
    # ok0 keeps its strike: the batch failed, so nothing of it is committed and ok0 is read again (alone again)
    assert {k.decode().rsplit(":", 1)[1]: int(v.split()[0]) for k, v in redis_client.hgetall(strikes_key).items()} == {
        "0": 1, "1": 2, "2": 1}
    p = make()
    p.process(batch)  # bad has failed poison_after=2 times: dead-lettered; ok2 goes on
    [rec] = read_topic(kafka, kafka.dlq_topic(kafka.impressions_topic))
    dl = DeadLetter.from_headers(rec.headers)
    assert (rec.key, dl.kind, dl.source_offset) == (b"bad", "poison", 1)
    assert dl.reason == "made the consumer fail 2 times in a row; last error: ValueError: cannot hash this context"
    assert redis_client.hlen(strikes_key) == 0 and p.strikes.counts == {}
    p.drain()
    assert sorted(r.impression_id for r in sample_rows(kafka)) == ["ok0", "ok2"]  # each once, across restarts


def test_a_suspect_held_past_the_frontier_keeps_its_strikes_until_it_is_joined(
        kafka: KafkaSettings, make, redis_client: redis.Redis, prefix: str, settings: JoinerSettings,
        boom_fails: None) -> None:
    # A suspect that a restarted worker holds (past the frontier, or the waiting cap's room) was not joined: clearing
    # its strikes then would let a poison record crash the worker again and again without ever reaching poison_after.
    day = 86_400_000
    batch = [click(kafka, 0, 0, "z", T0), imp(kafka, 0, 0, "a", T0), imp(kafka, 0, 1, "b", T0 + day, boom=1)]
    strikes_key = f"{prefix}:strikes:{settings.app_id}"
    with pytest.raises(ValueError, match="cannot hash"):
        make().process(batch)
    assert redis_client.hlen(strikes_key) == 3

    def clicks_behind(kind: str, partition: int) -> bool:
        return kind == "clicks"

    q = make(max_input_drift_s=60.0)  # restarted: b is a day past the clicks' time, so it is held, not joined
    q.process_new(batch, clicks_behind)
    assert q.held_counts == {(kafka.impressions_topic, 0): 1}
    assert [k.decode().rsplit(":", 2)[1:] for k in redis_client.hkeys(strikes_key)] == [["0", "1"]]  # b's, kept
    with pytest.raises(ValueError, match="cannot hash"):
        q.process_new([], None)  # joined at last (the idle exit's join of what is held): it fails again
    assert {k.decode().rsplit(":", 2)[2]: int(v.split()[0]) for k, v in redis_client.hgetall(strikes_key).items()} == {
        "1": 2}


def test_strikes_given_by_a_partitions_previous_owner_are_honoured_and_cleared_by_its_new_owner(
        kafka: KafkaSettings, make, redis_client: redis.Redis, prefix: str, settings: JoinerSettings,
        boom_fails: None) -> None:
    # Workers b and c started (and read the strikes) before worker a failed on partition 0; a stops, the group hands
    # partition 0 to b, whose driver restores it before its first batch of it. b must see a's strikes then: try the
    # suspects alone and count bad's second failure (not write 1 over a's 1); then c, given partition 0 once b
    # stopped, dead-letters bad and clears every strike of the partition.
    strikes_key = f"{prefix}:strikes:{settings.app_id}"
    b, c = make(), make()
    b.process([imp(kafka, 1, 0, "other1", T0)])  # b owns partition 1, c partition 2, their strikes read long ago
    c.process([imp(kafka, 2, 0, "other2", T0)])
    batch = [imp(kafka, 0, 0, "ok0", T0), imp(kafka, 0, 1, "bad", T0 + 1, boom=1), imp(kafka, 0, 2, "ok2", T0 + 2)]
    with pytest.raises(ValueError, match="cannot hash"):
        make().process(batch)  # a fails on partition 0 and stops
    assert redis_client.hlen(strikes_key) == 3
    b.restore({0})  # the driver's restore of a newly assigned partition, before its first batch of it
    with pytest.raises(ValueError, match="cannot hash"):
        b.process_new(batch)  # suspects alone: ok0 joins, bad fails a second time (ok0 is cleared once a batch is)
    assert {k.decode().rsplit(":", 1)[1]: int(v.split()[0]) for k, v in redis_client.hgetall(strikes_key).items()} == {
        "0": 1, "1": 2, "2": 1}
    b.forget({0})  # revoked: a partition's strikes go with it, and come back with it
    assert b.strikes.counts == {}
    c.restore({0})
    c.process_new(batch)  # poison_after=2: bad is dead-lettered, ok0 and ok2 go on
    [rec] = read_topic(kafka, kafka.dlq_topic(kafka.impressions_topic))
    assert (rec.key, DeadLetter.from_headers(rec.headers).kind) == (b"bad", "poison")
    assert redis_client.hlen(strikes_key) == 0 and c.strikes.counts == {}

def test_poison_messages_in_a_row_are_dead_lettered_after_poison_after_failures_each_not_one_per_combination(
        kafka: KafkaSettings, make, redis_client: redis.Redis, prefix: str, settings: JoinerSettings,
        boom_fails: None) -> None:
    # Nothing of a batch is committed unless all of it is processed: a poison message dead-lettered by an attempt that
    # fails later, on the next poison, is read again (no join state covers it: nothing after it was joined). Its
    # strikes must survive that attempt, or it starts over from none and every poison before the last is struck anew
    # each time the one after it fails: about poison_after ** n attempts for n poison messages in a row.
    bad = {"bad1", "bad2", "bad3"}
    batch = [imp(kafka, 0, 0, "ok0", T0), *(imp(kafka, 0, i, f"bad{i}", T0 + i, boom=1) for i in (1, 2, 3)),
             imp(kafka, 0, 4, "ok4", T0 + 4)]
    failures = 0
    while failures < 20:
        try:
            make().process(batch)  # each attempt a restarted worker reading from the last commit
            break
        except ValueError:
            failures += 1
    assert failures == 1 + len(bad)  # the whole batch once, then each poison alone poison_after - 1 = 1 more time
    dlq = read_topic(kafka, kafka.dlq_topic(kafka.impressions_topic))
    # each poison dead-lettered (again each time it is read again before its batch is committed: at least once)
    assert {(r.key, DeadLetter.from_headers(r.headers).kind) for r in dlq} == {(b.encode(), "poison") for b in bad}
    assert redis_client.hlen(f"{prefix}:strikes:{settings.app_id}") == 0
    q = make()
    q.restore({0})
    q.drain()
    assert sorted(r.impression_id for r in sample_rows(kafka)) == ["ok0", "ok4"]  # each once, across the restarts


def test_a_failed_batch_gives_strikes_to_the_records_held_before_it_and_leaves_them_held(
        kafka: KafkaSettings, make, redis_client: redis.Redis, prefix: str, settings: JoinerSettings,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # process_new keeps the held records in the pipeline: a batch that fails after taking some of them must give them
    # their strikes (they were joined with it) and leave them held as before, so the retry joins each exactly once.
    p = make(max_input_drift_s=60.0)
    day = 86_400_000
    more = {("clicks", 0)}

    def behind(kind: str, partition: int) -> bool:
        return (kind, partition) in more

    p.process_new([imp(kafka, 0, 0, "a", T0), imp(kafka, 0, 1, "b", T0 + day), click(kafka, 0, 0, "z", T0)], behind)
    assert p.held_counts == {(kafka.impressions_topic, 0): 1}  # b, a day past the clicks' time
    real = JoinPipeline._apply_all
    calls = []

    def failing(self: JoinPipeline, batches, drain: bool = False, handled=None):  # noqa: ANN001, ANN202 - the real signature
        calls.append([(partition, [ev.impression_id for _, ev in imps]) for partition, imps, _ in batches])
        raise ValueError("injected")

    monkeypatch.setattr(JoinPipeline, "_apply_all", failing)
    more.clear()  # clicks read to the end: b is taken now, with the new impression
    with pytest.raises(ValueError, match="injected"):
        p.process_new([imp(kafka, 0, 2, "c", T0 + day + 5)], behind)
    assert calls == [[(0, ["b", "c"])]]
    strikes = {k.decode().rsplit(":", 1)[1] for k in redis_client.hgetall(f"{prefix}:strikes:{settings.app_id}")}
    assert strikes == {"1", "2"}  # b (held before the batch) and c
    assert p.held_counts == {(kafka.impressions_topic, 0): 1}  # b held again; c never got in
    monkeypatch.setattr(JoinPipeline, "_apply_all", real)
    p.process_new([imp(kafka, 0, 2, "c", T0 + day + 5)], behind)  # the retry (suspects alone): b then c, once each
    assert p.held_counts == {} and p.strikes.counts == {}
    p.drain()
    assert sorted(r.impression_id for r in sample_rows(kafka)) == ["a", "b", "c"]


def test_partitions_of_a_batch_read_histories_in_partition_order(kafka: KafkaSettings, make) -> None:
    # A batch's partitions are joined in order, and Redis sees partition 0's history appends and read before partition
    # 1's appends (pipeline._apply_all overlaps the read with other work, never with the next partition's appends): a's
    # history, read as of T0+5000, lacks b's click at T0+100, which partition 1 appends after it.
    p = make()
    p.process([imp(kafka, 0, 0, "a", T0 + 5000, user="u", item="i1"), click(kafka, 0, 0, "a", T0 + 5100),
               imp(kafka, 1, 0, "b", T0, user="u", item="i2"), click(kafka, 1, 0, "b", T0 + 100)])
    p.process([imp(kafka, 0, 1, "c", T0 + 6000, user="u", item="i3"), click(kafka, 0, 1, "c", T0 + 6100)])
    by_id = {r.impression_id: r for r in sample_rows(kafka)}
    assert {i: (r.partition, r.label, r.history) for i, r in by_id.items()} == {
        "a": (0, 1, []), "b": (1, 1, []), "c": (0, 1, [hash_value("i2"), hash_value("i1")])}


def test_an_infrastructure_failure_propagates_without_strikes(kafka: KafkaSettings, make,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    p = make()

    def down(*_a: object) -> None:
        raise redis.ConnectionError("Redis is down")

    monkeypatch.setattr(p.history, "append_many", down)
    with pytest.raises(redis.ConnectionError):
        p.process([imp(kafka, 0, 0, "a", T0), click(kafka, 0, 0, "a", T0 + 1)])
    assert p.strikes.counts == {}  # a Redis outage must never make good records poison


def test_close_flushes_the_buffered_day_counts_and_may_be_called_twice(kafka: KafkaSettings, make,
                                                                     redis_client: redis.Redis, prefix: str) -> None:
    p = make()  # counts_flush_s=3600: the counts stay buffered until close
    p.process([imp(kafka, 0, 0, "a", T0, user="u1", item="i1"), imp(kafka, 0, 1, "b", T0 + 1, user="u2", item="i1"),
               click(kafka, 0, 0, "a", T0 + 5)])
    counts = DailyCounts(redis_client, prefix=prefix)
    assert counts.top("item", "impression") == []
    p.close()
    # members are the ids' stable hashes (what the samples and the hot set use)
    assert counts.top("item", "impression") == [(str(hash_value("i1")), 2.0)]
    assert counts.top("item", "click") == [(str(hash_value("i1")), 1.0)]
    assert sorted(counts.top("user", "impression")) == sorted([(str(hash_value("u1")), 1.0),
                                                               (str(hash_value("u2")), 1.0)])
    p.close()  # again (the fixture closes it a third time): nothing more is written, no error
    assert counts.top("item", "impression") == [(str(hash_value("i1")), 2.0)]


@pytest.mark.parametrize("close_fails", [False, True])
def test_close_closes_redis_when_its_last_flush_fails_and_raises_the_flushs_error(
        kafka: KafkaSettings, make, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        close_fails: bool) -> None:
    """A last flush that fails (Redis down at shutdown) left the client open, its connection pool with it. The client
    is closed all the same; the error raised is the flush's, also where the close fails too (that one is logged)."""
    p = make()
    closed = []
    real_close = p.redis.close

    def flush_fails() -> None:
        raise redis.ConnectionError("Redis is down")

    def spy() -> None:
        closed.append(True)
        real_close()
        if close_fails:
            raise OSError("close failed")

    monkeypatch.setattr(p.day_counts, "flush", flush_fails)
    monkeypatch.setattr(p.redis, "close", spy)
    with caplog.at_level(logging.ERROR, logger="streamrec.join"), pytest.raises(redis.ConnectionError,
                                                                                match="Redis is down"):
        p.close()
    assert closed == [True]
    assert ("closing the joiner's Redis client after the error below failed too" in caplog.text) == close_fails


@pytest.mark.parametrize("held", [True, False])
def test_a_held_click_input_is_not_idle_so_impressions_alone_cannot_expire_what_its_unread_clicks_label(
        held: bool, kafka: KafkaSettings, make) -> None:
    # After click_idle_s without a click, event time follows impressions alone. The backpressure gate holds a
    # partition's clicks (stream/joiner/backpressure.py): they are unread, not absent, however long the hold.
    p = make(click_idle_s=0.3)
    p.process([click(kafka, 0, 0, "z", T0 + 100)])  # the click input has started
    p.clicks_held = {0} if held else set()
    time.sleep(0.4)  # longer than click_idle_s
    p.process([imp(kafka, 0, 0, "a", T0), imp(kafka, 0, 1, "b", T0 + 3 * WINDOW_MS)])  # past a's window
    p.clicks_held = set()
    p.process([click(kafka, 0, 1, "a", T0 + 50)])  # a's click, read after the hold
    p.drain()
    labels = {r.impression_id: r.label for r in sample_rows(kafka)}
    assert labels["a"] == (1 if held else 0)
    assert p.totals.summary()["late_clicks"] == (0 if held else 1)


def held_gauge(kind: str) -> float | None:
    return REGISTRY.get_sample_value("streamrec_join_held_records", {"input": kind})


@pytest.mark.parametrize("passed_again", [True, False], ids=["process", "process_new"])
def test_records_past_the_other_inputs_time_are_held_and_joined_once_it_catches_up_dead_letters_sent_once(
        passed_again: bool, kafka: KafkaSettings, make) -> None:
    # A fetch can bring one input of a partition days ahead of the other: joined whole, every impression would go
    # out before the clicks that label the oldest (backpressure.hold_limits). Held, the samples topic keeps event
    # time: a's click goes out before b, c and d. ``process`` returns what it held for the caller to pass again;
    # ``process_new`` keeps it (the kafka driver's way): the same records are joined in the same batches.
    p = make(emission="fake_negative", max_input_drift_s=60.0)
    day = 86_400_000
    more = {("clicks", 0)}  # clicks have more to read; impressions are read to the end

    def behind(kind: str, partition: int) -> bool:
        return (kind, partition) in more

    def step(held: list[Record], records: list[Record]) -> list[Record]:
        """One batch; returns the records held after it."""
        if passed_again:
            return p.process(held + records, behind)
        p.process_new(records, behind)
        return p._held_records()

    batch = [imp(kafka, 0, 0, "a", T0), imp(kafka, 0, 1, "b", T0 + day),
             Record(kafka.impressions_topic, 0, 2, b"bad", b"{not json"),  # after a held one: held with it
             imp(kafka, 0, 3, "c", T0 + 2 * day), click(kafka, 0, 0, "z", T0 - 1000)]
    held = step([], batch)
    assert [(r.topic, r.offset) for r in held] == [(kafka.impressions_topic, o) for o in (1, 2, 3)]
    assert p.held_counts == {(kafka.impressions_topic, 0): 3}
    assert held_gauge("impressions") == 3 and held_gauge("clicks") == 0  # what an operator sees of the hold
    assert p.processed == {(kafka.impressions_topic, 0): 1, (kafka.clicks_topic, 0): 1}  # what may be committed
    assert [(r.impression_id, r.label) for r in sample_rows(kafka)] == [("a", 0)]
    assert p.totals.counts["dead_lettered"] == 0
    held = step(held, [click(kafka, 0, 1, "a", T0 + 3_000), click(kafka, 0, 2, "zz", T0 + day + 1)])
    assert [r.offset for r in held] == [3]  # b and the bad record now; c is still past the clicks' day + 60 s
    assert p.processed[(kafka.impressions_topic, 0)] == 3
    more.clear()  # clicks read to the end: nothing holds c back
    assert step(held, [imp(kafka, 0, 4, "d", T0 + 3 * day)]) == [] and p.held_counts == {}
    assert held_gauge("impressions") == 0
    assert [(r.impression_id, r.label) for r in sample_rows(kafka)] == [("a", 0), ("a", 1), ("b", 0), ("c", 0),
                                                                         ("d", 0)]
    assert p.totals.counts["dead_lettered"] == 1
    assert len(read_topic(kafka, kafka.dlq_topic(kafka.impressions_topic))) == 1
    assert p.process(batch[:1]) == []  # without ``behind`` nothing is held (here: a redelivery)


def test_the_joiner_writes_counts_and_histories_into_a_redis_cluster(kafka: KafkaSettings, settings: JoinerSettings,
                                                                     redis_cluster: str, prefix: str) -> None:
    # [redis] cluster = true: the pipeline's counts, histories and strikes go through a RedisCluster client; the
    # histories of many users are spread over the nodes and every count and history is as on a single node.
    from stream.redis_client import connect

    rds = RedisSettings(url=redis_cluster, prefix=prefix, cluster=True)
    p = JoinPipeline(kafka, rds, settings)
    try:
        users = [f"u{k}" for k in range(40)]
        p.process([imp(kafka, 0, k, f"a{k}", T0 + k, user=u, item=f"i{k % 3}") for k, u in enumerate(users)]
                  + [click(kafka, 0, k, f"a{k}", T0 + 100 + k) for k in range(40)]
                  + [imp(kafka, 1, k, f"b{k}", T0 + 5000 + k, user=u, item="i9") for k, u in enumerate(users)])
        p.drain()
    finally:
        p.close()
    by_id = {r.impression_id: r for r in sample_rows(kafka)}
    assert len(by_id) == 80 and all(by_id[f"a{k}"].label == 1 for k in range(40))
    assert all(by_id[f"b{k}"].history == [hash_value(f"i{k % 3}")] for k in range(40))  # read back from the cluster
    client = connect(rds, timeout_s=5.0)
    try:
        history = UserHistory(client, prefix=prefix, max_len=200)
        assert history.recent(hash_value("u7")) == [hash_value("i1")]
        assert len({client.get_node_from_key(history.key(hash_value(u))).name for u in users}) == 3
        counts = DailyCounts(client, prefix=prefix)
        assert counts.top("item", "impression", k=1) == [(str(hash_value("i9")), 40.0)]
        clicks = dict(counts.top("item", "click", k=3))
        assert clicks == {str(hash_value(f"i{j}")): float(len(range(j, 40, 3))) for j in range(3)}
        assert sum(c for _, c in counts.top("user", "impression", k=100)) == 80.0
        assert counts.names("item", [str(hash_value("i9"))], day=counts.days_available("item", "impression")[-1]) == {
            str(hash_value("i9")): "i9"}
    finally:
        client.close()


def test_a_joiner_batch_failing_on_a_cluster_with_every_node_down_gets_no_strikes_and_joins_once_it_is_back(
        kafka: KafkaSettings, settings: JoinerSettings, cluster_nodes, prefix: str) -> None:
    # Every node down: the history read fails first with connection errors, then (redis-py's topology refresh found
    # no node) with RedisClusterUnreachableError, no redis.RedisError. Each failure must be an infrastructure failure
    # (no strikes: poison_after=2 would dead-letter the good batch), and the batch joins once the cluster is back.
    from tests.integration.test_redis_cluster import failures_until_unreachable

    rds = RedisSettings(url=cluster_nodes.url, prefix=prefix, cluster=True)
    batch = [imp(kafka, 0, 0, "a", T0, user="u1", item="i1"), click(kafka, 0, 0, "a", T0 + 1)]
    p = JoinPipeline(kafka, rds, settings)
    try:
        cluster_nodes.stop_all()
        failures_until_unreachable(lambda: p.history.as_of([1], [T0]))  # the pipeline's client has given up
        with pytest.raises(redis.ConnectionError, match="RedisClusterUnreachableError"):
            p.process(batch)
        assert p.strikes.counts == {}
    finally:
        p.close()
    cluster_nodes.start_all()
    again = JoinPipeline(kafka, rds, settings)  # the worker restarted from its committed offsets
    try:
        again.process(batch)
        again.drain()
    finally:
        again.close()
    assert [(r.impression_id, r.label) for r in sample_rows(kafka)] == [("a", 1)]
    assert not read_topic(kafka, kafka.dlq_topic(kafka.impressions_topic))


def test_an_event_keyed_other_than_its_impression_id_is_dead_lettered_and_an_unkeyed_one_is_joined(
        kafka: KafkaSettings, make) -> None:
    """Both topics are keyed by impression_id so an impression and its click share a partition. An impression keyed
    'user-7' (by user, say) was joined as if keyed right, while its click, keyed by the id, could land on another
    partition: a silent negative and an orphan. Now such an impression or click is a ``key_mismatch`` dead letter;
    an unkeyed one (a single-partition producer) is still joined."""
    p = make()
    wrong = Impression("wrong", T0, "u", "i").encode()
    stray = Click("nokey", T0 + 20).encode()
    p.process([
        Record(kafka.impressions_topic, 0, 0, b"user-7", wrong),
        Record(kafka.impressions_topic, 0, 1, None, Impression("nokey", T0, "u", "i").encode()),
        imp(kafka, 0, 2, "ok", T0),
        Record(kafka.clicks_topic, 0, 0, b"user-7", stray),
        click(kafka, 0, 1, "ok", T0 + 10),
        Record(kafka.clicks_topic, 0, 2, None, Click("nokey", T0 + 30).encode()),
    ])
    letters = {(r.value, DeadLetter.from_headers(r.headers).kind)
               for t in (kafka.impressions_topic, kafka.clicks_topic) for r in read_topic(kafka, kafka.dlq_topic(t))}
    assert letters == {(wrong, "key_mismatch"), (stray, "key_mismatch")}
    assert sorted((r.impression_id, r.label) for r in sample_rows(kafka)) == [("nokey", 1), ("ok", 1)]
    assert p.totals.summary()["dead_lettered"] == 2
