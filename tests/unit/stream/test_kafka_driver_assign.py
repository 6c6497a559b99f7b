"""The kafka driver's rebalance callback when the broker cannot give an assignment's start positions (its committed
offsets timed out, the coordinator away): asked again until it answers, inside the process, not an exception out of
librdkafka's callback that stopped the worker (exit 1) at every broker hiccup during a rebalance."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from stream.config import KafkaSettings
from stream.joiner import kafka_driver
from stream.joiner.config import JoinerSettings
from stream.joiner.kafka_driver import KafkaJoinWorker
from stream.joiner.metrics import ASSIGN_RETRIES
from tests.joiner_stubs import assigning_pipeline

PARTITIONS = [TopicPartition("impressions", 0), TopicPartition("clicks", 0)]


class Consumer:
    """What the callback does with librdkafka's consumer."""

    def __init__(self) -> None:
        self.assigned: list[tuple[str, int, int]] = []
        self.paused: list[tuple[str, int]] = []

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, 42) for tp in partitions]  # (what resume_offsets starts at)

    def assign(self, partitions: list[TopicPartition]) -> None:
        self.assigned = [(tp.topic, tp.partition, tp.offset) for tp in partitions]

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused = [(tp.topic, tp.partition) for tp in partitions]


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(kafka_driver, "RECOVERY_BACKOFF_S", (0.001, 0.004))
    w = KafkaJoinWorker(assigning_pipeline(), KafkaSettings(bootstrap_servers="127.0.0.1:9"), JoinerSettings())  # type: ignore[arg-type]
    yield w
    w.consumer.close()


def _timing_out(fail: int, worker: Any = None) -> Any:
    calls: list[int] = []

    def resume_offsets(consumer: Any, partitions: list[TopicPartition], reader: str) -> list[TopicPartition]:
        calls.append(1)
        if len(calls) <= fail:
            if worker is not None and len(calls) == fail:
                worker._stop = True  # SIGTERM while the broker is away
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "committed(): timed out"))
        return [TopicPartition(tp.topic, tp.partition, 42) for tp in partitions]

    return resume_offsets


def test_an_assignment_whose_start_positions_cannot_be_read_is_asked_again_until_the_broker_answers(
        worker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka_driver, "resume_offsets", _timing_out(3))
    before = ASSIGN_RETRIES._value.get()
    consumer = Consumer()
    worker._on_assign(consumer, PARTITIONS)
    assert consumer.assigned == [("impressions", 0, 42), ("clicks", 0, 42)] and not consumer.paused
    assert worker._assigned == {0}
    assert worker.assign_retries == 3 and ASSIGN_RETRIES._value.get() == before + 3


def test_a_worker_told_to_stop_while_the_broker_is_away_leaves_the_assignment_unread(
        worker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka_driver, "resume_offsets", _timing_out(2, worker))
    consumer = Consumer()
    worker._on_assign(consumer, PARTITIONS)  # returns: the run loop sees the stop
    assert consumer.paused == [("impressions", 0), ("clicks", 0)]  # nothing of it fetched, processed or committed
    assert worker._assigned == set()


def test_a_bug_in_the_assignment_is_not_retried(worker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(consumer: Any, partitions: list[TopicPartition], reader: str) -> list[TopicPartition]:
        raise TypeError("a bug")

    monkeypatch.setattr(kafka_driver, "resume_offsets", broken)
    with pytest.raises(TypeError):
        worker._on_assign(Consumer(), PARTITIONS)
    assert worker.assign_retries == 0


def test_a_rebalance_bringing_partitions_the_topics_disagree_on_stops_the_worker_before_reading_them(
        worker: Any) -> None:
    from stream.errors import ConfigError

    def assigned(partitions: object) -> None:
        raise ConfigError("topic impressions has 8 partitions and topic clicks has 4")

    worker.pipeline.layout.assigned = assigned
    consumer = Consumer()
    with pytest.raises(ConfigError, match="has 8 partitions"):  # out of consume(), run() and the CLI: exit 2
        worker._on_assign(consumer, [TopicPartition("impressions", 7)])
    assert consumer.assigned == []


def test_a_layout_check_the_broker_cannot_answer_is_asked_again_with_the_start_positions(
        worker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # the partition-count check of a partition past the known count is an admin metadata request: a timeout there
    # propagated out of the callback and stopped the worker (exit 1), where the start positions are asked again
    checks: list[list[int]] = []

    def assigned(partitions: Any) -> None:
        checks.append(list(partitions))
        if len(checks) <= 2:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "list_topics(): timed out"))

    worker.pipeline.layout.assigned = assigned
    monkeypatch.setattr(kafka_driver, "resume_offsets", _timing_out(0))
    consumer = Consumer()
    worker._on_assign(consumer, [TopicPartition("impressions", 7), TopicPartition("clicks", 7)])
    assert checks == [[7, 7]] * 3 and worker.assign_retries == 2
    assert consumer.assigned == [("impressions", 7, 42), ("clicks", 7, 42)] and worker._assigned == {7}


class _Committed:
    def __init__(self, offsets: dict[tuple[str, int], int]) -> None:
        self.offsets = offsets

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.offsets[(tp.topic, tp.partition)]) for tp in partitions]


def _fetched(topic: str, offsets: range) -> list[Any]:
    from stream.joiner.records import records_of

    n = len(offsets)
    return records_of([topic] * n, [0] * n, list(offsets), [b"k"] * n, [b"{}"] * n, [-1] * n, [()] * n)


def test_records_read_again_below_the_committed_offset_are_dropped_only_within_one_record_batch(worker: Any) -> None:
    """A start one record batch or less below the committed offset is the local broker's lagging high watermark: the
    records between were processed (a bad one among them was dead-lettered again at every restart). A start further
    below it is a topic deleted and made again, its offsets started over: those records are the new topic's, joined
    (the pipeline's topic ids), never dropped in silence; a start at the committed offset drops nothing."""
    lag, remade, at = ("impressions", 0), ("clicks", 0), ("late", 0)
    worker._remember_done(_Committed({lag: 105, remade: 50_000, at: 7}),
                          [TopicPartition(*lag, 99), TopicPartition(*remade, 99), TopicPartition(*at, 7)])
    kept = worker._unprocessed(_fetched("impressions", range(99, 110)) + _fetched("clicks", range(99, 110))
                               + _fetched("late", range(7, 9)))
    want = [("impressions", o) for o in range(105, 110)] + [("clicks", o) for o in range(99, 110)]
    assert [(r.topic, r.offset) for r in kept] == [*want, ("late", 7), ("late", 8)]
    assert worker._unprocessed(_fetched("impressions", range(99, 101))) == _fetched("impressions", range(99, 101))
