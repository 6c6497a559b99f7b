"""``learner/kafka_dataset.py`` (KafkaSampleDataset) against the real broker of the session stack.

What its docstring promises, message by message: every samples message is yielded once, with its
``(partition, offset, rows)``, in offset order per partition, never split, joined into batches of about
``batch_rows`` rows; the explicit start offsets are where reading begins (a resume) and only their
partitions are read; DataLoader workers split the partitions; a message that cannot be decoded or turned
into tensors goes to ``<samples>.dlq`` with its reason while its offset still counts as consumed; suspects
are yielded alone, or dead-lettered as ``poison`` when they carry a reason; an idle input yields zero-row
heartbeats and, with ``exit_when_idle_s``, ends the iteration.
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict

import numpy as np
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from torch.utils.data import DataLoader

import learner.kafka_dataset as kd
from learner.batch import TensorBatch
from learner.kafka_dataset import KafkaSampleDataset
from stream.config import KafkaSettings
from stream.dlq import DeadLetter
from stream.kafka import admin_config, producer_config
from stream.kafka_producer import AckedProducer
from stream.kafka_topics import ensure_topics
from stream.limits import EventLimits
from stream.samples import SampleBatch
from tests.integration.test_learner import CFG, sample_batch
from tests.kafka_io import produce_raw_header_key, read_topic

PARTITIONS = 3
IDLE_S = 1.0  # exit_when_idle_s of the bounded reads below


# -- helpers ---------------------------------------------------------------------------------------------
def produce(kafka: KafkaSettings, messages: list[tuple[int, bytes | None, bytes]]) -> dict[tuple[int, int], bytes]:
    """Send ``(partition, value, key)`` in order; returns ``{(partition, offset): key}`` (offsets count from 0)."""
    producer = AckedProducer(kafka)
    next_offset: dict[int, int] = defaultdict(int)
    where: dict[tuple[int, int], bytes] = {}
    for part, value, key in messages:
        producer.send(kafka.samples_topic, value, key, partition=part)
        where[(part, next_offset[part])] = key
        next_offset[part] += 1
    producer.flush()
    return where


def good(rng: np.random.Generator, n: int, tag: str) -> bytes:
    return sample_batch(rng, n, prefix=f"{tag}-").encode()


def read_all(ds: KafkaSampleDataset) -> list[TensorBatch]:
    """Iterate to the end (``exit_when_idle_s`` must be set); every batch, heartbeats included."""
    assert ds.exit_when_idle_s is not None
    return list(ds)


def data_batches(batches: list[TensorBatch]) -> list[TensorBatch]:
    """Without idle heartbeats (zero rows and no positions)."""
    return [b for b in batches if b.positions or len(b)]


def rows_by_position(batches: list[TensorBatch]) -> dict[tuple[int, int], list[str]]:
    """``{(partition, offset): impression ids}``: each batch's rows split by its positions, in order."""
    out: dict[tuple[int, int], list[str]] = {}
    for b in batches:
        assert len(b) == sum(rows for _, _, rows in b.positions), b.positions
        ids = b.impression_ids.tolist()
        at = 0
        for part, off, rows in b.positions:
            assert (part, off) not in out, f"{(part, off)} yielded twice"
            out[(part, off)] = ids[at:at + rows]
            at += rows
    return out


def positions(batches: list[TensorBatch]) -> list[tuple[int, int, int]]:
    return [p for b in batches for p in b.positions]


@pytest.fixture
def topic(kafka: KafkaSettings) -> KafkaSettings:
    ensure_topics(kafka, [kafka.samples_topic], partitions=PARTITIONS)
    return kafka


# -- tests ---------------------------------------------------------------------------------------------------
def test_every_message_is_yielded_once_whole_with_its_position_in_offset_order(topic: KafkaSettings) -> None:
    rng = np.random.default_rng(1)
    sizes = {0: [30, 5, 40, 12], 1: [7, 60], 2: [25, 25, 25, 1, 9]}
    sent = [(p, good(rng, n, f"p{p}o{k}"), f"p{p}o{k}".encode()) for p, ns in sizes.items() for k, n in enumerate(ns)]
    produce(topic, sent)
    batch_rows = 50
    out = data_batches(read_all(KafkaSampleDataset(topic, CFG, {p: 0 for p in sizes}, batch_rows=batch_rows,
                                                   exit_when_idle_s=IDLE_S)))

    got = rows_by_position(out)
    want = {(p, k): [f"p{p}o{k}-{i}" for i in range(n)] for p, ns in sizes.items() for k, n in enumerate(ns)}
    assert got == want  # every message, exactly once, whole, with its own partition and offset
    for p in sizes:
        offs = [o for part, o, _ in positions(out) if part == p]
        assert offs == sorted(offs) == list(range(len(sizes[p])))  # offset order within a partition
    biggest = max(n for ns in sizes.values() for n in ns)
    # about batch_rows: a batch closes once it reaches batch_rows, and a message is never split across two
    assert all(len(b) < batch_rows + biggest for b in out)
    assert any(len(b.positions) > 1 for b in out)  # small messages are joined into one training batch
    assert all(b.offsets.shape[0] == CFG.num_fields * len(b) + 1 for b in out)  # field-major bags, every row


def test_start_offsets_are_where_reading_resumes_and_only_their_partitions_are_read(topic: KafkaSettings) -> None:
    rng = np.random.default_rng(2)
    produce(topic, [(p, good(rng, 4, f"p{p}o{k}"), b"k") for p in range(PARTITIONS) for k in range(4)])
    start = {0: 2, 2: 3}  # partition 1 is not ours: not read at all
    out = data_batches(read_all(KafkaSampleDataset(topic, CFG, start, batch_rows=8, exit_when_idle_s=IDLE_S)))
    assert sorted((p, o) for p, o, _ in positions(out)) == [(0, 2), (0, 3), (2, 3)]
    assert rows_by_position(out)[(0, 2)] == [f"p0o2-{i}" for i in range(4)]
    # a resume at the end reads nothing, and still ends when idle
    assert data_batches(read_all(KafkaSampleDataset(topic, CFG, {0: 4}, exit_when_idle_s=IDLE_S))) == []


def test_dataloader_workers_split_the_partitions_so_each_message_comes_once(topic: KafkaSettings) -> None:
    rng = np.random.default_rng(3)
    produce(topic, [(p, good(rng, 3, f"p{p}o{k}"), b"k") for p in range(PARTITIONS) for k in range(3)])
    ds = KafkaSampleDataset(topic, CFG, {p: 0 for p in range(PARTITIONS)}, batch_rows=4, exit_when_idle_s=IDLE_S)
    # An AckedProducer is a reference cycle (on_delivery=self._on_error): the ones dropped above (and by earlier
    # tests' datasets) wait for the cyclic GC. Collected in a forked worker, librdkafka's destroy joins a thread
    # the fork did not copy and the worker hangs or segfaults; collect them here, before the workers fork.
    gc.collect()
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=False, timeout=60)
    out = data_batches(list(loader))  # iterated to its end: the worker processes exit
    # without the p % n == w split each of the two workers would read every partition: every message twice
    assert sorted((p, o) for p, o, _ in positions(out)) == [(p, o) for p in range(PARTITIONS) for o in range(3)]
    assert sorted(i for b in out for i in b.impression_ids.tolist()) == sorted(
        f"p{p}o{k}-{i}" for p in range(PARTITIONS) for k in range(3) for i in range(3))


def test_a_worker_without_partitions_yields_nothing(topic: KafkaSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    class Info:  # worker 1 of 4 with partitions {0, 2}: none is ours (0 % 4 == 0, 2 % 4 == 2)
        id, num_workers = 1, 4

    monkeypatch.setattr(kd, "get_worker_info", lambda: Info)
    ds = KafkaSampleDataset(topic, CFG, {0: 0, 2: 0}, exit_when_idle_s=IDLE_S)
    t0 = time.monotonic()
    # returns at once, no consumer, no idle wait: no batch, only the last heartbeat that says its reading ended
    # (learner/worker_stall.py: a worker that stopped reading is no hung one)
    assert [(len(b), b.positions, b.worker, b.worker_done) for b in ds] == [(0, [], 1, True)]
    assert time.monotonic() - t0 < IDLE_S
    Info.id = 2  # worker 2 of 4 owns partition 2 only
    assert ds._my_partitions() == [2]


def test_malformed_messages_are_dead_lettered_with_reasons_and_the_next_ones_still_come(
        topic: KafkaSettings) -> None:
    rng = np.random.default_rng(4)
    truncated = good(rng, 5, "cut")[:-40]
    sent = [
        (0, good(rng, 4, "a"), b"a"),                 # offset 0
        (0, b"\x00\x01garbage" * 10, b"garbage"),     # offset 1: not Arrow
        (0, None, b"tombstone"),                      # offset 2: no value
        (0, good(rng, 4, "b"), b"b"),                 # offset 3
        (1, truncated, b"truncated"),                 # partition 1, offset 0
        (1, good(rng, 4, "c"), b"c"),                 # partition 1, offset 1
    ]
    produce(topic, sent)
    out = data_batches(read_all(KafkaSampleDataset(topic, CFG, {0: 0, 1: 0}, batch_rows=100,
                                                   exit_when_idle_s=IDLE_S)))

    # the bad ones count as consumed (a zero-row position the checkpoint records), the good ones all come
    assert sorted(positions(out)) == [(0, 0, 4), (0, 1, 0), (0, 2, 0), (0, 3, 4), (1, 0, 0), (1, 1, 4)]
    assert sorted(i for b in out for i in b.impression_ids.tolist()) == sorted(
        f"{t}-{i}" for t in "abc" for i in range(4))
    dlq = read_topic(topic, topic.dlq_topic(topic.samples_topic))
    letters = {r.key: (r.value, DeadLetter.from_headers(r.headers)) for r in dlq}
    assert len(dlq) == 3 and set(letters) == {b"garbage", b"tombstone", b"truncated"}  # each once
    value, dl = letters[b"garbage"]
    assert value == b"\x00\x01garbage" * 10  # the original bytes, untouched: fix and replay
    assert (dl.kind, dl.source_topic, dl.source_partition, dl.source_offset) == (
        "bad_arrow", topic.samples_topic, 0, 1)
    assert "not an Arrow IPC stream" in dl.reason
    value, dl = letters[b"tombstone"]
    assert (value, dl.kind, dl.reason, dl.source_offset) == (None, "empty", "empty samples message", 2)
    value, dl = letters[b"truncated"]
    assert (value, dl.kind, dl.source_partition, dl.source_offset) == (truncated, "bad_arrow", 1, 0)


def test_any_exception_turning_a_message_into_tensors_dead_letters_it_as_undecodable(
        topic: KafkaSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    real = kd.to_tensors

    def to_tensors(sb: SampleBatch, cfg, positions):  # noqa: ANN001 - the module's own signature
        if sb.impression_ids[0].startswith("boom"):
            raise RuntimeError("index 99 is out of bounds")
        return real(sb, cfg, positions)

    monkeypatch.setattr(kd, "to_tensors", to_tensors)
    produce(topic, [(0, good(rng, 2, "ok1"), b"1"), (0, good(rng, 2, "boom"), b"boom"), (0, good(rng, 2, "ok2"), b"2")])
    out = data_batches(read_all(KafkaSampleDataset(topic, CFG, {0: 0}, exit_when_idle_s=IDLE_S)))
    assert sorted(positions(out)) == [(0, 0, 2), (0, 1, 0), (0, 2, 2)]
    [rec] = read_topic(topic, topic.dlq_topic(topic.samples_topic))
    dl = DeadLetter.from_headers(rec.headers)
    assert (rec.key, dl.kind, dl.source_offset) == (b"boom", "undecodable", 1)
    assert dl.reason == "cannot be turned into tensors: RuntimeError: index 99 is out of bounds"


def test_suspects_are_yielded_alone_and_a_poisoned_one_is_dead_lettered(topic: KafkaSettings) -> None:
    rng = np.random.default_rng(6)
    produce(topic, [(0, good(rng, 3, f"o{k}"), f"o{k}".encode()) for k in range(6)])
    suspects = {(0, 2): None, (0, 4): "injected fault: training failed twice"}
    out = data_batches(read_all(KafkaSampleDataset(topic, CFG, {0: 0}, batch_rows=1000, exit_when_idle_s=IDLE_S,
                                                   suspects=suspects)))
    alone = [b for b in out if (0, 2, 3) in b.positions]
    assert len(alone) == 1 and alone[0].positions == [(0, 2, 3)]  # its own batch: only it is blamed next time
    assert alone[0].impression_ids.tolist() == ["o2-0", "o2-1", "o2-2"]
    # the poisoned one is never trained: a zero-row position, and its bytes in the DLQ with the strike's reason
    assert sorted(positions(out)) == [(0, 0, 3), (0, 1, 3), (0, 2, 3), (0, 3, 3), (0, 4, 0), (0, 5, 3)]
    assert not any(i.startswith("o4-") for b in out for i in b.impression_ids.tolist())
    [rec] = read_topic(topic, topic.dlq_topic(topic.samples_topic))
    dl = DeadLetter.from_headers(rec.headers)
    assert (rec.key, dl.kind, dl.reason, dl.source_offset) == (b"o4", "poison", suspects[(0, 4)], 4)
    assert SampleBatch.decode(rec.value).impression_ids == ["o4-0", "o4-1", "o4-2"]  # untouched, replayable


def test_a_dead_lettered_samples_message_keeps_its_watermark_header(topic: KafkaSettings) -> None:
    """A poisoned samples message (the joiner's, with its ``streamrec-watermark`` header and a tracing header) went to
    ``samples.dlq`` without them: replayed after a fix, its partition's watermark was lost. Both are kept now."""
    from stream.samples import watermark_header

    rng = np.random.default_rng(7)
    original = [watermark_header(1_700_000_000_000), ("trace-id", b"t-9")]
    producer = AckedProducer(topic)
    producer.send(topic.samples_topic, good(rng, 2, "p"), b"p", original, partition=0)
    producer.flush()
    data_batches(read_all(KafkaSampleDataset(topic, CFG, {0: 0}, exit_when_idle_s=IDLE_S,
                                             suspects={(0, 0): "injected fault: training failed twice"})))
    [rec] = read_topic(topic, topic.dlq_topic(topic.samples_topic))
    dl = DeadLetter.from_headers(rec.headers)
    assert (rec.key, dl.kind, dl.original_headers) == (b"p", "poison", tuple(original))


def test_a_header_key_that_is_not_utf8_dead_letters_its_message_and_the_next_ones_still_come(
        topic: KafkaSettings) -> None:
    """Another producer's header key that is not UTF-8 (Kafka keys are bytes on the wire): confluent-kafka's
    ``Message.headers()`` raises SystemError for it, which the reader met twice, reading the watermark and then again
    while dead-lettering the message, and the second ended the learner (and every restart, at the same offset)."""
    rng = np.random.default_rng(8)
    produce(topic, [(0, good(rng, 2, "a"), b"a")])
    produce_raw_header_key(topic, topic.samples_topic, 0, b"hostile", good(rng, 2, "h"), b"\xff\xfewm")
    produce(topic, [(0, good(rng, 2, "b"), b"b")])
    out = data_batches(read_all(KafkaSampleDataset(topic, CFG, {0: 0}, exit_when_idle_s=IDLE_S)))
    assert sorted(positions(out)) == [(0, 0, 2), (0, 1, 0), (0, 2, 2)]  # consumed once, not trained
    assert sorted(i for b in out for i in b.impression_ids.tolist()) == ["a-0", "a-1", "b-0", "b-1"]
    [rec] = read_topic(topic, topic.dlq_topic(topic.samples_topic))
    dl = DeadLetter.from_headers(rec.headers)
    assert (rec.key, dl.kind, dl.source_offset) == (b"hostile", "bad_header", 1)
    assert "not UTF-8" in dl.reason
    assert SampleBatch.decode(rec.value).impression_ids == ["h-0", "h-1"]  # the value untouched, replayable


def test_an_idle_input_yields_empty_heartbeats_and_ends_after_exit_when_idle_s(topic: KafkaSettings) -> None:
    idle_s = 2.6
    t0 = time.monotonic()
    out = list(KafkaSampleDataset(topic, CFG, {0: 0, 1: 0}, exit_when_idle_s=idle_s))
    took = time.monotonic() - t0
    # about one heartbeat a second (at ~1 s and ~2 s), so a stop signal is seen on time even without data
    assert 1 <= len(out) <= 3, len(out)
    assert all(len(b) == 0 and b.positions == [] for b in out)
    assert idle_s <= took < idle_s + 10


def test_the_last_rows_are_yielded_at_once_when_the_input_pauses_then_the_iteration_ends(
        topic: KafkaSettings) -> None:
    rng = np.random.default_rng(7)
    produce(topic, [(0, good(rng, 5, "only"), b"k")])
    it = iter(KafkaSampleDataset(topic, CFG, {0: 0}, batch_rows=10_000, exit_when_idle_s=IDLE_S))
    try:
        t0 = time.monotonic()
        first = next(it)
        # far below batch_rows, yet not held back until more data comes: nothing more right now, train it
        assert first.positions == [(0, 0, 5)] and time.monotonic() - t0 < IDLE_S + 10
        rest = data_batches(list(it))
        assert rest == []  # and with nothing more, the iteration ends (exit_when_idle_s)
    finally:
        it.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("merge", [True, False])
def test_a_backlog_of_several_partitions_is_handed_on_in_event_time_order(topic: KafkaSettings, merge: bool) -> None:
    # Each partition holds every third block of event time, produced a partition at a time (a backlog):
    # fetched, they come a partition's chunk at a time; merged, oldest first across partitions.
    rng = np.random.default_rng(7)
    blocks = 30
    sent = [(b % PARTITIONS, sample_batch(rng, 10, start=1000 * b, prefix=f"b{b}-").encode(), f"b{b}".encode())
            for p in range(PARTITIONS) for b in range(blocks) if b % PARTITIONS == p]
    produce(topic, sent)
    ds = KafkaSampleDataset(topic, CFG, {p: 0 for p in range(PARTITIONS)}, batch_rows=1, exit_when_idle_s=IDLE_S,
                            merge=merge)
    firsts = [int(b.ts[0]) for b in data_batches(read_all(ds)) if len(b)]
    assert sorted(firsts) == [1000 * b for b in range(blocks)]  # every message once, merged or not
    assert (firsts == sorted(firsts)) is merge


def test_a_saved_start_past_the_end_of_a_topic_made_again_reads_the_new_topic_from_its_first_record(
        kafka: KafkaSettings, caplog: pytest.LogCaptureFixture) -> None:
    """The samples topic deleted and created again since the checkpoint (its offsets start over): the broker (Tansu)
    answered the fetch at the saved offset 5 with nothing, no error, so the learner waited there in silence and the
    new topic's offsets 0-4 were never trained."""
    ensure_topics(kafka, [kafka.samples_topic], partitions=1)
    rng = np.random.default_rng(8)
    produce(kafka, [(0, good(rng, 4, f"old{k}"), b"k") for k in range(5)])
    admin = AdminClient(admin_config(kafka))
    for fut in admin.delete_topics([kafka.samples_topic], operation_timeout=10).values():
        fut.result()
    deadline = time.monotonic() + 10
    while kafka.samples_topic in admin.list_topics(timeout=5).topics and time.monotonic() < deadline:
        time.sleep(0.1)
    ensure_topics(kafka, [kafka.samples_topic], partitions=1)
    produce(kafka, [(0, good(rng, 4, f"new{k}"), b"k") for k in range(3)])
    out = data_batches(read_all(KafkaSampleDataset(kafka, CFG, {0: 5}, batch_rows=8, exit_when_idle_s=IDLE_S)))
    assert rows_by_position(out) == {(0, k): [f"new{k}-{i}" for i in range(4)] for k in range(3)}
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and "offset 5" in r.getMessage()]
    assert len(said) == 1 and "partition 0" in said[0]


def test_a_record_over_librdkafkas_default_receive_limit_is_read_and_dead_lettered_not_stalled_on(
        kafka: KafkaSettings) -> None:
    """A record of 105 MB (a producer and topic with a raised message.max.bytes): the fetch response that held it was
    over librdkafka's default receive.message.max.bytes (100 MB), dropped and fetched again for ever, so the reader
    stalled at it (librdkafka's FAIL log line the only word) and the good message before it in the same response was
    never trained either."""
    ensure_topics(kafka, [kafka.samples_topic], partitions=1)
    rng = np.random.default_rng(9)
    producer = Producer(producer_config(kafka, **{"message.max.bytes": 200_000_000, "compression.type": "none"}))
    for value in (good(rng, 3, "before"), rng.bytes(105_000_000), good(rng, 3, "after")):
        producer.produce(kafka.samples_topic, value, b"k", partition=0)
    assert producer.flush(60) == 0
    out = data_batches(read_all(KafkaSampleDataset(kafka, CFG, {0: 0}, batch_rows=8, exit_when_idle_s=IDLE_S)))
    assert positions(out) == [(0, 0, 3), (0, 1, 0), (0, 2, 3)]
    [rec] = read_topic(kafka, kafka.dlq_topic(kafka.samples_topic))
    dl = DeadLetter.from_headers(rec.headers)
    assert (dl.source_offset, dl.value_truncated_from) == (1, 105_000_000)


def test_an_impression_id_over_max_str_len_dead_letters_its_message_and_the_rest_are_trained(
        topic: KafkaSettings) -> None:
    """Impression ids were bounded only by the 16 MiB message, while the learner keeps up to ``dedup_window`` of them
    (its duplicate filter, in every checkpoint): 1 MiB ids from another producer grew its memory by gigabytes. The
    joiner's ``[limits] max_str_len`` bounds them now, in characters as the joiner counts (an id of 256 two-byte
    characters is in), and a message with one id over it goes to ``samples.dlq`` as ``too_large``."""
    rng = np.random.default_rng(9)
    limits = EventLimits()
    at_bound = "é" * (limits.max_str_len - 1)  # + one digit: max_str_len characters, twice as many bytes
    produce(topic, [(0, good(rng, 2, "a"), b"a"), (0, sample_batch(rng, 2, prefix=at_bound).encode(), b"at"),
                    (0, sample_batch(rng, 2, prefix="x" * limits.max_str_len).encode(), b"long"),
                    (0, good(rng, 2, "b"), b"b")])
    out = data_batches(read_all(KafkaSampleDataset(topic, CFG, {0: 0}, exit_when_idle_s=IDLE_S)))
    assert sorted(positions(out)) == [(0, 0, 2), (0, 1, 2), (0, 2, 0), (0, 3, 2)]  # consumed once, not trained
    assert sorted(i for b in out for i in b.impression_ids.tolist()) == sorted(
        ["a-0", "a-1", f"{at_bound}0", f"{at_bound}1", "b-0", "b-1"])
    [rec] = read_topic(topic, topic.dlq_topic(topic.samples_topic))
    dl = DeadLetter.from_headers(rec.headers)
    assert (rec.key, dl.kind, dl.source_offset) == (b"long", "too_large", 2)
    assert dl.reason == (f"column 'impression_id': an id of {limits.max_str_len + 1} chars, over [limits] "
                         f"max_str_len={limits.max_str_len} (the joiner's bound on ids)")
    # the bound is the setting's: a learner given a larger [limits] max_str_len trains that message
    again = data_batches(read_all(KafkaSampleDataset(topic, CFG, {0: 2}, exit_when_idle_s=IDLE_S,
                                                     limits=EventLimits(max_str_len=limits.max_str_len + 1))))
    assert positions(again) == [(0, 2, 2), (0, 3, 2)]


def test_a_feature_column_named_over_max_key_len_dead_letters_its_message(topic: KafkaSettings) -> None:
    """A fresh learner names its fields after the first messages' ``ctx.`` / ``dense.`` columns and keeps the names in
    every checkpoint: another producer's 1 MiB column name would be there for good. The joiner's ``[limits]
    max_key_len`` (the event keys it names columns after) bounds them; a name at the bound is trained."""
    rng = np.random.default_rng(10)
    limits = EventLimits()

    def named(key: str, tag: str) -> bytes:
        return SampleBatch.from_columns(impression_id=[tag], ts=np.array([1]), label=np.array([0]),
                                        label_delay_ms=np.zeros(1), user_id=np.array([1]), item_id=np.array([2]),
                                        history=[[3]], context={"genres": [[4]], key: np.array([5])},
                                        dense={key: np.array([0.5])}).encode()

    produce(topic, [(0, named("k" * limits.max_key_len, "at"), b"at"), (0, named("k" * 2000, "long"), b"long"),
                    (0, good(rng, 2, "b"), b"b")])
    out = data_batches(read_all(KafkaSampleDataset(topic, CFG, {0: 0}, exit_when_idle_s=IDLE_S)))
    assert sorted(positions(out)) == [(0, 0, 1), (0, 1, 0), (0, 2, 2)]
    [rec] = read_topic(topic, topic.dlq_topic(topic.samples_topic))
    dl = DeadLetter.from_headers(rec.headers)
    assert (rec.key, dl.kind, dl.source_offset) == (b"long", "too_large", 1)
    assert f"a feature name of 2000 chars, over [limits] max_key_len={limits.max_key_len}" in dl.reason
