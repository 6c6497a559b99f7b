"""The joiner off its happy path, against the session's broker and Redis: a state chunk half written when the process
stopped, a batch of clicks whose state header is bigger than a message, an unreadable state record, a state topic
deleted under kept offsets, Redis failing in the middle of a batch, a dead letter that cannot be written, an offset
commit that fails, a write the broker denies by authorization, a samples topic created again with fewer partitions,
an impressions topic made again under the group's committed offsets (both drivers), under a running worker, and
under a drain at exit.
Each test failed before its fix (the docstrings say how), but the dead letter's.

The pipeline fixtures (``make``, ``prefix``) are test_join_pipeline's, taken as parameters by name.
"""
# ruff: noqa: F811

from __future__ import annotations

import copy
import json
import logging
import re
import signal
import subprocess
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

import stream.joiner.engine as engine_module
import stream.joiner.pipeline as pipeline_module
from stream.config import KafkaSettings
from stream.counts import DailyCounts
from stream.dlq import DeadLetter
from stream.errors import ConfigError, PartitionLost
from stream.features import hash_value
from stream.joiner.kafka_driver import KafkaJoinWorker, _records
from stream.joiner.pipeline import Record
from stream.joiner.state_log import FENCE_SPAN, StateLogError, chunk_key, claim_key, encode_chunk, state_topic
from stream.kafka import admin_config, consumer_config
from stream.kafka_producer import AckedProducer
from stream.kafka_topics import ensure_topics, topic_identity
from stream.strikes import STRIKES_TTL_S
from tests.integration.test_join_pipeline import (  # noqa: F401
    T0,
    WINDOW_MS,
    click,
    imp,
    make,
    prefix,
    sample_rows,
    settings,
)
from tests.integration.test_joiner import join_cmd, join_env
from tests.kafka_io import make_again, read_topic


class Stopped(BaseException):
    """The process dying where it is (a SIGKILL): nothing after it runs."""


def test_a_state_chunk_half_written_when_the_process_stopped_loses_no_impression(
        kafka: KafkaSettings, make, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk in several parts, the process stopped after its part 0 was acknowledged: the restore used to take part
    0 alone as the chunk, with the whole batch's offsets, so the batch read again was skipped as applied and the
    impressions of the parts never written got no sample (175 of 200 here). Now the incomplete chunk is left out (and
    tombstoned) and the batch is joined again."""
    monkeypatch.setattr(pipeline_module, "encode_chunk", lambda c, _bound, **kw: encode_chunk(c, 3000, **kw))  # parts
    records = [imp(kafka, 0, i, f"imp-{i:04d}", T0 + i, user=f"u{i}", item=f"i{i}", tag="x" * 40) for i in range(200)]
    first = make()
    topic = state_topic(first.js.app_id)
    send = first.producer.send

    def stop_before_part_1(to: str, value: Any, key: Any = None, headers: Any = None, partition: Any = None) -> None:
        if to == topic and key is not None and key.endswith(b":1"):
            first.producer.flush()  # part 0 is in the log ...
            raise Stopped  # ... and the process dies before part 1
        send(to, value, key, headers, partition)

    monkeypatch.setattr(first.producer, "send", stop_before_part_1)
    with pytest.raises(Stopped):
        first.process(records)
    assert [r.key for r in read_topic(kafka, topic)] == [claim_key(0), chunk_key(0, FENCE_SPAN)]
    again = make()  # nothing was committed: the driver reads the batch again
    again.process(records)
    again.drain()
    assert {r.impression_id for r in sample_rows(kafka)} == {f"imp-{i:04d}" for i in range(200)}
    assert again.totals.counts["redelivered"] == 0
    third = make()  # the stale part 0 was tombstoned and written again whole: a later restore has the same state
    third.restore({0})
    assert third.engines[0].offsets == again.engines[0].offsets and third.engines[0].pending == {}


def live_keys(kafka: KafkaSettings, topic: str) -> list[bytes]:
    live: dict[bytes, bytes] = {}
    for r in read_topic(kafka, topic):
        if r.value is None:
            live.pop(r.key or b"", None)
        else:
            live[r.key or b""] = r.value
    return sorted(live)


def test_the_rest_of_a_state_chunk_being_retired_when_the_process_stopped_is_left_out_and_removed(
        kafka: KafkaSettings, make, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tombstones go in part order: a stop after part 0's left the chunk's other parts, which every restore decoded as
    a chunk (part 1's header as its head) and retired again with as many tombstones as parts were left, from part 0:
    the last part stayed in the log for good."""
    monkeypatch.setattr(pipeline_module, "encode_chunk", lambda c, _bound, **kw: encode_chunk(c, 3000, **kw))  # parts
    first = make()
    first.process([imp(kafka, 0, i, f"imp-{i:03d}", T0 + i, tag="y" * 40) for i in range(60)]
                  + [click(kafka, 0, 0, "imp-007", T0 + 100)])
    seq = first.engines[0].newest_seq  # the first chunk of this owner's (state_log.py, "Fencing")
    parts = first._parts[(0, seq)]
    assert parts > 1
    topic = state_topic(first.js.app_id)
    send = first.producer.send

    def stop_after_a_tombstone(to: str, value: Any, key: Any = None, headers: Any = None,
                               partition: Any = None) -> None:
        send(to, value, key, headers, partition)
        if to == topic and value is None and key == chunk_key(0, seq):
            first.producer.flush()
            raise Stopped

    monkeypatch.setattr(first.producer, "send", stop_after_a_tombstone)
    with pytest.raises(Stopped):  # event time past the window and late retention: chunk 0 retires
        first.process([imp(kafka, 0, 60, "later", T0 + 4_000_000), click(kafka, 0, 1, "later", T0 + 4_000_001)])
    assert live_keys(kafka, topic) == sorted([claim_key(0), chunk_key(0, seq + 1),
                                              *(chunk_key(0, seq, i) for i in range(1, parts))])
    again = make()
    again.restore({0})
    assert set(again.engines[0].pending) == {"later"} and again.engines[0].offsets == [60, 1]
    again.producer.flush()
    assert live_keys(kafka, topic) == sorted([claim_key(0), chunk_key(0, seq + 1)])


def test_a_batch_of_orphan_clicks_with_long_ids_is_joined_in_state_parts_under_the_message_limit(
        kafka: KafkaSettings, make) -> None:
    """5,000 waiting clicks with 256-character ids (the [limits] default allows them): the state chunk's head part
    carried every one of them, 1.4 MB, over the producer's message limit: the batch failed with MessageTooLarge and
    each of its clicks got a strike."""
    p = make()
    p.process([click(kafka, 0, i, "y" * 250 + f"{i:06d}", T0 + i) for i in range(5000)])
    assert p.strikes.counts == {}
    sizes = [len(r.value or b"") for r in read_topic(kafka, state_topic(p.js.app_id))]
    assert len(sizes) > 1 and max(sizes) <= 900_000
    again = make()
    again.restore({0})
    assert len(again.engines[0].waiting) == 5000


def test_an_unreadable_state_record_stops_the_restore_naming_it(kafka: KafkaSettings, make) -> None:
    """It used to raise orjson's 'unexpected end of data' (or an Arrow error) naming neither the topic, the
    partition nor the record."""
    first = make()
    first.process([imp(kafka, 0, 0, "a", T0)])  # offset 0 the claim, 1 the chunk
    producer = AckedProducer(kafka)
    topic = state_topic(first.js.app_id)
    key = chunk_key(0, first.engines[0].next_seq)  # the owner's next chunk: not fenced off
    producer.send(topic, b'SRJ1\x00\x00\x00\x40{"seq":1,', key, partition=0)  # truncated
    producer.flush()
    with pytest.raises(StateLogError, match=rf"state log {topic} partition 0: the record {re.escape(repr(key))} "
                                            r"\(offset 2"):
        make().restore({0})


def test_a_state_topic_deleted_under_the_groups_offsets_is_said(kafka: KafkaSettings, make,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """The join state is gone while the group's offsets are kept: the worker starts afresh from those offsets (the
    state topic made again), and the impressions before them that were still in their window get no sample. It used
    to say nothing."""
    first = make()
    first.process([imp(kafka, 0, i, f"old-{i}", T0 + i) for i in range(5)])
    group = Consumer(consumer_config(kafka, first.js.app_id))  # what the driver commits after that batch
    group.commit(offsets=[TopicPartition(kafka.impressions_topic, 0, 5)], asynchronous=False)
    group.close()
    admin = AdminClient(admin_config(kafka))
    topic = state_topic(first.js.app_id)
    for fut in admin.delete_topics([topic], operation_timeout=10).values():
        fut.result()
    deadline = time.monotonic() + 10
    while topic in admin.list_topics(timeout=5).topics and time.monotonic() < deadline:
        time.sleep(0.1)
    caplog.set_level(logging.WARNING, logger="streamrec.join")
    again = make()
    again.process([imp(kafka, 0, 5, "new-5", T0 + 100)])
    lost = [r.getMessage() for r in caplog.records if "its join state was lost" in r.getMessage()]
    assert len(lost) == 1 and "impressions offset 5, clicks offset (none)" in lost[0]
    caplog.clear()
    make().process([imp(kafka, 1, 0, "fresh", T0)])  # a partition never joined before: nothing to say
    assert not [r for r in caplog.records if "join state was lost" in r.getMessage()]


def test_redis_failing_in_the_middle_of_a_batch_counts_the_batch_done_again_once(
        kafka: KafkaSettings, make, redis_client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The history append fails after the batch's day counts were buffered; the kafka driver rewinds and does the batch
    again. Each failed try's counts stayed buffered: three failures wrote the impression and the click four times."""
    p = make()
    append = p.history.append_many
    failures = [redis.ConnectionError("Redis is down")] * 3

    def flaky(*args: Any, **kwargs: Any) -> None:
        if failures:
            raise failures.pop()
        append(*args, **kwargs)

    monkeypatch.setattr(p.history, "append_many", flaky)
    batch = [imp(kafka, 0, 0, "a", T0, item="i1"), click(kafka, 0, 0, "a", T0 + 1)]
    for _ in range(3):
        with pytest.raises(redis.ConnectionError):
            p.process(batch)
        p.drop_held(set(p.held_counts))  # what KafkaJoinWorker._recover does
        p.forget(set(p.engines))
    p.process(batch)
    p.close()
    counts = DailyCounts(redis_client, prefix=prefix)
    assert counts.top("item", "impression") == [(str(hash_value("i1")), 1.0)]
    assert counts.top("item", "click") == [(str(hash_value("i1")), 1.0)]


def test_a_batch_done_again_after_a_crash_between_its_history_write_and_its_commit_stores_each_click_once(
        kafka: KafkaSettings, make, redis_client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The process dies (a SIGKILL) after the batch's history appends reached Redis, before its state and offsets were
    durable; the restarted worker does the batch again. Its clicks used to be pushed again, each a copy taking the room
    of one of the user's older clicks (``stream/history.py``, the redo rule): the list held each click twice."""
    first = make()
    append = first.history.append_many

    def append_then_die(*args: Any, **kwargs: Any) -> None:
        append(*args, **kwargs)
        raise Stopped

    monkeypatch.setattr(first.history, "append_many", append_then_die)
    batch = [imp(kafka, 0, 0, "a", T0, user="u1", item="i1"), imp(kafka, 0, 1, "b", T0 + 2, user="u1", item="i2"),
             click(kafka, 0, 0, "a", T0 + 1), click(kafka, 0, 1, "b", T0 + 3)]
    with pytest.raises(Stopped):
        first.process(batch)
    again = make()
    again.process(batch)
    again.close()
    [key] = redis_client.scan_iter(match=f"{prefix}:history:*")
    stored = redis_client.lrange(key, 0, -1)
    assert sorted(stored) == sorted(set(stored)) and len(stored) == 2, stored


class FailingCommits:
    """A consumer whose first ``fail`` commits fail (a rebalance under way); what it committed."""

    def __init__(self, consumer: Consumer, fail: int) -> None:
        self.consumer, self.fail, self.commits = consumer, fail, []

    def commit(self, *args: Any, **kwargs: Any) -> Any:
        if self.fail:
            self.fail -= 1
            raise KafkaException(KafkaError(KafkaError.REBALANCE_IN_PROGRESS))
        self.commits.append([(tp.partition, tp.offset) for tp in kwargs["offsets"]])
        return self.consumer.commit(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.consumer, name)


def worker(p: Any, kafka: KafkaSettings, failing_commits: int = 0) -> KafkaJoinWorker:
    w = KafkaJoinWorker(p, kafka, p.js)
    w.consumer = FailingCommits(w.consumer, failing_commits)  # type: ignore[assignment]
    w._assigned = {0}
    return w


def test_a_poison_message_whose_dead_letter_cannot_be_written_is_not_committed(kafka: KafkaSettings, make) -> None:
    p = make()
    bad = imp(kafka, 0, 1, "b", T0 + 1)
    key = (bad.topic, bad.partition, bad.offset)
    for _ in range(p.js.poison_after):
        p.strikes.failed([key], RuntimeError("boom"))
    w = worker(p, kafka)
    # a dead-letter topic the broker refuses (settings refuse such a suffix now: set past their check, as a broker
    # whose topic policy or ACL refuses the topic would)
    unwritable = copy.copy(kafka)
    object.__setattr__(unwritable, "dlq_suffix", ".dlq/not a topic")
    p.dead_letters._kafka = unwritable
    try:
        assert not w._process([imp(kafka, 0, 0, "a", T0), bad, imp(kafka, 0, 2, "c", T0 + 2)], None)  # rewound
        assert w.consumer.commits == [] and w.recoveries == 1
        # Its strikes are kept: in the store, and back in memory with the partition the rewind forgot.
        assert key in p.strikes.store.load()
        p.restore({0})
        assert key in p.strikes.counts
    finally:
        w.consumer.close()


def test_an_offset_commit_that_fails_is_made_with_the_next_one_and_does_not_stop_the_kafka_driver(
        kafka: KafkaSettings, make) -> None:
    """The commit after a durable batch raised out of the run loop: the worker stopped (exit 1)."""
    p = make()
    w = worker(p, kafka, failing_commits=1)
    try:
        assert w._process([imp(kafka, 0, 0, "a", T0)], None)
        assert w._process([imp(kafka, 0, 1, "b", T0 + 1)], None)
        assert w.consumer.commits == [[(0, 2)]]
    finally:
        w.consumer.close()


def test_a_state_log_that_takes_longer_than_the_stall_bound_to_read_still_restores(
        kafka: KafkaSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The restore reads the state log for as long as records keep coming: a log that takes minutes to read (one
    compaction has not cleaned yet) restored under a fixed bound on the whole read failed at every start, for good
    (a ``TimeoutError`` is infrastructure: the worker starts again and reads again). Here each record takes half the
    stall bound to handle, on read_to_end's clock, so a batch of 5 takes 2.5 bounds and the whole read 10, while the
    broker has the whole bound, in real time, to answer each request; a bound on the whole read of the same length
    fails it. (The bound was 0.3 s in real time: a broker without a CPU for 0.6 s on a loaded machine failed the
    progress-bounded read at its metadata request, reproduced by SIGSTOPping the broker for 0.6 s.)"""
    import stream.kafka as kafka_module
    from stream.joiner import state_log
    from stream.kafka import read_to_end
    from stream.kafka_topics import ensure_topics

    topic = f"state-{time.monotonic_ns()}"
    ensure_topics(kafka, [topic], partitions=1)
    p = AckedProducer(kafka)
    for i in range(20):
        p.send(topic, b"x", f"0:{i}:0", partition=0)
    p.flush()
    stall_s, handled_s = 10.0, [0.0]  # time spent handling records, added to read_to_end's clock
    monkeypatch.setattr(kafka_module, "time", SimpleNamespace(monotonic=lambda: time.monotonic() + handled_s[0]))

    def slow(m: Any) -> None:
        handled_s[0] += stall_s / 2

    with pytest.raises(TimeoutError, match=f"did not reach their end in {stall_s:g}s"):
        read_to_end(kafka, topic, slow, timeout_s=stall_s, batch=5)
    seen: list[Any] = []
    assert read_to_end(kafka, topic, lambda m: (slow(m), seen.append(m.key())), timeout_s=None, stall_s=stall_s,
                       batch=5) == [0]
    assert len(seen) == 20
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(state_log, "read_to_end", lambda *a, **kw: calls.append(kw))
    state_log.load_chunks(kafka, topic, [0])
    assert calls[0]["timeout_s"] is None and calls[0]["stall_s"] == 60.0  # the restore's read: progress-bounded


def test_records_in_hand_when_their_partition_is_revoked_are_not_joined_by_the_kafka_driver(
        kafka: KafkaSettings, make) -> None:
    """While an input is paused the kafka driver gathers a batch over short polls; a poll that serves a rebalance left
    the records of the earlier polls in hand, and the batch joined them although their partitions had just been
    revoked: their join state restored and written again beside the new owner's, their offsets committed, and the
    engine kept in memory, stale, to be used as it was if the partition came back later. Now they are dropped
    unprocessed: the partitions' owner reads them again from the committed offsets."""
    from stream.joiner.backpressure import CLICKS
    from stream.joiner.kafka_driver import _records

    p = make(batch_within_s=10.0)
    w = KafkaJoinWorker(p, kafka, p.js)
    w.consumer.subscribe([kafka.impressions_topic, kafka.clicks_topic], on_assign=w._on_assign,
                         on_revoke=w._on_revoke)
    while len(w._assigned) < kafka.partitions:
        w.consumer.consume(1, 0.2)
    producer = AckedProducer(kafka)
    for i in range(40):
        r = imp(kafka, i % kafka.partitions, 0, f"imp-{i}", T0 + i)
        producer.send(r.topic, r.value, r.key, partition=r.partition)
    producer.flush()
    w.gate.paused.add((CLICKS, 0))  # an input paused: the batch is gathered over short polls
    w._sync_pauses()
    other = Consumer(consumer_config(kafka, p.js.app_id, **{"partition.assignment.strategy": "range"}))
    real = w.consumer.consume
    w.consumer = polled = FailingCommits(w.consumer, 0)  # type: ignore[assignment]
    polls: list[int] = []

    def consume(n: int, timeout: float) -> list[Any]:
        """The first poll brings records; a second member joins the group, and the next poll serves the rebalance."""
        polls.append(len(polls))
        if len(polls) > 2:
            return real(n, timeout)
        if len(polls) == 1:
            while not (got := real(n, 0.5)):
                pass
            other.subscribe([kafka.impressions_topic, kafka.clicks_topic])
            return got
        out = []
        while len(w._assigned) in (0, kafka.partitions):
            other.consume(10, 0.05)
            out += real(n, 0.05)
        return out

    polled.consume = consume  # type: ignore[attr-defined]
    try:
        records = _records(w._fetch())
        assert 0 < len(w._assigned) < kafka.partitions  # the rebalance happened while the batch was gathered
        assert w._process(records, None)
        assert set(p.engines) <= w._assigned, "a revoked partition's join state is held"
        assert {tp[1] for tp in p.processed} <= w._assigned
        revoked = set(range(kafka.partitions)) - w._assigned
        assert not [r for r in read_topic(kafka, state_topic(p.js.app_id)) if r.partition in revoked]
        assert not [tp for commit in polled.commits for tp in commit if tp[0] in revoked and tp[1] > 0]
    finally:
        other.close()
        polled.consumer.close()


def test_an_input_assigned_at_its_end_holds_the_other_back_no_longer_than_the_unfetched_grace(
        kafka: KafkaSettings, make) -> None:
    """A worker given a partition whose clicks the group had read to their end (a rebalance, a restart): librdkafka's
    position stays unknown until a record is handed out, and ``fetched_more`` took an unknown position under a known
    high watermark for "more to read", for as long as no click came. The hold then kept every impression past the
    clicks' time + drift back, and the gate's grace for an input not fetched yet (``backpressure.Unfetched``) never
    applied. Now the driver's start offset (``Gaps``: where it assigned or sought the partition) stands in for the
    position: clicks at their end have nothing more, and the impressions are joined."""
    from stream.joiner.backpressure import CLICKS
    from stream.joiner.kafka_driver import _records
    from stream.unfetched import Unfetched

    producer = AckedProducer(kafka)
    make()  # creates the topics
    for r in (imp(kafka, 0, 0, "x", T0), click(kafka, 0, 0, "x", T0 + 50)):
        producer.send(r.topic, r.value, r.key, partition=r.partition)
        producer.flush()  # one record batch each: the local broker's high watermark is the committed offset
    first = make(exit_when_idle_s=1.0)
    assert KafkaJoinWorker(first, kafka, first.js).run() == 0  # read to their end and committed
    late = [imp(kafka, 0, 1 + i, f"late-{i}", T0 + 600_000 + i) for i in range(3)]  # past the clicks' time + drift
    for r in late:
        producer.send(r.topic, r.value, r.key, partition=r.partition)
        producer.flush()
    p = make()
    w = KafkaJoinWorker(p, kafka, p.js)
    w.unfetched = Unfetched(grace_s=0.0)  # the grace for an input not fetched yet: over at once
    w.consumer.subscribe([kafka.impressions_topic, kafka.clicks_topic], on_assign=w._on_assign,
                         on_revoke=w._on_revoke)
    clicks = TopicPartition(kafka.clicks_topic, 0)
    try:
        read = 0
        while read < len(late) or w.consumer.get_watermark_offsets(clicks, cached=True)[1] < 0:
            records = _records(w._fetch())
            read += len(records)
            assert w._process(records, w._holds_back)
        assert not w._behind(CLICKS, 0)  # the clicks were assigned at their end
        assert w._process([], w._holds_back)
        assert p.held_counts == {} and {f"late-{i}" for i in range(3)} <= set(p.engines[0].pending)
    finally:
        w.consumer.close()


def test_a_member_dropped_for_a_slow_batch_does_not_commit_the_partitions_it_lost(kafka: KafkaSettings, make) -> None:
    """A batch that outlasts ``max.poll.interval.ms`` gets its member dropped from the group; its partitions go to
    another member, which reads them from the committed offsets, and the batch's own commit is refused (unknown
    member). librdkafka then tells the worker its partitions were lost, and the revocation callback committed what it
    kept of them, as a member of no generation: the local broker takes such a commit even over another member's
    assignment (seen: a dropped member's commit set the group's offset back from the new owner's 15 to 4), and the
    group's offsets moved to where the dropped member got, past records whose state the new owner had fenced off (its
    claim). Lost partitions are forgotten uncommitted now (``on_lost``)."""
    import dataclasses

    from stream.joiner.kafka_driver import _records

    slow = dataclasses.replace(kafka, extra={**kafka.extra, "max.poll.interval.ms": str(kafka.session_timeout_ms)})
    producer = AckedProducer(kafka)
    p = make()

    def send(first: int, n: int) -> None:
        for i in range(first, first + n):
            r = imp(kafka, 0, i, f"imp-{i}", T0 + i)
            producer.send(r.topic, r.value, r.key, partition=r.partition)
        producer.flush()

    send(0, 3)
    w = KafkaJoinWorker(p, slow, p.js)
    w.consumer = polled = FailingCommits(w.consumer, 0)  # type: ignore[assignment]
    w.consumer.subscribe([kafka.impressions_topic, kafka.clicks_topic], on_assign=w._on_assign,
                         on_revoke=w._on_revoke, on_lost=w._on_lost)
    try:
        done = 0
        while done < 3:
            records = _records(w._fetch(), w.gaps)
            done += len(records)
            assert w._process(records, None)
        assert p._committed([0]) == {(kafka.impressions_topic, 0): 3}
        send(3, 3)
        slow_batch: list[Any] = []
        while len(slow_batch) < 3:
            slow_batch += _records(w._fetch(), w.gaps)
        time.sleep(kafka.session_timeout_ms / 1000 + 2)  # the slow batch: past max.poll.interval.ms, which drops it
        assert w._process(slow_batch, None)  # done and durable; its commit refused: the member is unknown
        assert w._offsets == {(kafka.impressions_topic, 0): 6}  # kept for the next commit
        before = len(polled.commits)
        w._fetch()  # the worker learns that its partitions were lost
        assert w._offsets == {}
        assert polled.commits[before:] == [], "lost partitions committed"
        assert p._committed([0]) == {(kafka.impressions_topic, 0): 3}
    finally:
        polled.consumer.close()


def test_a_drain_at_exit_expires_the_impressions_of_an_assigned_partition_that_brought_no_record(
        kafka: KafkaSettings, make) -> None:
    """A worker restarted with ``--drain`` over input that an earlier run had read to its end (committed at the end,
    its pending impressions in the state log) reads nothing, so it never restored those partitions, and its drain
    expired only the partitions it held: their impressions never got a sample. Each impression here is its own
    record batch, so the local broker's high watermark is the committed offset and nothing is read again (as on
    Apache Kafka, ``stream.kafka.resume_offsets``). Now the drain restores every assigned partition first."""
    producer = AckedProducer(kafka)
    make()  # creates the topics
    for i in range(3):
        r = imp(kafka, 0, i, f"imp-{i}", T0 + i)
        producer.send(r.topic, r.value, r.key, partition=r.partition)
        producer.flush()
    first = make(exit_when_idle_s=1.0)
    assert KafkaJoinWorker(first, kafka, first.js).run() == 0
    assert first.totals.counts["impressions"] == 3 and sample_rows(kafka) == []  # pending: the window is open
    again = make(exit_when_idle_s=1.0, drain_at_exit=True)
    assert KafkaJoinWorker(again, kafka, again.js).run() == 0
    assert sorted((r.impression_id, r.label) for r in sample_rows(kafka)) == [(f"imp-{i}", 0) for i in range(3)]


def test_strikes_below_the_groups_committed_offset_are_dropped_from_redis_when_their_partition_is_restored(
        kafka: KafkaSettings, make, redis_client: redis.Redis) -> None:
    """A message committed past by another worker (after a rebalance) kept its strikes in Redis forever."""
    p = make()
    t = kafka.impressions_topic
    p.strikes.failed([(t, 0, 3), (t, 0, 7), (t, 1, 2)], RuntimeError("boom"))  # a previous owner's
    store_key = p.strikes.store.key
    assert 0 < redis_client.ttl(store_key) <= STRIKES_TTL_S  # an abandoned group's hash does not stay forever
    committer = Consumer(consumer_config(kafka, p.js.app_id))
    try:
        committer.commit(offsets=[TopicPartition(t, 0, 5)], asynchronous=False)
    finally:
        committer.close()
    restarted = make()
    restarted.restore({0})
    assert set(restarted.strikes.counts) == {(t, 0, 7), (t, 1, 2)}
    fields = {k.decode() if isinstance(k, bytes) else k for k in redis_client.hkeys(store_key)}
    assert fields == {f"{t}:0:7", f"{t}:1:2"}


def test_bad_records_read_again_below_what_the_join_state_applied_are_skipped_not_dead_lettered_twice(
        kafka: KafkaSettings, make) -> None:
    """A member given a partition reads it from the group's committed offset, which lags what the state log applied
    where the previous owner made a batch durable and lost the partition before committing it (the faust driver with
    a member leaving cleanly: test_join_chaos's "leave", 3 of 4 seeds dead-lettered 2-3 impressions twice). The
    engine skipped the good records read again as redelivered, but each bad one among them was dead-lettered again."""
    batch = [imp(kafka, 0, 0, "a", T0), Record(kafka.impressions_topic, 0, 1, b"k1", b"{not json"),
             imp(kafka, 0, 2, "b", T0 + 1), click(kafka, 0, 0, "a", T0 + 2),
             Record(kafka.clicks_topic, 0, 1, b"k2", None), click(kafka, 0, 2, "b", T0 + 3)]
    make().process(batch)
    again = make()  # the partition's next owner, its offsets not committed
    again.process(batch)
    letters = sorted(DeadLetter.from_headers(r.headers).source_coordinates for t in (kafka.impressions_topic,
                     kafka.clicks_topic) for r in read_topic(kafka, kafka.dlq_topic(t)))
    assert letters == sorted([(kafka.impressions_topic, 0, 1), (kafka.clicks_topic, 0, 1)])
    s = again.totals.summary()
    assert (s["dead_lettered"], s["redelivered_skipped"]) == (0, 6)


def test_a_stalled_owners_late_chunk_is_fenced_off_and_the_new_owners_joins_survive_a_restore(
        kafka: KafkaSettings, make) -> None:
    """Owner A stalls past its session with a batch in hand; B takes partition 0 over from the state log and joins a
    click; A wakes and writes its batch's chunk before it learns the partition is gone. Both numbered that chunk as
    the one after the newest in the log, so A's replaced B's (the last record of a key wins): a later restore lost
    B's joined click and its impression went out labelled 0 (the frozen-joiner fault test, faust driver). Now B's
    claim fences A's next seqs off: A's chunk is left out of every restore and removed."""
    a = make()
    a.process([imp(kafka, 0, 0, "x", T0), imp(kafka, 0, 1, "y", T0 + 1)])
    b = make()  # the group gave partition 0 to B
    b.process([click(kafka, 0, 0, "x", T0 + 50)])
    assert b.engines[0].pending["x"].click_ts == T0 + 50
    a.process([imp(kafka, 0, 2, "stale", T0 + 2)])  # A wakes: its batch in hand, joined and written
    c = make()  # whoever restores partition 0 next
    c.restore({0})
    eng = c.engines[0]
    assert eng.pending["x"].click_ts == T0 + 50 and "stale" not in eng.pending and eng.offsets == [1, 0]
    stale = chunk_key(0, a.engines[0].newest_seq)
    c.producer.flush()
    assert stale not in live_keys(kafka, state_topic(c.js.app_id))  # removed by the restore that found it


def test_a_claim_fences_the_seqs_past_the_log_and_keeps_the_ranges_before() -> None:
    from stream.joiner.state_log import FENCED_KEEP, PartitionLog, _decode_claim, next_claim

    claim, start = next_claim(PartitionLog([], {}, {}))
    assert _decode_claim(claim) == [(0, FENCE_SPAN - 1)] and start == FENCE_SPAN
    claim, start = next_claim(PartitionLog([], {}, {}, _decode_claim(claim), {}, start + 3))
    assert _decode_claim(claim) == [(0, FENCE_SPAN - 1), (FENCE_SPAN + 4, 2 * FENCE_SPAN + 3)]
    assert start == 2 * FENCE_SPAN + 4
    many = [(i * 10, i * 10 + 5) for i in range(FENCED_KEEP)]
    claim, start = next_claim(PartitionLog([], {}, {}, many, {}))
    assert _decode_claim(claim) == [*many[1:], (many[-1][1] + 1, many[-1][1] + FENCE_SPAN)]
    with pytest.raises(ValueError, match="pairs of integers"):
        _decode_claim(b'{"fenced": [[3, 1]]}')


def test_a_stalled_owner_reloading_its_batch_writes_no_claim_over_the_new_owners_and_fails_the_batch(
        kafka: KafkaSettings, make) -> None:
    """A stalled owner woke with a batch in hand holding an impression whose state is over the state topic's limit: the
    batch reloads its partition from the state log (``_reload``), which was a restore like any other and wrote a claim
    of its own over the new owner's: its stale chunk came past the new owner's and the new owner's next chunk fell in
    its fenced range (left out and removed by the next restore: its joined click lost, the impression labelled 0). A
    reload writes no claim, and one that finds another owner's claim fails the batch, unwritten (a broker failure's
    rewind, no strikes)."""
    a = make()
    a.process([imp(kafka, 0, 0, "x", T0), imp(kafka, 0, 1, "y", T0 + 1)])
    b = make()  # the group gave partition 0 to B
    b.process([click(kafka, 0, 0, "x", T0 + 50)])
    a.state_bytes = 8000  # A wakes with a batch in hand: one impression's state over what a record may be
    big = imp(kafka, 0, 3, "big", T0 + 3, tags=[f"t{i}" for i in range(1000)])
    with pytest.raises(PartitionLost, match="partition 0"):
        a.process([imp(kafka, 0, 2, "stale", T0 + 2), big])
    assert a.strikes.counts == {}
    b.process([click(kafka, 0, 1, "y", T0 + 60)])  # B goes on
    c = make()  # whoever restores partition 0 next
    c.restore({0})
    eng = c.engines[0]
    assert eng.pending["x"].click_ts == T0 + 50 and eng.pending["y"].click_ts == T0 + 60
    assert "stale" not in eng.pending and eng.offsets == [1, 1]


class FatalProducer:
    """A librdkafka producer after a fatal error (an idempotent producer fenced, or its sequence lost by a broker that
    lost data): every produce refused, for good, as a real one is."""

    def __init__(self, producer: Any) -> None:
        self.producer = producer

    def produce(self, *args: Any, **kwargs: Any) -> None:
        raise KafkaException(KafkaError(KafkaError._FATAL, "Fatal idempotent producer error: out of order sequence",
                                        fatal=True))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.producer, name)


def test_a_fatal_producer_error_is_recovered_from_with_a_new_producer_not_retried_for_ever(
        kafka: KafkaSettings, make, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fatal producer error leaves the librdkafka producer unusable; the kafka driver counted it an outage and
    rewound, and every later try failed the same way on the same producer: the worker never joined again."""
    p = make()
    w = worker(p, kafka)
    monkeypatch.setattr(w, "_wait", lambda seconds: None)  # the backoff's sleep
    p.producer._producer = FatalProducer(p.producer._producer)  # type: ignore[assignment]
    batch = [imp(kafka, 0, 0, "a", T0), imp(kafka, 0, 1, "b", T0 + 1), click(kafka, 0, 0, "a", T0 + 2)]
    try:
        assert not w._process(batch, None)  # rewound
        assert w.consumer.commits == []
        assert w._process(batch, None)
        assert [sorted(c) for c in w.consumer.commits] == [[(0, 1), (0, 2)]]  # clicks to 1, impressions to 2
    finally:
        w.consumer.close()
    assert [(r.impression_id, r.label) for r in sample_rows(kafka)] == [("a", 1)]


def test_a_renewed_producer_keeps_the_acknowledgements_counted_before_its_fatal_error(kafka: KafkaSettings) -> None:
    """``acked_total`` (the join's ``records_acked``) counts what the broker confirmed over the producer's life: a
    renewal after a fatal error forgets only what the old producer held unacknowledged, not the three messages a
    flush before it confirmed."""
    from stream.kafka_topics import ensure_topics

    topic = kafka.samples_topic
    ensure_topics(kafka, [topic], partitions=1)
    p = AckedProducer(kafka)
    for i in range(3):
        p.send(topic, b"v%d" % i, b"k")
    p.flush()
    assert p.acked_total == {topic: 3}
    p._producer = FatalProducer(p._producer)  # type: ignore[assignment]
    with pytest.raises(KafkaException):
        p.send(topic, b"lost", b"k")
    p.send(topic, b"v3", b"k")
    p.send(topic, b"v4", b"k")
    p.flush()
    assert p.acked_total == {topic: 5}
    assert len(read_topic(kafka, topic)) == 5


class FatalAfter(FatalProducer):
    """A producer that takes ``n`` messages and then fails for good, purging what it held (librdkafka's fatal error
    fails what is queued: never delivered)."""

    def __init__(self, producer: Any, n: int) -> None:
        super().__init__(producer)
        self.n = n

    def produce(self, *args: Any, **kwargs: Any) -> None:
        if self.n:
            self.n -= 1
            self.producer.produce(*args, **kwargs)
            return
        self.producer.purge()
        super().produce(*args, **kwargs)


def test_messages_a_run_gave_the_producer_a_fatal_error_replaced_are_not_claimed_acknowledged(
        kafka: KafkaSettings) -> None:
    """send_run counts its messages at its end: two messages given to the old producer before its fatal error were
    counted as sent by the new one, and its next flush reported them acknowledged although none was delivered."""
    from stream.kafka_topics import ensure_topics

    topic = kafka.samples_topic
    ensure_topics(kafka, [topic], partitions=1)
    p = AckedProducer(kafka)
    p._producer = FatalAfter(p._producer, 2)  # type: ignore[assignment]
    with pytest.raises(KafkaException):
        p.send_run([topic] * 5, [b"v%d" % i for i in range(5)], [b"k"] * 5, [0] * 5)
    assert p.flush().acked.get(topic, 0) == 0
    assert p.acked_total.get(topic, 0) == 0
    assert read_topic(kafka, topic) == []



class Denied:
    """What librdkafka's delivery report carries for a record the broker refused to this client (no WRITE ACL)."""

    def __init__(self, topic: str, value: bytes | None) -> None:
        self._topic, self._value = topic, value

    def topic(self) -> str:
        return self._topic

    def value(self) -> bytes | None:
        return self._value

    def key(self) -> bytes:
        return b"0"


class DeniedProducer(FatalProducer):
    """A librdkafka producer whose metadata marked ``topic`` refused to it (TOPIC_AUTHORIZATION_FAILED): every produce
    to it fails at once with that error; the others go through."""

    def __init__(self, producer: Any, topic: str) -> None:
        super().__init__(producer)
        self.topic = topic

    def produce(self, topic: str, *args: Any, **kwargs: Any) -> None:
        if topic == self.topic:
            raise KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))
        self.producer.produce(topic, *args, **kwargs)


@pytest.mark.parametrize("when", ["delivery", "produce", "fatal"])
def test_writes_the_broker_denies_by_authorization_stop_the_kafka_driver_naming_the_topic_not_rewinding_for_ever(
        kafka: KafkaSettings, make, monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """An ACL without WRITE on the samples topic: librdkafka fails the records with TOPIC_AUTHORIZATION_FAILED (in
    their delivery reports, then at every ``produce`` to the topic, its metadata marked refused); one without
    IDEMPOTENT_WRITE on the cluster: the idempotent producer's fatal CLUSTER_AUTHORIZATION_FAILED. Sending them again
    cannot succeed, yet it was a DeliveryFailed (or a KafkaException), an outage to the worker: it rewound and was
    refused again, for ever, each time told "Is the broker up?". Now a DeliveryRefused (a ConfigError: exit 2) names
    the topic and the fix; nothing is committed, no strikes are given. (The Tansu broker has no ACLs: its refusal is
    what librdkafka reports, given here to the real producer.)"""
    p = make()
    w = worker(p, kafka)
    monkeypatch.setattr(w, "_wait", lambda seconds: None)  # the backoff's sleep, were it to rewind
    if when == "produce":
        p.producer._producer = DeniedProducer(p.producer._producer, kafka.samples_topic)  # type: ignore[assignment]
    else:
        send = p.producer.send

        def denied_by_the_broker(topic: str, value: bytes | None, *args: Any, **kwargs: Any) -> None:
            send(topic, value, *args, **kwargs)
            if topic == kafka.samples_topic and when == "fatal":
                p.producer._on_fatal(KafkaError(KafkaError.CLUSTER_AUTHORIZATION_FAILED, fatal=True))
            elif topic == kafka.samples_topic:
                p.producer._on_error(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), Denied(topic, value))

        monkeypatch.setattr(p.producer, "send", denied_by_the_broker)
    batch = [imp(kafka, 0, 0, "a", T0), imp(kafka, 0, 1, "b", T0 + 1), click(kafka, 0, 0, "a", T0 + 2)]
    try:
        named = "its topics" if when == "fatal" else kafka.samples_topic
        with pytest.raises(ConfigError, match=rf"{named} \(.*[Aa]uthorization.*WRITE") as got:
            w._process(batch, None)
        assert "\n" not in str(got.value) and "Is the broker up" not in str(got.value)
        assert w.recoveries == 0 and w.consumer.commits == [] and p.strikes.counts == {}
    finally:
        w.consumer.close()


def test_a_samples_topic_created_again_with_fewer_partitions_while_the_joiner_runs_stops_it_naming_the_layout(
        kafka: KafkaSettings, make, monkeypatch: pytest.MonkeyPatch) -> None:
    """The samples topic deleted under a running joiner and created again with fewer partitions (by hand, or by a
    broker's auto-creation at its default count): the layout was checked at start only, and every batch of a partition
    past the new count failed the producer with "Unknown partition", a DeliveryFailed, an outage to the worker: it
    rewound, for ever, told "Is the broker up?". Now the layout is checked again there and its ConfigError (exit 2)
    names the topics, their counts and the fix; nothing is committed, no strikes are given."""
    p = make()
    w = worker(p, kafka)
    w._assigned = {1}
    monkeypatch.setattr(w, "_wait", lambda seconds: None)  # the backoff's sleep, were it to rewind
    admin = AdminClient(admin_config(kafka))
    for fut in admin.delete_topics([kafka.samples_topic]).values():
        fut.result()
    for fut in admin.create_topics([NewTopic(kafka.samples_topic, 1, 1)]).values():
        fut.result()
    # the producer learns the new count, as librdkafka does at its metadata refresh (topic.metadata.refresh.interval.ms)
    p.producer._producer.list_topics(kafka.samples_topic, timeout=10)
    try:
        with pytest.raises(ConfigError, match=rf"{kafka.samples_topic} has 1: add partitions"):
            w._process([imp(kafka, 1, 0, "a", T0), click(kafka, 1, 0, "a", T0 + 1)], None)
        assert w.recoveries == 0 and w.consumer.commits == [] and p.strikes.counts == {}
    finally:
        w.consumer.close()

def test_an_impressions_topic_made_again_and_written_past_the_state_logs_offsets_is_joined_from_its_first_record(
        kafka: KafkaSettings, make, caplog: pytest.LogCaptureFixture) -> None:
    """The state log kept the impressions' applied offset (4) of partition 0, not which topic it was of: the topic
    deleted, made again and written to offset 7, a restart skipped the new topic's records 0-4 as redelivered, in
    silence. Now the chunk records the topic id, and a restore onto another id reads that input from its first record,
    said as an ERROR naming both ids and counted; the pending impressions of the old topic are kept."""
    from prometheus_client import REGISTRY

    ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic], partitions=2)

    def write(ids: list[str]) -> list[Any]:
        producer = AckedProducer(kafka)
        for i, imp_id in enumerate(ids):
            producer.send(kafka.impressions_topic, imp(kafka, 0, i, imp_id, T0 + i).value, imp_id.encode(), partition=0)
        producer.flush()
        held = [r for r in read_topic(kafka, kafka.impressions_topic) if r.partition == 0]
        return [imp(kafka, 0, r.offset, r.key.decode(), T0 + r.offset) for r in held]  # what a driver passes

    first = make()
    first.process(write([f"old-{i}" for i in range(5)]))
    old_id = topic_identity(kafka, kafka.impressions_topic)["topic_id"]
    assert first.engines[0].offsets[0] == 4
    make_again(kafka, kafka.impressions_topic, partitions=2)
    new = [f"new-{i}" for i in range(8)]
    records = write(new)
    new_id = topic_identity(kafka, kafka.impressions_topic)["topic_id"]
    changed = ("streamrec_join_topic_changed_total", {"input": "impressions"})
    before = REGISTRY.get_sample_value(*changed) or 0.0
    again = make()
    again.process(records)
    eng = again.engines[0]
    assert set(eng.pending) == {f"old-{i}" for i in range(5)} | set(new)  # every new one joined, the old ones kept
    assert eng.offsets[0] == 7 and eng.topic_ids[0] == new_id
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and new_id in r.getMessage()]
    assert len(said) == 1 and old_id in said[0] and old_id != new_id
    assert REGISTRY.get_sample_value(*changed) == before + 1
    # the chunk written since records the new id: a restart resumes at offset 7 of it, without a word
    caplog.clear()
    third = make()
    third.restore({0})
    assert third.engines[0].offsets[0] == 7 and not [r for r in caplog.records if r.levelname == "ERROR"]


def test_a_topic_change_reloaded_for_an_impression_over_the_state_limit_is_said_and_counted_once(
        kafka: KafkaSettings, make, caplog: pytest.LogCaptureFixture) -> None:
    """The impressions topic made again: the first batch's restore says the change (ERROR, counted) and reads it from
    its first record. An impression of that batch over the state topic's limit reloads the partition from the state
    log (``_reload``), whose chunks still hold the old topic's id until the first new chunk: the reload said and
    counted the same change again."""
    from prometheus_client import REGISTRY

    ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic], partitions=2)
    first = make()
    first.process([imp(kafka, 0, i, f"old-{i}", T0 + i) for i in range(3)])
    make_again(kafka, kafka.impressions_topic, partitions=2)
    records = [imp(kafka, 0, 0, "new-0", T0), imp(kafka, 0, 1, "big", T0 + 1, tags=[f"t{i}" for i in range(1000)])]
    producer = AckedProducer(kafka)
    for r in records:
        producer.send(kafka.impressions_topic, r.value, r.key, partition=0)
    producer.flush()
    changed = ("streamrec_join_topic_changed_total", {"input": "impressions"})
    before = REGISTRY.get_sample_value(*changed) or 0.0
    again = make()
    again.state_bytes = 8000  # one impression's state over what a record may be: the partition is reloaded
    again.process(records)
    assert set(again.engines[0].pending) == {"old-0", "old-1", "old-2", "new-0"}  # big: dead-lettered
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and "created again" in r.getMessage()]
    assert len(said) == 1
    assert REGISTRY.get_sample_value(*changed) == before + 1


def test_a_restore_asks_the_broker_for_both_inputs_topic_ids_with_one_admin_client(
        kafka: KafkaSettings, make, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every restore (each assignment, and a partition read again mid-batch) asks which topics the inputs are now:
    one admin client and one metadata round trip per input made two clients, each listing every topic of the cluster
    for a cluster id the joiner does not use; with the broker slow that was up to 4 x 10 s before the first batch."""
    import stream.kafka_topics as kafka_topics

    ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic], partitions=2)
    p = make()
    made: list[object] = []
    real = kafka_topics.AdminClient
    monkeypatch.setattr(kafka_topics, "AdminClient", lambda conf: made.append(conf) or real(conf))
    p.restore({0, 1})
    assert len(made) == 1
    ids = [topic_identity(kafka, t)["topic_id"] for t in (kafka.impressions_topic, kafka.clicks_topic)]
    assert p.engines[0].topic_ids == ids and p.engines[1].topic_ids == ids


def test_strikes_of_an_input_topic_made_again_do_not_poison_the_new_topics_records_at_their_offsets(
        kafka: KafkaSettings, make) -> None:
    """Strikes are keyed by topic name, partition and offset: the impressions topic deleted and made again while its
    message at offset 1 had failed ``poison_after`` times (the worker stopped before its restart dead-lettered it),
    the new topic's innocent record at offset 1 was dead-lettered as poison without ever failing. The restore that
    finds the topic made again (``_follow_topics``) drops that input partition's strikes with its offsets."""
    ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic], partitions=2)
    t = kafka.impressions_topic

    def write(ids: list[str]) -> list[Any]:
        producer = AckedProducer(kafka)
        for i, imp_id in enumerate(ids):
            producer.send(t, imp(kafka, 0, i, imp_id, T0 + i).value, imp_id.encode(), partition=0)
        producer.flush()
        return [imp(kafka, 0, i, imp_id, T0 + i) for i, imp_id in enumerate(ids)]

    first = make()
    first.process(write(["old-0"]))
    for _ in range(first.js.poison_after):  # the old topic's offset 1 failed every time (the last: no restart since)
        first.strikes.failed([(t, 0, 1)], RuntimeError("boom"))
    make_again(kafka, t, partitions=2)
    records = write(["new-0", "new-1", "new-2"])
    again = make()
    again.process(records)
    assert {"new-0", "new-1", "new-2"} <= set(again.engines[0].pending)  # new-1 joined, not dead-lettered as poison
    assert (t, 0, 1) not in again.strikes.counts and (t, 0, 1) not in make().strikes.counts  # gone from Redis too


def test_strikes_of_the_new_topic_given_before_its_first_chunk_survive_a_restart(kafka: KafkaSettings, make) -> None:
    """The restore that finds an input topic made again drops that input partition's strikes (above); a record of the
    new topic that fails before the partition's first new chunk must keep its strikes at the next restart, which still
    finds the old id in the chunks: dropped again, a poison record there failed the worker at every restart, never
    dead-lettered. The claim records the ids its owner read, so the change is followed once."""
    ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic], partitions=2)
    t = kafka.impressions_topic
    make().process([imp(kafka, 0, 0, "old-0", T0)])
    make_again(kafka, t, partitions=2)
    again = make()
    again.restore({0})  # the change found: the old topic's strikes dropped
    again.strikes.failed([(t, 0, 0)], RuntimeError("boom"))  # the new topic's first record fails: no chunk written
    restarted = make()
    restarted.restore({0})
    assert restarted.engines[0].offsets[0] < 0  # the change is still found (the chunks hold the old id)
    assert restarted.strikes.counts.get((t, 0, 0), (0, ""))[0] == 1


def test_a_restart_under_another_emission_policy_with_impressions_pending_is_refused_naming_both(
        kafka: KafkaSettings, make) -> None:
    """A partition's pending impressions were emitted (or not) under the policy their state was written under;
    restored under another, a `wait` impression was taken as already emitted by fake_negative (it never got a
    sample) and a fake_negative one would be emitted again by `wait`. The claim records the policy; a restore under
    another is a ConfigError naming both (the same policy restores as before)."""
    first = make()  # emission = "wait" (the fixture's)
    first.process([imp(kafka, 0, 0, "a", T0)])
    with pytest.raises(ConfigError, match=r"partition 0's join state .* was written under \[joiner\] emission = "
                                          r"'wait', and this joiner runs 'fake_negative'"):
        make(emission="fake_negative").restore({0})
    again = make()
    again.restore({0})
    assert set(again.engines[0].pending) == {"a"}


@pytest.mark.parametrize("changes, said", [
    ({"attribution_window_s": 5.0}, "attribution_window_s = 10, and this joiner runs 5"),  # "c" closed, no negative
    ({"allowed_lateness_s": 2.0}, "allowed_lateness_s = 0, and this joiner runs 2"),
    ({"attribution_window_s": 5.0, "allowed_lateness_s": 2.0},
     "attribution_window_s = 10, allowed_lateness_s = 0, and this joiner runs attribution_window_s = 5, "
     "allowed_lateness_s = 2"),
])
def test_a_restart_under_another_window_or_lateness_with_impressions_pending_is_refused_naming_both(
        kafka: KafkaSettings, make, changes: dict[str, float], said: str) -> None:
    """The restore takes every impression its watermark has passed as emitted: under a shorter window (or lateness)
    "c", pending when the state was written (T0 + 10 s is past the watermark, T0 + 6 s - 1), was closed by the restore
    itself and never got its negative; under a longer one, impressions already closed would be held open and emitted
    again. The claim records both; a restore under others with impressions pending is a ConfigError naming both."""
    first = make()  # wait, a 10 s window, no lateness (the fixture's)
    first.process([imp(kafka, 0, 0, "c", T0), imp(kafka, 0, 1, "b", T0 + 6_000), click(kafka, 0, 0, "b", T0 + 6_000)])
    with pytest.raises(ConfigError, match=rf"partition 0's join state .* was written under \[joiner\] {said}: "):
        make(**changes).restore({0})
    again = make()
    again.restore({0})
    assert set(again.engines[0].pending) == {"b", "c"}


def test_a_restart_under_another_es_dfm_elapsed_time_with_impressions_pending_is_refused_naming_both(
        kafka: KafkaSettings, make) -> None:
    """es_dfm's elapsed time decides which pending impressions have had their observed sample: restored under 2 s,
    "c" (T0, no click, watermark T0 + 5 s - 1) was taken as observed under 8 s too and never got a sample; under a
    longer one than it was written under, a click between the two made an observed 1 after the observed 0, which the
    learner drops as the same sample. The claim records the elapsed time; another is refused while one is pending."""
    first = make(emission="es_dfm", elapsed_s=8.0)
    first.process([imp(kafka, 0, 0, "c", T0), imp(kafka, 0, 1, "b", T0 + 5_000), click(kafka, 0, 0, "b", T0 + 5_000)])
    with pytest.raises(ConfigError, match=r"partition 0's join state .* was written under \[joiner\] elapsed_s = 8, "
                                          r"and this joiner runs 2: "):
        make(emission="es_dfm", elapsed_s=2.0).restore({0})
    again = make(emission="es_dfm", elapsed_s=8.0)
    again.restore({0})
    assert set(again.engines[0].pending) == {"b", "c"} and not again.engines[0].pending["c"].observed


class ClosingFails:
    """A consumer whose ``close()`` closes it and then fails (its revocation callback raising, say)."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer

    def close(self) -> None:
        self.consumer.close()
        raise KafkaException(KafkaError(KafkaError._FAIL, "the close failed"))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.consumer, name)


def test_an_error_that_ends_the_kafka_driver_is_raised_and_its_signals_put_back_when_its_consumers_close_fails_too(
        kafka: KafkaSettings, make, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The run's ``finally:`` closed the consumer, then put the signal handlers back: a close that failed too replaced
    the error that ended the run (the line printed at exit named the close, not the cause) and left the worker's
    SIGTERM/SIGINT handlers installed. Now the close's failure is logged and the cause raised, handlers put back."""
    producer = AckedProducer(kafka)
    p = make(exit_when_idle_s=30.0)  # creates the topics
    r = imp(kafka, 0, 0, "a", T0)
    producer.send(r.topic, r.value, r.key, partition=r.partition)
    producer.flush()

    def broken(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("the real cause")

    monkeypatch.setattr(p, "process_new", broken)
    w = KafkaJoinWorker(p, kafka, p.js)
    w.consumer = ClosingFails(w.consumer)  # type: ignore[assignment]
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(RuntimeError, match="the real cause"):
        w.run()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    assert "closing the joiner's consumer after the error below failed too" in caplog.text


@pytest.mark.parametrize("impressions", [40, 5], ids=["stalled_after_quorum", "short_of_quorum"])
def test_clicks_on_impressions_that_never_come_keep_the_state_log_bounded_through_the_kafka_driver(
        kafka: KafkaSettings, make, monkeypatch: pytest.MonkeyPatch, impressions: int) -> None:
    """The impressions' producer stops after 40 impressions (their quorum of 16 reached), or after 5 (never reached),
    while clicks on impressions that never come keep arriving, ahead of them: the gate pauses nothing (the impressions
    are read to their end) and no hold applies, so every batch joined its clicks and wrote a chunk; the watermark
    (the impressions' time, or none) stood still and none retired, while the waiting cap gave the clicks up. Measured
    through this driver before the fix: 60 batches, 60 live chunks of 60 written, linear for as long as the stall
    lasts, every one read by each restore. Now the live chunks are compacted into one holding the whole live state once
    they outweigh twice it (plus ``COMPACT_SLACK``, 1,000 by default, 30 here so a short run shows it), and a restore
    from the log rebuilds the same state."""
    monkeypatch.setattr(engine_module, "COMPACT_SLACK", 30)
    producer = AckedProducer(kafka)
    p = make(watermark_quorum=16, allowed_lateness_s=5.0, attribution_window_s=1800.0, batch_within_s=0.05,
             max_waiting_per_partition=20)
    for r in [imp(kafka, 0, i, f"imp-{i}", T0 + i * 1000) for i in range(impressions)]:
        producer.send(r.topic, r.value, r.key, partition=r.partition)
    producer.flush()
    w = KafkaJoinWorker(p, kafka, p.js)
    w.consumer.subscribe([kafka.impressions_topic, kafka.clicks_topic], on_assign=w._on_assign,
                         on_revoke=w._on_revoke)
    most = 0
    try:
        for batch in range(60):
            for n in range(5):
                r = click(kafka, 0, 5 * batch + n, f"orphan-{batch}-{n}", T0 + 600_000 + batch * 1000 + n)
                producer.send(r.topic, r.value, r.key, partition=r.partition)
            producer.flush()
            while 0 not in p.engines or p.engines[0].offsets[1] < 5 * batch + 4:  # the run loop's round, per batch
                records = _records(w._fetch(), w.gaps)
                if records or w._held:
                    assert w._process(records, w._holds_back if w._hold else None)
                w._apply_gate()
            most = max(most, len(p.engines[0]._chunks))  # live chunks
        assert w.pauses.paused == set() and p.held_counts == {}  # neither the gate nor the hold bounded it
        eng = p.engines[0]
    finally:
        w.consumer.close()  # (revokes the partitions: the engines go)
    # a chunk per batch; the waiting cap (20) gives up the newest clicks, down to 90% of it, batch after batch
    assert eng.newest_seq - FENCE_SPAN >= 59 and len(eng.waiting) == 18
    assert eng.watermark == (None if impressions < 16 else T0 + 24_000 - 5_000 - 1)
    assert most <= 20, most  # 18 and 9 in the runs of 2026-12-07 (60 both before the fix)
    p.producer.flush()
    assert len(live_keys(kafka, state_topic(p.js.app_id))) <= 1 + 20  # the claim and the live chunks
    again = make(watermark_quorum=16, allowed_lateness_s=5.0, attribution_window_s=1800.0, max_waiting_per_partition=20)
    again.restore({0})
    back = again.engines[0]
    assert back.waiting == eng.waiting and set(back.pending) == set(eng.pending) and back.offsets == eng.offsets
    assert back.topic_max == eng.topic_max and back.max_ts == eng.max_ts


def test_a_held_impression_over_a_state_limit_lowered_since_it_came_leaves_the_chunks_uncompacted(
        kafka: KafkaSettings, make, monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot (``PartitionJoin._compact``) writes every held impression again. One that came under the state
    topic's limit of then and is over it now (lowered since) was taken for this batch's own record to dead-letter:
    none was in the batch (StopIteration), and the batch failed at every try, each of its innocent records struck.
    Now the batch is joined again without a snapshot, its chunk as before compaction, and the impression stays held."""
    ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic], partitions=2)
    make().process([imp(kafka, 0, 0, "big", T0, tags=[f"t{i}" for i in range(1000)])])
    monkeypatch.setattr(engine_module, "COMPACT_SLACK", -1000)  # every batch's chunk would be a snapshot
    again = make()
    again.state_bytes = 8000  # "big"'s state alone is over it (9,892 bytes)
    again.process([click(kafka, 0, 0, "other", T0 + 5)])
    eng = again.engines[0]
    assert set(eng.pending) == {"big"} and eng.waiting == {"other": [T0 + 5]} and len(eng._live) == 2
    back = make()
    back.restore({0})
    assert set(back.engines[0].pending) == {"big"} and back.engines[0].waiting == eng.waiting


def batch_by_batch(kafka: KafkaSettings) -> Callable[[list[str]], None]:
    """A writer of impressions (ids, times from T0) to partition 0, each its own record batch: the local broker's high
    watermark is then the true end (the made-again tests' committed offsets sit within one batch of it)."""
    producer = AckedProducer(kafka)

    def write(ids: list[str]) -> None:
        for i, imp_id in enumerate(ids):
            r = imp(kafka, 0, i, imp_id, T0 + i)
            producer.send(r.topic, r.value, r.key, partition=r.partition)
            producer.flush()

    return write


def test_an_impressions_topic_made_again_with_fewer_records_than_the_groups_committed_offset_is_joined_from_its_first(
        kafka: KafkaSettings, make) -> None:
    """The group committed offset 6 of the impressions' partition 0; the topic deleted, made again and written 3
    records (each its own record batch): the kafka driver started at the broker's high watermark - 1 and dropped every
    record below the old committed offset as already processed (``_remember_done``), so no new impression was joined,
    in silence (the committed offset only 3 past the end: within one record batch, no warning). Now the assignment
    compares the topics' ids with those the partition's committed offsets are of and reads a new topic from its
    first record."""
    write = batch_by_batch(kafka)

    make()  # creates the topics
    write([f"old-{i}" for i in range(6)])
    first = make(exit_when_idle_s=1.0)
    assert KafkaJoinWorker(first, kafka, first.js).run() == 0
    assert first.totals.counts["impressions"] == 6 and first._committed([0])[(kafka.impressions_topic, 0)] == 6
    make_again(kafka, kafka.impressions_topic, partitions=4)  # as many as the clicks (the fixture's topics)
    new = [f"new-{i}" for i in range(3)]
    write(new)
    # the broker drops a deleted topic's committed offsets, but a member still running then commits its old position
    # again (as a worker stopped after the deletion does at its exit): the group's offset 6 is of the old topic
    committer = Consumer(consumer_config(kafka, first.js.app_id))
    try:
        committer.commit(offsets=[TopicPartition(kafka.impressions_topic, 0, 6)], asynchronous=False)
    finally:
        committer.close()
    again = make(exit_when_idle_s=1.0)
    assert KafkaJoinWorker(again, kafka, again.js).run() == 0
    assert again.totals.counts["impressions"] == 3  # every new one joined


def test_the_faust_driver_joins_an_impressions_topic_made_again_under_the_groups_committed_offset_from_its_first(
        kafka: KafkaSettings, stack, make, prefix: str) -> None:
    """The faust driver's variant of the test above. The group's committed offset 6 is the old topic's, the new one
    has 3 records: faust's consumer moved the start back to the broker's high watermark - 1
    (``BatchConsumer._resume_safely``) and left out every record below the old offset as processed (``_redone``), so
    no batch came, the restore that tells the topic was made again never ran, and no new impression was joined, in
    silence. Now a fetch whose every record was left out is delivered (empty) for the restore to run, and an input
    it finds made again is committed at its first offset and read from there. The old topic's state is written by a
    pipeline outside any group: a member of the kafka driver's would leave the group a protocol faust cannot join,
    and one of faust's a membership the stale commit from outside is refused under."""
    _faust_joins_an_impressions_topic_made_again(kafka, stack, make, prefix, n_old=6, n_new=3)


def test_the_faust_driver_joins_an_impressions_topic_made_again_with_records_past_the_groups_committed_offset(
        kafka: KafkaSettings, stack, make, prefix: str) -> None:
    """As above, the new topic holding more records (5) than the group's committed offset (2, the old topic's): the
    batch brought 2-4, the restore found the topic made again and the consumer committed 0 and sought there, but the
    drop of the hand that followed sought the partition back to the batch's first offset (2: faust takes a committed 0
    for none), so records 0 and 1 of the new topic were never joined, under a WARNING that said they were."""
    _faust_joins_an_impressions_topic_made_again(kafka, stack, make, prefix, n_old=2, n_new=5)


def _faust_joins_an_impressions_topic_made_again(kafka: KafkaSettings, stack, make, prefix: str,  # noqa: ANN001
                                                 n_old: int, n_new: int) -> None:
    """The old topic's ``n_old`` impressions joined by a pipeline outside any group and committed, the topic made again
    with ``n_new``: a faust worker joins every new one, saying once that it reads the topic from its first record."""
    write = batch_by_batch(kafka)

    first = make()  # creates the topics
    old = [f"old-{i}" for i in range(n_old)]
    write(old)
    first.process([imp(kafka, 0, i, imp_id, T0 + i) for i, imp_id in enumerate(old)])  # state of the old topic's id
    make_again(kafka, kafka.impressions_topic, partitions=4)
    write([f"new-{i}" for i in range(n_new)])
    committer = Consumer(consumer_config(kafka, first.js.app_id))  # (no member: the group never had one)
    try:
        committer.commit(offsets=[TopicPartition(kafka.impressions_topic, 0, n_old)], asynchronous=False)
    finally:
        committer.close()
    again = subprocess.run(join_cmd(first.js.app_id, "faust", idle_s=1.0, window_s=WINDOW_MS / 1000),
                           capture_output=True, text=True, env=join_env(kafka, stack.redis_url, prefix), timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["impressions"] == n_new, again.stderr[-3000:]
    assert again.stderr.count("was deleted and created again: reading it from its first record") == 1


def test_a_new_impressions_topic_partly_joined_before_a_crash_is_read_on_from_its_state_not_the_old_committed_offset(
        kafka: KafkaSettings, make) -> None:
    """The group's committed offset 6 is the old impressions topic's; the topic made again and written 10 records. A
    worker read the new topic from its first record, joined records 0-4 (their state chunk, of the new topic id, is
    durable) and stopped before its commit (a crash, or an infrastructure failure rewinding it). The restart started
    at the old topic's offset 6, the state's topic id now the topic's: no start over, and record 5 was never joined,
    in silence. Now the start over commits the new topic's beginning for the group before its batch is joined."""
    write = batch_by_batch(kafka)

    make()  # creates the topics
    write([f"old-{i}" for i in range(6)])
    first = make(exit_when_idle_s=1.0)
    assert KafkaJoinWorker(first, kafka, first.js).run() == 0
    make_again(kafka, kafka.impressions_topic, partitions=4)
    new = [f"new-{i}" for i in range(10)]
    write(new)

    def stale_commit() -> None:  # a member still running commits its position of the old topic after the deletion
        committer = Consumer(consumer_config(kafka, first.js.app_id))
        try:
            committer.commit(offsets=[TopicPartition(kafka.impressions_topic, 0, 6)], asynchronous=False)
        finally:
            committer.close()

    stale_commit()
    crashed = make(exit_when_idle_s=1.0, batch_max=5)
    worker = KafkaJoinWorker(crashed, kafka, crashed.js)

    def crash() -> None:  # the process dies after the batch's state is durable, before its offsets are committed
        raise RuntimeError("killed before the commit")

    worker._commit = crash  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="killed before the commit"):
        worker.run()
    assert crashed.totals.counts["impressions"] == 5  # records 0-4 joined and durable, not committed
    again = make(exit_when_idle_s=1.0)
    assert KafkaJoinWorker(again, kafka, again.js).run() == 0
    assert again.totals.counts["impressions"] == 5  # records 5-9: none lost between the state and the old offset


def test_an_input_made_again_whose_restore_failed_and_whose_partition_was_revoked_is_not_started_over_by_this_member(
        kafka: KafkaSettings, make) -> None:
    """A restore found the impressions of partition 0 made again (``started_over``), and its flush failed (the broker
    away: the worker rewinds); a rebalance then revoked partition 0 and its new owner committed offset 2. The next
    batch of this member started the revoked partition over all the same: it committed the new topic's first offset
    over the new owner's and sought a partition it no longer has (a KafkaException: one more rewind). Now a revoked
    partition's start over goes with the rest of its in-memory state (``JoinPipeline.forget``)."""
    producer = AckedProducer(kafka)
    make()  # creates the topics
    for i in range(3):
        r = imp(kafka, 0, i, f"old-{i}", T0 + i)
        producer.send(r.topic, r.value, r.key, partition=r.partition)
    producer.flush()
    first = make(exit_when_idle_s=1.0)
    assert KafkaJoinWorker(first, kafka, first.js).run() == 0
    make_again(kafka, kafka.impressions_topic, partitions=4)
    r = imp(kafka, 0, 0, "new-0", T0)
    producer.send(r.topic, r.value, r.key, partition=r.partition)
    producer.flush()
    p = make()
    worker = KafkaJoinWorker(p, kafka, p.js)
    flush = p.producer.flush

    def away() -> None:
        p.producer.flush = flush  # type: ignore[method-assign]
        raise KafkaException(KafkaError(KafkaError._TRANSPORT))

    p.producer.flush = away  # type: ignore[method-assign]
    with pytest.raises(KafkaException):
        p.restore({0})
    assert p.started_over == {(kafka.impressions_topic, 0)}
    tps = [TopicPartition(t, 0) for t in (kafka.impressions_topic, kafka.clicks_topic)]
    worker._on_revoke(worker.consumer, tps)
    owner = Consumer(consumer_config(kafka, p.js.app_id))  # the partition's new owner commits what it processed
    try:
        owner.commit(offsets=[TopicPartition(kafka.impressions_topic, 0, 2)], asynchronous=False)
    finally:
        owner.close()
    worker._started_over([])
    assert p._committed([0])[(kafka.impressions_topic, 0)] == 2
    worker.consumer.close()




@pytest.mark.parametrize(("n_old", "n_new"), [(6, 3), (2, 5)], ids=["fewer_new", "more_new"])
def test_the_faust_driver_joins_an_impressions_topic_made_again_while_it_runs_from_its_first_record(
        kafka: KafkaSettings, stack, make, prefix: str, n_old: int, n_new: int) -> None:
    """The impressions topic deleted and made again under a running faust worker (its engines in memory: no restore,
    no topic-id check), ``n_new`` records written to it: faust's consumer kept its position of the old topic
    (``n_old``), and a fetch past a partition's end brings nothing on the local broker (no out-of-range reset), so the
    new topic's records below it never came (3 of 3 lost) and those past it were joined without them (2 of 5 lost),
    in silence: nothing logged, the worker exiting idle with status 0. Now the running worker asks the inputs' ids
    every ``topic_check_s`` and reads an input made again from its first record, as a restore does. (The kafka
    driver's consumer, librdkafka 2.16.0, dies of a segfault in its metadata cache when the topic comes back: its
    restart's restore starts the topic over.)"""
    write = batch_by_batch(kafka)
    first = make()  # creates the topics
    write([f"old-{i}" for i in range(n_old)])
    env = {**join_env(kafka, stack.redis_url, prefix), "STREAMREC_JOINER_TOPIC_CHECK_S": "1"}
    proc = subprocess.Popen(join_cmd(first.js.app_id, "faust", idle_s=8.0), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        tp = TopicPartition(kafka.impressions_topic, 0)
        asker = Consumer(consumer_config(kafka, first.js.app_id))
        try:
            while asker.committed([tp], timeout=10)[0].offset < n_old:  # the old topic joined and committed
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                time.sleep(0.2)
        finally:
            asker.close()
        make_again(kafka, kafka.impressions_topic, partitions=4)  # as many as the clicks (the fixture's topics)
        write([f"new-{i}" for i in range(n_new)])
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["impressions"] == n_old + n_new, err[-3000:]
    # every partition of it was made again: each said once
    assert err.count(f"{kafka.impressions_topic} partition 0 was deleted and created again") == 1, err[-3000:]



def test_the_kafka_driver_reads_an_input_its_periodic_check_finds_made_again_from_its_first_record(
        kafka: KafkaSettings, make, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The kafka driver's side of the running check (``topic_check_s``): its consumer (librdkafka 2.16.0) dies of a
    segfault in its metadata cache when a topic it reads is deleted and made again on the local broker, so the broker
    is made to name another id for the impressions topic instead, once its records were joined: the check between
    batches starts the partition over (its first offset committed, sought there), and the records read again are
    skipped as the duplicates they are. Before, nothing asked the ids while the worker ran."""
    write = batch_by_batch(kafka)
    make()  # creates the topics
    write([f"old-{i}" for i in range(6)])
    p = make(exit_when_idle_s=2.0, topic_check_s=0.5)
    worker = KafkaJoinWorker(p, kafka, p.js)
    asked = pipeline_module.topic_identities
    process_new = p.process_new

    def then_another_id(records: list[Any], behind: Any = None) -> None:
        process_new(records, behind)
        if p.totals.counts["impressions"] == 6:  # joined: the broker names another id from now on
            def another(*args: Any) -> dict[str, dict[str, str]]:
                ids = asked(*args)
                ids[kafka.impressions_topic]["topic_id"] = "made-again"
                return ids

            monkeypatch.setattr(pipeline_module, "topic_identities", another)

    p.process_new = then_another_id  # type: ignore[method-assign]
    assert worker.run() == 0
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and "now has topic id made-again" in
            r.getMessage()]
    assert len(said) == 4 and said[0].startswith("partition 0:")  # every partition held, each said once
    assert p.totals.counts["duplicate_impressions"] == 6  # read again from its first record, none joined twice
    assert p._committed([0])[(kafka.impressions_topic, 0)] == 6


def test_records_below_what_a_running_partition_applied_of_an_input_made_again_start_it_over(
        kafka: KafkaSettings, make) -> None:
    """A broker that resets a fetch past a partition's end to its first offset (Apache Kafka's out-of-range reset,
    librdkafka's and aiokafka's ``auto.offset.reset``) hands a running worker the records of an input made again below
    what its engine in memory applied: skipped as redelivered, in silence (no restore, no topic-id check). Now records
    at or below an engine's applied offset (``below_applied``) have the topics' ids asked (``regressed``): an input
    whose id changed is started over as a restore does, and the same replay is not asked about twice."""
    write = batch_by_batch(kafka)
    p = make()
    write([f"old-{i}" for i in range(6)])
    p.process([imp(kafka, 0, i, f"old-{i}", T0 + i) for i in range(6)])
    assert p.engines[0].offsets[0] == 5
    make_again(kafka, kafka.impressions_topic, partitions=4)
    write([f"new-{i}" for i in range(3)])
    new = [imp(kafka, 0, i, f"new-{i}", T0 + 10 + i) for i in range(3)]  # what the reset fetch hands on
    below = p.below_applied(new)
    assert below == {(kafka.impressions_topic, 0)}
    p.regressed(below)
    assert p.take_started_over() == {(kafka.impressions_topic, 0)}  # the driver commits its first offset, reads it
    eng = p.engines[0]
    assert eng.offsets[0] == -1 and eng.topic_ids[0] == topic_identity(kafka, kafka.impressions_topic)["topic_id"]
    p.process(new)
    assert p.totals.counts["impressions"] == 9  # every new one joined
    asked = []
    topic_identities = pipeline_module.topic_identities
    pipeline_module.topic_identities = lambda *a: asked.append(a) or topic_identities(*a)  # type: ignore[assignment]
    try:
        p.regressed(p.below_applied(new))  # the new topic read again: asked once, not started over
        p.regressed(p.below_applied(new))  # the same replay: not asked again
    finally:
        pipeline_module.topic_identities = topic_identities
    assert len(asked) == 1 and p.take_started_over() == set()



@pytest.mark.parametrize("driver", ["kafka", "faust"])
def test_a_drain_at_exit_that_finds_an_input_made_again_commits_its_first_offset_before_the_new_id_is_written(
        kafka: KafkaSettings, stack, make, prefix: str, driver: str) -> None:
    """The impressions topic made again (empty) under the group's committed offset 6, the old topic's, and a run with
    ``--drain`` that read nothing: its drain restored the partition, found the topic made again and started it over,
    and its chunks recorded the new topic's id, but nothing committed the new topic's first offset (the start over
    of a batch never came). The next run's restore found the state's id the topic's (no start over) and read on from
    the old offset 6: the new topic's records 0-5 were never joined, in silence (2 of 8). Now the drain's restore
    commits an input it finds made again at its first offset before anything is written, in both drivers."""
    write = batch_by_batch(kafka)
    first = make()  # creates the topics
    old = [f"old-{i}" for i in range(6)]
    write(old)
    first.process([imp(kafka, 0, i, imp_id, T0 + i) for i, imp_id in enumerate(old)])  # pending, of the old id
    make_again(kafka, kafka.impressions_topic, partitions=4)
    committer = Consumer(consumer_config(kafka, first.js.app_id))  # a member still running commits its old position
    try:
        committer.commit(offsets=[TopicPartition(kafka.impressions_topic, 0, 6)], asynchronous=False)
    finally:
        committer.close()
    env = join_env(kafka, stack.redis_url, prefix)

    def run() -> dict[str, Any]:
        done = subprocess.run(join_cmd(first.js.app_id, driver, idle_s=1.0, window_s=WINDOW_MS / 1000),
                              capture_output=True, text=True, env=env, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    assert run()["samples"] == 6  # nothing read: the old impressions drained
    write([f"new-{i}" for i in range(8)])
    assert run()["impressions"] == 8  # every new one joined
