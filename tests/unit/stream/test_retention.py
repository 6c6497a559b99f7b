"""Input lost to retention (stream/retention.py): a saved offset below a partition's first record still held is said
(one ERROR line), counted and started at that first record, by every reader that resumes from saved offsets.

The local broker cannot delete records (DeleteRecords closes the connection, and it has no retention), so its low
watermark is always 0: these tests give the readers a consumer that reports the watermarks a real broker would."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, TopicPartition

from stream import event_reader, kafka
from stream.config import KafkaSettings
from stream.idle_clock import IdleClock
from stream.joiner.config import JoinerSettings
from stream.joiner.kafka_driver import KafkaJoinWorker
from stream.metrics import INPUT_LOST
from stream.retention import Lost, account_for_retention, starting_after_retention
from tests.joiner_stubs import assigning_pipeline


class Consumer:
    """What the readers ask a consumer at their start: committed offsets and watermarks, per (topic, partition)."""

    def __init__(self, committed: dict[tuple[str, int], int], marks: dict[tuple[str, int], tuple[int, int]],
                 fail: bool = False) -> None:
        self.committed_offsets, self.marks, self.fail = committed, marks, fail
        self.assigned: list[tuple[str, int, int]] = []
        self.fail_commit = False

    def committed(self, tps: list[TopicPartition], timeout: float | None = None) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.committed_offsets.get((tp.topic, tp.partition), -1001))
                for tp in tps]

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float | None = None) -> tuple[int, int]:
        if self.fail:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "watermarks timed out"))
        return self.marks[(tp.topic, tp.partition)]

    def assign(self, tps: list[TopicPartition]) -> None:
        self.assigned = [(tp.topic, tp.partition, tp.offset) for tp in tps]

    def commit(self, offsets: list[TopicPartition], asynchronous: bool = True) -> None:
        if self.fail_commit:
            raise KafkaException(KafkaError(KafkaError.REBALANCE_IN_PROGRESS, "rebalancing"))
        self.committed_offsets.update({(tp.topic, tp.partition): tp.offset for tp in offsets})

    def list_topics(self, timeout: float | None = None) -> Any:
        class Meta:
            def __init__(self, partitions: list[int]) -> None:
                self.partitions, self.error = {p: None for p in partitions}, None

        class Md:
            topics = {t: Meta(sorted(p for tt, p in self.marks if tt == t)) for t, _ in self.marks}

        return Md()

    def close(self) -> None: ...


def lost(reader: str, topic: str) -> float:
    return INPUT_LOST.labels(reader, topic)._value.get()


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The ERROR lines retention said: not librdkafka's, whose consumers here (bootstrap 127.0.0.1:9) may log a
    refused connect from their own thread into whichever test runs then."""
    return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and r.name == "streamrec.retention"]


def test_a_start_below_the_low_watermark_moves_to_it_and_is_logged_once_and_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    before = lost("joiner", "t-logic")
    starts = [TopicPartition("t-logic", 0, 5), TopicPartition("t-logic", 1, 7), TopicPartition("t-logic", 2, 3),
              TopicPartition("t-logic", 3, OFFSET_BEGINNING), TopicPartition("t-logic", 4, 1)]
    with caplog.at_level(logging.ERROR, logger="streamrec.retention"):
        out, gone = account_for_retention("joiner", starts, {("t-logic", 0): 20, ("t-logic", 1): 7,
                                                             ("t-logic", 2): 0, ("t-logic", 3): 9})
    assert [(tp.partition, tp.offset) for tp in out] == [(0, 20), (1, 7), (2, 3), (3, OFFSET_BEGINNING), (4, 1)]
    assert gone == [Lost("joiner", "t-logic", 0, 5, 20)] and gone[0].records == 15
    assert lost("joiner", "t-logic") == before + 15
    [line] = errors(caplog)
    for said in ("joiner", "15 record(s) of t-logic partition 0, offsets 5..19", "retention", "DeleteRecords", "lag"):
        assert said in line


def test_resume_offsets_starts_a_committed_offset_below_the_low_watermark_at_it_and_counts_the_loss(
        caplog: pytest.LogCaptureFixture) -> None:
    before = lost("joiner", "t-resume")
    c = Consumer({("t-resume", 0): 3, ("t-resume", 1): 12},
                 {("t-resume", 0): (10, 50), ("t-resume", 1): (10, 50), ("t-resume", 2): (10, 50)})
    with caplog.at_level(logging.ERROR, logger="streamrec.retention"):
        out = kafka.resume_offsets(c, [TopicPartition("t-resume", p) for p in range(3)], "joiner")  # type: ignore[arg-type]
    assert [(tp.partition, tp.offset) for tp in out] == [(0, 10), (1, 12), (2, OFFSET_BEGINNING)]
    assert lost("joiner", "t-resume") == before + 7 and len(errors(caplog)) == 1


def test_resume_offsets_warns_of_a_committed_offset_more_than_a_record_batch_past_the_end_but_not_of_tansus_lag(
        caplog: pytest.LogCaptureFixture) -> None:
    """Past the high watermark by less than a batch is the local broker's under-reported end (resume_offsets); by
    more, on Apache Kafka, the topic was deleted and created again: said, with the same start as before."""
    far = 40 + kafka.BATCH_MESSAGES + 1
    c = Consumer({("t-high", 0): 45, ("t-high", 1): far}, {("t-high", 0): (0, 40), ("t-high", 1): (0, 40)})
    with caplog.at_level(logging.WARNING, logger="streamrec.kafka"):
        out = kafka.resume_offsets(c, [TopicPartition("t-high", 0), TopicPartition("t-high", 1)], "joiner")  # type: ignore[arg-type]
    assert [(tp.partition, tp.offset) for tp in out] == [(0, 39), (1, 39)]
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "t-high partition 1" in line and "deleted and created again" in line


def test_the_event_reader_starts_past_what_retention_deleted_and_counts_it_under_its_stage(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    before = lost("audit", "t-reader")
    c = Consumer({("t-reader", 0): 2}, {("t-reader", 0): (6, 9)})
    monkeypatch.setattr(event_reader, "new_consumer", lambda *a, **k: c)
    with caplog.at_level(logging.ERROR, logger="streamrec.retention"):
        event_reader.EventReader(KafkaSettings(), "g", {"t-reader": lambda v, **k: v}, dead_letters=object(),  # type: ignore[arg-type]
                                 stage="audit")
    assert c.assigned == [("t-reader", 0, 6)]
    assert lost("audit", "t-reader") == before + 4 and len(errors(caplog)) == 1


def test_the_kafka_drivers_assignment_starts_past_what_retention_deleted_and_counts_it(
        caplog: pytest.LogCaptureFixture) -> None:
    w = KafkaJoinWorker(assigning_pipeline(), KafkaSettings(bootstrap_servers="127.0.0.1:9"), JoinerSettings())  # type: ignore[arg-type]
    try:
        topic = w.kafka.impressions_topic
        before = lost("joiner", topic)
        c = Consumer({(topic, 0): 100}, {(topic, 0): (250, 300)})
        with caplog.at_level(logging.ERROR, logger="streamrec.retention"):
            w._on_assign(c, [TopicPartition(topic, 0)])  # type: ignore[arg-type]
        assert c.assigned == [(topic, 0, 250)]
        assert lost("joiner", topic) == before + 150 and len(errors(caplog)) == 1
    finally:
        w.consumer.close()


def test_a_reader_whose_broker_cannot_give_the_low_watermarks_says_it_did_not_check_and_keeps_its_offsets(
        caplog: pytest.LogCaptureFixture) -> None:
    starts = [TopicPartition("t-fail", 0, 4)]
    with caplog.at_level(logging.WARNING, logger="streamrec.retention"):
        steps = starting_after_retention(Consumer({}, {}, fail=True), "learner", starts)  # type: ignore[arg-type]
        with pytest.raises(StopIteration) as done:
            while True:
                next(steps)
        out = done.value.value
    assert [(tp.partition, tp.offset) for tp in out] == [(0, 4)]
    assert any("not checked" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


class AIOKafkaThread:
    """What faust's seek to the committed offsets asks of its aiokafka consumer thread (``perform_seek``): the
    committed offsets (None: none), the low watermarks (``beginning_offsets``) and seeks."""

    def __init__(self, committed: dict[Any, int | None], lows: dict[Any, int], fail: bool = False) -> None:
        self.committed, self.lows, self.fail = committed, lows, fail
        self.asked: list[list[Any]] = []
        self.seeks: list[tuple[Any, int]] = []

    async def seek_to_committed(self) -> dict[Any, int | None]:
        return dict(self.committed)  # aiokafka seeks each to its committed offset (not recorded: the starting point)

    async def earliest_offsets(self, *tps: Any) -> dict[Any, int]:
        self.asked.append(sorted(tps))
        if self.fail:
            raise TimeoutError("ListOffsets timed out")
        return {tp: self.lows[tp] for tp in tps}

    def seek(self, tp: Any, offset: int) -> None:
        self.seeks.append((tp, offset))

    def highwater(self, tp: Any) -> int:
        return 1_000  # far ahead: a backlog, so a batch goes at the first fetch that brings nothing


def faust_consumer(thread: AIOKafkaThread, sought: bool = False) -> Any:
    """The faust driver's consumer (BatchConsumer, installed as the joiner's faust worker does), not started: its
    aiokafka thread is ``thread``; with ``sought``, in generation 1 and sought to the committed offsets, as after an
    assignment."""
    import faust

    from stream.joiner.faust_delivery import BatchDelivery, install

    app = faust.App("t-faust-retention", broker="kafka://127.0.0.1:9", autodiscover=False)
    install(app, BatchDelivery(process=lambda records: {}, max_records=10, within_s=0.1, short_polls=lambda: False,
                               in_hand=lambda n: None))
    consumer: Any = app.consumer
    consumer._thread = thread
    if sought:
        import asyncio

        consumer.app.consumer_generation_id = 1
        asyncio.run(consumer.perform_seek())
    return consumer


def test_the_faust_drivers_seek_to_committed_starts_past_what_retention_deleted_and_counts_it_once(
        caplog: pytest.LogCaptureFixture) -> None:
    import asyncio

    from faust.types import TP

    gone, kept, fresh, empty = TP("t-faust", 0), TP("t-faust", 1), TP("t-faust", 2), TP("t-faust", 3)
    thread = AIOKafkaThread({gone: 100, kept: 40, fresh: None, empty: 0}, {gone: 250, kept: 30, empty: 0})
    consumer = faust_consumer(thread)
    consumer.app.consumer_generation_id = 1
    before = lost("joiner", "t-faust")
    with caplog.at_level(logging.ERROR, logger="streamrec.retention"):
        asyncio.run(consumer.perform_seek())  # faust's, after an assignment
    assert thread.asked == [[gone, kept, empty]]  # a partition without a committed offset loses nothing
    assert thread.seeks == [(gone, 250)]
    assert lost("joiner", "t-faust") == before + 150
    [line] = errors(caplog)
    assert "joiner: 150 record(s) of t-faust partition 0, offsets 100..249" in line
    # faust reads and commits from there: its read offset, and the committed offset its commit counts on from
    assert consumer._read_offset[gone] == 250 and consumer._committed_offset[gone] == 250
    assert consumer._read_offset[kept] == 40
    consumer._acked[gone].extend([250, 251])
    assert consumer._new_offset(gone) == 252

    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="streamrec.retention"):
        asyncio.run(consumer.perform_seek())  # a drop in the same generation: not asked, not said again, still moved
        consumer.app.consumer_generation_id = 2
        asyncio.run(consumer.perform_seek())  # a rebalance before anything of it was committed: asked, not said again
        assert thread.asked[1:] == [[gone, kept, empty]] and errors(caplog) == []
        assert thread.seeks[1:] == [(gone, 250), (gone, 250)] and lost("joiner", "t-faust") == before + 150
        thread.lows[gone] = 260  # deleted since: only that is lost again
        consumer.app.consumer_generation_id = 3
        asyncio.run(consumer.perform_seek())
    assert thread.seeks[3:] == [(gone, 260)] and lost("joiner", "t-faust") == before + 160
    [line] = errors(caplog)
    assert "10 record(s) of t-faust partition 0, offsets 250..259" in line


def test_the_faust_driver_whose_broker_cannot_give_the_low_watermarks_warns_and_starts_at_the_committed_offsets(
        caplog: pytest.LogCaptureFixture) -> None:
    import asyncio

    from faust.types import TP

    tp = TP("t-faust-fail", 0)
    thread = AIOKafkaThread({tp: 5}, {}, fail=True)
    consumer = faust_consumer(thread)
    with caplog.at_level(logging.WARNING, logger="streamrec.retention"):
        asyncio.run(consumer.perform_seek())
    assert thread.seeks == [] and consumer._read_offset[tp] == 5
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "joiner" in line and "t-faust-fail" in line and "not checked" in line


def fetched(consumer: Any, fetches: list[dict[Any, list[int]]]) -> list[tuple[str, int]]:
    """One batch of the faust driver (``BatchConsumer._gather``) over aiokafka's ``fetches``: per partition, the offsets
    of its records (built as aiokafka's), then nothing; what the batch holds."""
    import asyncio

    from aiokafka.structs import ConsumerRecord

    queue = [{tp: [ConsumerRecord(tp.topic, tp.partition, o, 1_000 + o, 0, b"k", b"v", None, 1, 1, [])
                   for o in offsets] for tp, offsets in f.items()} for f in fetches]

    async def wait_next_records(timeout: float) -> tuple[dict[Any, list[Any]], None]:
        return (queue.pop(0) if queue else {}), None

    consumer._wait_next_records = wait_next_records
    return [(r.topic, r.offset) for r in asyncio.run(consumer._gather())]


def test_the_faust_drivers_fetch_past_records_deleted_while_it_runs_logs_and_counts_them_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """The joiner falls behind the impressions' retention while it runs: aiokafka's fetch got OFFSET_OUT_OF_RANGE and
    reset the partition to its earliest offset without a word, so the next fetch jumps from offset 11 to 40 (the first
    record held 30). The clicks' jump (a control record, nothing deleted) is no loss; a fetch without a jump asks the
    broker nothing; the rebalance that seeks back to the committed offset (still 10) does not say 12..29 again, only
    10 and 11, fetched but never committed, and deleted since."""
    import asyncio

    from faust.types import TP

    imps, clicks = TP("t-faust-run", 0), TP("t-faust-run-clicks", 0)
    thread = AIOKafkaThread({imps: 10, clicks: 5}, {imps: 0, clicks: 0})
    consumer = faust_consumer(thread, sought=True)
    before = lost("joiner", imps.topic), lost("joiner", clicks.topic)
    with caplog.at_level(logging.ERROR, logger="streamrec.retention"):
        assert fetched(consumer, [{imps: [10, 11], clicks: [5]}]) == [(imps.topic, 10), (imps.topic, 11),
                                                                      (clicks.topic, 5)]
        assert len(thread.asked) == 1  # the seek's only: no jump, no question
        thread.lows = {imps: 30, clicks: 0}
        assert fetched(consumer, [{imps: [40, 41], clicks: [7]}]) == [(imps.topic, 40), (imps.topic, 41),
                                                                      (clicks.topic, 7)]
        assert thread.asked[1:] == [sorted([imps, clicks])]
        consumer.app.consumer_generation_id = 2  # a rebalance before anything past the loss was committed
        asyncio.run(consumer.perform_seek())
    assert thread.seeks == [(imps, 30)]
    assert (lost("joiner", imps.topic), lost("joiner", clicks.topic)) == (before[0] + 20, before[1])
    line, again = errors(caplog)
    assert "joiner: 18 record(s) of t-faust-run partition 0, offsets 12..29" in line
    assert "fell behind" in line and "goes on from offset 40" in line
    assert "2 record(s) of t-faust-run partition 0, offsets 10..29, 18 of them said before" in again


def test_the_faust_drivers_jump_right_after_a_seek_counts_from_the_offset_sought(
        caplog: pytest.LogCaptureFixture) -> None:
    """faust's read offset right after a seek is the offset sought (the next to read), not the last one read: the
    record at it is lost too when the fetch's reset jumps past it."""

    from faust.types import TP

    tp = TP("t-faust-sought", 0)
    thread = AIOKafkaThread({tp: 20}, {tp: 0})
    consumer = faust_consumer(thread, sought=True)
    thread.lows = {tp: 23}
    before = lost("joiner", tp.topic)
    with caplog.at_level(logging.ERROR, logger="streamrec.retention"):
        assert fetched(consumer, [{tp: [25, 26]}]) == [(tp.topic, 25), (tp.topic, 26)]
    assert lost("joiner", tp.topic) == before + 3
    [line] = errors(caplog)
    assert "3 record(s) of t-faust-sought partition 0, offsets 20..22" in line


def test_the_faust_drivers_jump_the_broker_cannot_check_is_one_warning_and_the_batch_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:

    from faust.types import TP

    tp = TP("t-faust-run-fail", 0)
    thread = AIOKafkaThread({tp: 4}, {tp: 0})
    consumer = faust_consumer(thread, sought=True)
    thread.fail = True
    before = lost("joiner", tp.topic)
    with caplog.at_level(logging.WARNING, logger="streamrec.retention"):
        assert fetched(consumer, [{tp: [4, 5]}, {tp: [60]}]) == [(tp.topic, 4), (tp.topic, 5), (tp.topic, 60)]
    assert lost("joiner", tp.topic) == before and errors(caplog) == []
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "joiner" in line and "t-faust-run-fail" in line and "not checked" in line
    assert "offset 60 of t-faust-run-fail partition 0, where it expected offset 6" in line


def test_a_rebalance_while_the_faust_driver_asks_about_a_jump_drops_the_batch_in_hand() -> None:
    """Asking the broker awaits: a rebalance that came meanwhile makes the records in hand stale, as at any fetch
    (``_Dropped``: sought back to the committed offsets), even when the batch is full and no fetch follows to see it;
    the loss is said all the same."""

    from faust.types import TP

    from stream.joiner.faust_delivery import _Dropped

    tp = TP("t-faust-rebalance", 0)

    class Rebalancing(AIOKafkaThread):
        async def earliest_offsets(self, *tps: Any) -> dict[Any, int]:
            if self.asked:  # not the seek's: the jump's
                consumer.app.consumer_generation_id = 2
            return await super().earliest_offsets(*tps)

    thread = Rebalancing({tp: 7}, {tp: 0})
    consumer = faust_consumer(thread, sought=True)
    thread.lows = {tp: 9}
    before = lost("joiner", tp.topic)
    with pytest.raises(_Dropped) as dropped:
        fetched(consumer, [{tp: [7]}, {tp: list(range(12, 21))}])  # the batch full (10): no fetch checks after it
    assert dropped.value.first == {tp: 7} and lost("joiner", tp.topic) == before + 1


def test_the_packaged_input_lost_to_retention_rule_fires_at_the_first_scrape_after_a_loss_at_start() -> None:
    """The loss is found as a reader resumes, before the monitor's first scrape of it: a rule on the counter's
    increase() would never see it (a series' first value is no increase). The packaged rule reads the counter."""
    from monitor.alerts import AlertState
    from tests.unit.learner.test_cold_start_metrics import default_rule, scraped

    engine = default_rule("input_lost_to_retention")
    topic = "retention-rule-test-topic"
    assert [a for a in engine.evaluate(scraped(), 0.0) if a.labels.get("topic") == topic] == []
    account_for_retention("learner", [TopicPartition(topic, 0, 5)], {(topic, 0): 9})  # found at start
    got = [(a.state, a.labels.get("reader")) for a in engine.evaluate(scraped(), 15.0)
           if a.labels.get("topic") == topic]
    assert got == [(AlertState.FIRING, "learner")]


class Marks:
    """A consumer as :class:`stream.retention.Gaps` asks it: each partition's low watermark (its first record still
    held), or a broker that cannot say; the partitions asked."""

    def __init__(self, lows: dict[tuple[str, int], int], fail: bool = False) -> None:
        self.lows, self.fail = lows, fail
        self.asked: list[tuple[str, int]] = []

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float | None = None) -> tuple[int, int]:
        self.asked.append((tp.topic, tp.partition))
        if self.fail:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "watermarks timed out"))
        return self.lows.get((tp.topic, tp.partition), 0), 0  # the high watermark: not reliable, not read


def columns(*msgs: tuple[str, int, int]) -> tuple[list[str], list[int], list[int]]:
    return [t for t, _, _ in msgs], [p for _, p, _ in msgs], [o for _, _, o in msgs]


def test_a_batch_that_jumps_past_records_deleted_while_reading_logs_and_counts_them_and_a_gap_with_none_deleted_not(
        caplog: pytest.LogCaptureFixture) -> None:
    """A reader that falls behind retention while it runs gets OFFSET_OUT_OF_RANGE, and librdkafka resets it to the
    earliest offset without a word. Gaps without any loss (control records, compaction) ask the broker but say
    nothing; a batch without gaps asks it nothing."""
    from stream.retention import Gaps

    marks = Marks({("t-gap", 0): 9, ("t-gap", 1): 0, ("t-gap", 2): 20})
    g = Gaps(marks, "joiner")  # type: ignore[arg-type]
    g.expect([TopicPartition("t-gap", 0, 3), TopicPartition("t-gap", 1, 3), TopicPartition("t-gap", 2, 10),
              TopicPartition("t-gap", 3, OFFSET_BEGINNING)])
    before = lost("joiner", "t-gap")
    with caplog.at_level(logging.DEBUG, logger="streamrec.retention"):
        assert g.batch(*columns(("t-gap", 0, 3), ("t-gap", 1, 3), ("t-gap", 0, 4), ("t-gap", 3, 7), ("t-gap", 1, 4),
                                ("t-gap", 2, 10))) == []
        assert marks.asked == [] and g.next[("t-gap", 3)] == 8  # the first message of a logical start sets its next
        gone = g.batch(*columns(("t-gap", 0, 5), ("t-gap", 1, 7), ("t-gap", 0, 11), ("t-gap", 2, 25),
                                ("t-gap", 3, 8), ("t-gap", 0, 12)))
    # partition 0: 6..8 deleted (11 the next record after the first one held, 9); 1: 5, 6 skipped, nothing deleted;
    # 2: 11..19 deleted (the next record 25 past the first held, 20: the ones between are no loss)
    assert gone == [Lost("joiner", "t-gap", 0, 6, 9), Lost("joiner", "t-gap", 2, 11, 20)]
    assert sorted(marks.asked) == [("t-gap", 0), ("t-gap", 1), ("t-gap", 2)]
    assert lost("joiner", "t-gap") == before + 3 + 9
    first, second = errors(caplog)
    for said in ("joiner", "3 record(s) of t-gap partition 0, offsets 6..8", "fell behind", "retention", "lag",
                 "goes on from offset 11"):
        assert said in first
    assert "9 record(s) of t-gap partition 2, offsets 11..19" in second
    assert g.next == {("t-gap", 0): 13, ("t-gap", 1): 8, ("t-gap", 2): 26, ("t-gap", 3): 9}


def test_a_message_past_the_offset_expected_is_checked_once_and_a_rewind_is_no_gap() -> None:
    from stream.retention import Gaps

    marks = Marks({("t-one", 0): 5})
    g = Gaps(marks, "learner")  # type: ignore[arg-type]
    g.expect([TopicPartition("t-one", 0, 2)])
    before = lost("learner", "t-one")
    assert g.message("t-one", 0, 2) is None and marks.asked == []
    assert g.message("t-one", 0, 6) == Lost("learner", "t-one", 0, 3, 5)
    assert g.message("t-one", 0, 7) is None and g.message("t-one", 0, 1) is None  # a seek back: starts over from it
    assert g.message("t-one", 0, 2) is None and marks.asked == [("t-one", 0)]
    assert lost("learner", "t-one") == before + 2


def test_a_gap_the_broker_cannot_check_is_one_warning_not_a_crash(caplog: pytest.LogCaptureFixture) -> None:
    from stream.retention import Gaps

    g = Gaps(Marks({}, fail=True), "joiner")  # type: ignore[arg-type]
    g.expect([TopicPartition("t-unchecked", 0, 0)])
    before = lost("joiner", "t-unchecked")
    with caplog.at_level(logging.WARNING, logger="streamrec.retention"):
        assert g.batch(*columns(("t-unchecked", 0, 0), ("t-unchecked", 0, 40))) == []
    assert lost("joiner", "t-unchecked") == before and g.next == {("t-unchecked", 0): 41}
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "t-unchecked" in line and "offset 40, where it expected offset 1" in line and "not checked" in line


class RunConsumer(Marks):
    """librdkafka's consumer as the kafka driver's run loop uses it: an assignment at the first poll, then the
    ``batches`` of messages, one a poll; then the worker is told to stop."""

    def __init__(self, worker: KafkaJoinWorker, batches: list[list[Any]], lows: dict[tuple[str, int], int]) -> None:
        super().__init__(lows)
        self.worker, self.batches = worker, batches
        self.on_assign: Any = None

    def subscribe(self, topics: list[str], on_assign: Any = None, on_revoke: Any = None, on_lost: Any = None) -> None:
        self.on_assign = on_assign

    def assign(self, tps: list[TopicPartition]) -> None: ...

    def committed(self, tps: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, -1001) for tp in tps]  # none: every record fetched is new

    def consume(self, n: int, timeout: float) -> list[Any]:
        if self.on_assign is not None:
            assign, self.on_assign = self.on_assign, None
            assign(self, [TopicPartition(t, 0) for t in (self.worker.kafka.impressions_topic,
                                                         self.worker.kafka.clicks_topic)])
        if not self.batches:
            self.worker._stop = True
            return []
        return self.batches.pop(0)

    def assignment(self) -> list[TopicPartition]:
        return []

    def close(self) -> None: ...


def test_the_kafka_drivers_fetch_past_records_deleted_while_it_runs_logs_and_counts_them(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The joiner falls behind the impressions' retention while it runs: its fetch jumps from offset 12 to 40 (the
    first record held 30); the clicks' gap (a control record, nothing deleted) is no loss."""
    from types import SimpleNamespace

    from confluent_kafka import Message

    from stream.joiner import kafka_driver

    w = KafkaJoinWorker(assigning_pipeline(), KafkaSettings(bootstrap_servers="127.0.0.1:9"),  # type: ignore[arg-type]
                        JoinerSettings(batch_max=4, batch_within_s=0.01))
    w.consumer.close()
    imps, clicks = w.kafka.impressions_topic, w.kafka.clicks_topic

    def msgs(topic: str, *offsets: int) -> list[Any]:
        return [Message(topic=topic, partition=0, offset=o, key=b"k", value=b"v", timestamp=(1, o)) for o in offsets]

    c = RunConsumer(w, [msgs(imps, 10, 11) + msgs(clicks, 5), msgs(imps, 12, 40) + msgs(clicks, 7), msgs(imps, 41)],
                    {(imps, 0): 30, (clicks, 0): 0})
    w.consumer = w.gaps.consumer = c  # type: ignore[assignment]
    monkeypatch.setattr(kafka_driver, "resume_offsets", lambda consumer, tps, reader: [
        TopicPartition(tp.topic, tp.partition, {imps: 10, clicks: 5}[tp.topic]) for tp in tps])
    processed: list[tuple[str, int]] = []
    w.pipeline = assigning_pipeline(
        totals=SimpleNamespace(stage_s={"fetch": 0.0, "commit": 0.0}), engines={0: None}, processed={},
        held_counts={}, restore=lambda _p: None, awake=IdleClock(1.0, 0.0),
        process_new=lambda records, behind: processed.extend((r.topic, r.offset) for r in records))
    monkeypatch.setattr(w, "_apply_gate", set)
    before = lost("joiner", imps), lost("joiner", clicks)
    with caplog.at_level(logging.ERROR, logger="streamrec.retention"):
        assert w.run() == 0
    assert sorted(o for t, o in processed if t == imps) == [10, 11, 12, 40, 41]  # the batches as they were
    assert (lost("joiner", imps), lost("joiner", clicks)) == (before[0] + 17, before[1])
    [line] = errors(caplog)
    assert f"17 record(s) of {imps} partition 0, offsets 13..29" in line and "goes on from offset 40" in line


def test_a_loss_found_at_resume_is_said_and_counted_once_over_rebalances_and_rewinds(
        caplog: pytest.LogCaptureFixture) -> None:
    """Nothing remembered a loss already said: the group's offset stayed below the first record held until something
    new of the partition was committed, so each rebalance and each rewind (Redis away: every 1-30 s) said and counted
    it again (the review counted 4 ERROR lines and 600 records for one 150-record loss). The low watermark is now
    committed for the partition, and a process says a loss once (a commit that fails is a warning, and retried at
    the next resume)."""
    c = Consumer({("t-once", 0): 50}, {("t-once", 0): (200, 300)})
    before = lost("joiner", "t-once")
    with caplog.at_level(logging.WARNING, logger="streamrec"):
        c.fail_commit = True
        kafka.resume_offsets(c, [TopicPartition("t-once", 0)], "joiner")  # type: ignore[arg-type]
        c.fail_commit = False
        for _ in range(3):  # the next assignment, a rewind, a restart
            starts = kafka.resume_offsets(c, [TopicPartition("t-once", 0)], "joiner")  # type: ignore[arg-type]
    assert [(tp.partition, tp.offset) for tp in starts] == [(0, 200)]
    assert lost("joiner", "t-once") == before + 150
    assert len(errors(caplog)) == 1
    assert any("could not commit the offsets past the records lost" in r.getMessage() for r in caplog.records)
    assert c.committed_offsets[("t-once", 0)] == 200


def test_a_rewind_to_the_local_brokers_last_batch_is_never_below_the_first_record_held() -> None:
    """Tansu's high-watermark rewind (high - 1) on a partition whose records are all gone (low == high) started below
    the first record held: one record counted lost that never was."""
    before = lost("joiner", "t-empty")
    c = Consumer({("t-empty", 0): 41}, {("t-empty", 0): (40, 40)})
    starts = kafka.resume_offsets(c, [TopicPartition("t-empty", 0)], "joiner")  # type: ignore[arg-type]
    assert [(tp.partition, tp.offset) for tp in starts] == [(0, 40)] and lost("joiner", "t-empty") == before


def test_the_faust_drivers_check_cut_off_by_a_recovery_timeout_is_asked_again_at_the_next_seek() -> None:
    """The partitions were marked asked before the broker answered: a seek cancelled while it waited (faust's
    recovery runs it under a timeout; a new rebalance cancels it) left them unchecked for the generation, and the
    next seek started at the committed offset, which aiokafka then reset to the earliest one without a word."""
    import asyncio

    from faust.types import TP

    class SlowOnce(AIOKafkaThread):
        slow = True

        async def earliest_offsets(self, *tps: Any) -> dict[Any, int]:
            if self.slow:
                self.slow = False
                await asyncio.sleep(30)  # a broker slow to answer inside the rebalance
            return await super().earliest_offsets(*tps)

    gone = TP("t-cancel", 0)
    thread = SlowOnce({gone: 100}, {gone: 250})
    consumer = faust_consumer(thread)
    consumer.app.consumer_generation_id = 1
    before = lost("joiner", "t-cancel")

    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(consumer.perform_seek(), 0.05)  # faust's recovery: a seek under a timeout
        await consumer.perform_seek()  # the same generation: a _drop's seek back

    asyncio.run(main())
    assert thread.seeks == [(gone, 250)] and lost("joiner", "t-cancel") == before + 150


def test_a_partition_gone_back_cannot_hide_another_partitions_gap_in_the_batch_check() -> None:
    """The quick check summed the partitions' spans against the batch's length: a partition reset to an earlier
    offset (fewer span than messages) cancelled another's gap exactly, and the loss was never asked about."""
    from stream.retention import Gaps

    marks = Marks({("t-mask", 0): 105, ("t-mask", 1): 0})
    g = Gaps(marks, "joiner")  # type: ignore[arg-type]
    g.expect([TopicPartition("t-mask", 0, 100), TopicPartition("t-mask", 1, 4)])
    before = lost("joiner", "t-mask")
    gone = g.batch(*columns(("t-mask", 0, 100), ("t-mask", 0, 105), ("t-mask", 1, 0), ("t-mask", 1, 1),
                            ("t-mask", 1, 2), ("t-mask", 1, 3)))
    assert gone == [Lost("joiner", "t-mask", 0, 101, 105)] and lost("joiner", "t-mask") == before + 4


def test_a_loss_found_while_running_is_not_said_again_by_the_rewind_that_follows(
        caplog: pytest.LogCaptureFixture) -> None:
    """Gaps said a loss the group's committed offset was still below: a rewind (an infrastructure failure on that
    batch) or a rebalance before the next commit ran resume_offsets, which said and counted it again (the review: two
    ERROR lines, 35 counted for a loss of 17). Now only offset 12, fetched in the failed batch and deleted since, is
    said at the rewind, which commits past it."""
    from stream.retention import Gaps

    c = Consumer({("t-rewind", 0): 12}, {("t-rewind", 0): (30, 60)})
    g = Gaps(c, "joiner")  # type: ignore[arg-type]
    g.expect([TopicPartition("t-rewind", 0, 12)])
    before = lost("joiner", "t-rewind")
    with caplog.at_level(logging.ERROR, logger="streamrec.retention"):
        assert g.batch(*columns(("t-rewind", 0, 12), ("t-rewind", 0, 40))) == [Lost("joiner", "t-rewind", 0, 13, 30)]
        starts = kafka.resume_offsets(c, [TopicPartition("t-rewind", 0)], "joiner")  # type: ignore[arg-type]
    assert [(tp.partition, tp.offset) for tp in starts] == [(0, 30)] and c.committed_offsets[("t-rewind", 0)] == 30
    assert lost("joiner", "t-rewind") == before + 18 and len(errors(caplog)) == 2


class AssignedThread(AIOKafkaThread):
    """:class:`AIOKafkaThread` whose assignment is the partitions it has committed offsets for (``_drop`` reads it)."""

    def assignment(self) -> set[Any]:
        return set(self.committed)


def test_a_faust_reseek_in_the_same_generation_after_a_loss_found_while_running_says_nothing_again(
        caplog: pytest.LogCaptureFixture) -> None:
    """A drop (records ``process`` neither processed nor kept) seeks back to the committed offset, still below the
    first record held; aiokafka's reset from there was a new jump, and the loss was said and counted again (the
    review: 18, then 20 more). Each process says a range once (stream.retention._SAID keeps the ranges said): the
    re-seek says only 10 and 11, fetched but never processed, and deleted since."""
    import asyncio

    from faust.types import TP

    tp = TP("t-reseek", 0)
    thread = AssignedThread({tp: 10}, {tp: 0})
    consumer = faust_consumer(thread, sought=True)
    before = lost("joiner", tp.topic)
    with caplog.at_level(logging.ERROR, logger="streamrec.retention"):
        fetched(consumer, [{tp: [10, 11]}])
        thread.lows = {tp: 30}
        fetched(consumer, [{tp: [30, 31]}])  # aiokafka's reset: 12..29 lost while running
        asyncio.run(consumer._drop({tp: 30}, 2))  # the same generation: back to the committed 10
        fetched(consumer, [{tp: [30, 31]}])  # aiokafka's reset from 10 again
    assert lost("joiner", tp.topic) == before + 20 and len(errors(caplog)) == 2


@pytest.mark.parametrize("seek_during_the_ask", [True, False])
def test_a_rebalance_while_the_faust_driver_asks_about_a_jump_counts_each_record_once(
        seek_during_the_ask: bool) -> None:
    """The rebalance's seek (a new generation) said [committed, low) while the jump's ask was out, and the ask then
    said [expected, low) again (38 counted for 20); and where the dropped hand held records fetched before the jump
    and deleted since, the next seek took them for said (18 counted for 20). Now 20: each record once."""
    import asyncio

    from faust.types import TP

    from stream.joiner.faust_delivery import _Dropped

    tp = TP(f"t-race-{seek_during_the_ask}", 0)
    consumers: list[Any] = []

    class Racing(AssignedThread):
        async def earliest_offsets(self, *tps: Any) -> dict[Any, int]:
            if self.asked and consumers[0].app.consumer_generation_id == 1:  # the jump's ask: a rebalance meanwhile
                consumer = consumers[0]
                consumer.app.consumer_generation_id = 2
                if seek_during_the_ask:
                    self.asked.append(["jump"])
                    await consumer.perform_seek()  # faust's recovery in the new generation
            return await super().earliest_offsets(*tps)

    thread = Racing({tp: 10}, {tp: 0})
    consumers.append(faust_consumer(thread, sought=True))
    before = lost("joiner", tp.topic)
    thread.lows = {tp: 30}
    with pytest.raises(_Dropped) as dropped:
        fetched(consumers[0], [{tp: [10, 11]}, {tp: [30, 31]}])
    if not seek_during_the_ask:
        asyncio.run(consumers[0]._drop(dropped.value.first, dropped.value.records))  # the new generation's seek
    assert lost("joiner", tp.topic) == before + 20


def test_the_local_brokers_rewind_on_a_partition_retention_emptied_is_no_loss_of_the_record_below_it(
        caplog: pytest.LogCaptureFixture) -> None:
    """An idle partition read to its end whose records retention all deleted (first offset = end = committed 50):
    the rewind to the end - 1 (the local broker's quirk, ``_resume_safely``) was taken as the offset expected, and
    aiokafka's reset to 50 as a jump past 49, a record processed and committed long ago (counted 1)."""
    import asyncio

    from faust.types import TP

    tp = TP("t-emptied", 0)

    class Emptied(AssignedThread):
        def highwater(self, tp: Any) -> int:
            return 50

    thread = Emptied({tp: 50}, {tp: 50})
    consumer = faust_consumer(thread, sought=True)
    before = lost("joiner", tp.topic)
    consumer._set_active_tps({tp})  # faust's on_partitions_assigned
    asyncio.run(consumer._resume_safely(1, {}))  # a fetch that brought it nothing: the rewind to 49
    assert thread.seeks[-1] == (tp, 49)
    fetched(consumer, [{tp: [50, 51]}])  # new records after aiokafka's reset to 50
    assert lost("joiner", tp.topic) == before
