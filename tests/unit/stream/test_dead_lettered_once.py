"""A bad input record is dead-lettered once (``JoinPipeline._join``; the design: "every invalid message
dead-lettered exactly once"), also when it is read again by a new owner of its partition: a rebalance or a restart
after the batch that dead-lettered it made its state durable but before its offsets were committed. The state chunk
carries the last offset of each input the batch handled, dead-lettered records included, and a batch of bad records
only writes one too.

A JoinPipeline without a broker or Redis: what it sends is kept in a list, and the state log it restores from is read
back from that list (``state_log.load_chunks`` for real, over a fake ``read_to_end``)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import REGISTRY

import stream.joiner.kafka_driver as kafka_driver_module
import stream.joiner.pipeline as pipeline_module
import stream.joiner.state_log as state_log_module
from stream.config import KafkaSettings
from stream.errors import DeliveryFailed
from stream.events import Click, Impression
from stream.joiner.config import JoinerSettings
from stream.joiner.pipeline import JoinPipeline, awake_clock
from stream.joiner.records import Record
from stream.joiner.state_log import state_topic
from stream.joiner.totals import JoinTotals
from stream.joiner.worker import FaustJoinWorker
from stream.kafka_limits import MessageLimit
from stream.limits import DEFAULT_LIMITS

KAFKA = KafkaSettings()
T0 = 1_700_000_000_000
STATE = state_topic(JoinerSettings().app_id)


class Log:
    """Every message the pipelines sent (one broker for all of them), and each dead letter's source, acknowledged at
    the producer's next flush (``lost``: the next flush with dead letters to acknowledge fails so, and loses them)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int | None, Any, bytes | None]] = []  # (topic, partition, key, value)
        self.dead: list[tuple[str, int, int | None]] = []  # (source topic, partition, offset), acknowledged
        self.unflushed: list[tuple[str, int, int | None]] = []
        self.lost: Exception | None = None

    def send(self, topic, value, key=None, headers=None, partition=None) -> None:  # noqa: ANN001 - AckedProducer's
        self.sent.append((topic, partition, key, value))

    def flush(self) -> None:
        unflushed, self.unflushed = self.unflushed, []
        if unflushed and self.lost is not None:
            error, self.lost = self.lost, None
            raise error
        self.dead.extend(unflushed)

    def dead_letter(self, topic, key, value, err, partition, offset=None, headers=None) -> None:  # noqa: ANN001
        self.unflushed.append((topic, partition, offset))

    def read_to_end(self, kafka, topic, handle, *, start=None, **_: Any) -> list[int]:  # noqa: ANN001
        for offset, (t, partition, key, value) in enumerate(self.sent):
            if t == topic and partition in (start or {}):
                handle(SimpleNamespace(partition=lambda p=partition: p, key=lambda k=key: k,
                                       value=lambda v=value: v, offset=lambda o=offset: o))
        return sorted(start or {})


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> Log:
    log = Log()
    monkeypatch.setattr(state_log_module, "read_to_end", log.read_to_end)
    monkeypatch.setattr(pipeline_module, "topic_identities", lambda kafka, topics, *_: {t: {} for t in topics})
    return log


def owner(log: Log, state_bytes: int = 1 << 20) -> JoinPipeline:
    """A member of the group taking partition 0 over: nothing in memory, its state in the (shared) state log."""
    p = JoinPipeline.__new__(JoinPipeline)
    js = JoinerSettings()
    p.kafka, p.js, p.limits, p.state_topic = KAFKA, js, DEFAULT_LIMITS, STATE
    p.cfg = pipeline_module.JoinConfig(window_ms=10_000, lateness_ms=0, watermark_quorum=1)
    p.producer, p.dead_letters = log, SimpleNamespace(send=log.dead_letter)  # type: ignore[assignment]
    p.strikes = SimpleNamespace(counts={}, reload=lambda *_: None, forget=lambda *_: None)  # type: ignore[assignment]
    p.gc = SimpleNamespace(between_batches=lambda: 0.0)  # type: ignore[assignment]
    p.day_counts = SimpleNamespace(begin_batch=lambda: None, batch_done=lambda: None)  # type: ignore[assignment]
    p._record_redis = lambda res, imps: None  # type: ignore[method-assign]
    p._read_histories = lambda res: None  # type: ignore[method-assign]
    p._say_lost_state = lambda partitions: None  # type: ignore[method-assign]
    p.engines, p.totals, p._parts, p._followed, p._ids_asked = {}, JoinTotals(), {}, {}, {}
    p.started_over, p.clicks_held, p._last_click, p.awake = set(), set(), {}, awake_clock(js)
    p._held_list, p._held_groups, p._held_before, p.held_counts, p.processed, p._reached = [], {}, {}, {}, {}, {}
    p._joined_suspects, p._batch_records = [], {}
    p.sample_bytes = p.late_click_bytes = 1 << 20
    p.state_bytes, p.message_limits = state_bytes, {STATE: MessageLimit(state_bytes, "test")}
    p._topics_next = float("inf")  # (check_topics: no topic made again here)
    return p


def imp(offset: int, imp_id: str, ts: int, **context: object) -> Record:
    value = Impression(imp_id, ts, "u", "i", context=dict(context)).encode()  # type: ignore[arg-type]
    return Record(KAFKA.impressions_topic, 0, offset, imp_id.encode(), value)


def click(offset: int, imp_id: str, ts: int) -> Record:
    return Record(KAFKA.clicks_topic, 0, offset, imp_id.encode(), Click(imp_id, ts).encode())


def bad(topic: str, offset: int) -> Record:
    return Record(topic, 0, offset, b"k", b"{not json")


def read_again(log: Log, batch: list[Record], entry: str = "process") -> JoinPipeline:
    """``batch`` processed by one owner, then by the next (the offsets not committed: read again from the start);
    ``entry``: the kafka driver's call (``process``) or the faust driver's (``process_new``)."""
    getattr(owner(log), entry)(batch)
    again = owner(log)
    getattr(again, entry)(batch)
    return again


@pytest.mark.parametrize("entry", ["process", "process_new"])
def test_bad_records_after_the_last_good_one_of_their_input_are_dead_lettered_once_across_owners(
        log: Log, entry: str) -> None:
    """The state's offsets were the last good record's: a bad one after it was above them when read again."""
    batch = [imp(0, "a", T0), bad(KAFKA.impressions_topic, 1), click(0, "a", T0 + 1), bad(KAFKA.clicks_topic, 1)]
    again = read_again(log, batch, entry)
    assert sorted(log.dead) == sorted([(KAFKA.impressions_topic, 0, 1), (KAFKA.clicks_topic, 0, 1)])
    s = again.totals.summary()
    assert (s["dead_lettered"], s["redelivered_skipped"]) == (0, 4)


def test_a_batch_of_only_bad_records_makes_their_offsets_durable_and_they_are_dead_lettered_once(log: Log) -> None:
    """No good record: no join, so no state chunk was written, and the next owner dead-lettered them all again."""
    batch = [bad(KAFKA.impressions_topic, 0), bad(KAFKA.impressions_topic, 1), bad(KAFKA.clicks_topic, 0)]
    again = read_again(log, batch)
    assert sorted(log.dead) == sorted([(KAFKA.impressions_topic, 0, 0), (KAFKA.impressions_topic, 0, 1),
                                       (KAFKA.clicks_topic, 0, 0)])
    assert again.engines[0].offsets == [1, 0]
    s = again.totals.summary()
    assert (s["dead_lettered"], s["redelivered_skipped"]) == (0, 3)
    # and once a good record comes after them, it is joined as usual
    again.process([imp(2, "b", T0)])
    assert "b" in again.engines[0].pending and again.totals.summary()["dead_lettered"] == 0


def test_only_bad_records_after_good_batches_move_the_state_past_them(log: Log) -> None:
    """A partition with state already, whose next batch is all bad: its chunk moves the offsets past them."""
    first = owner(log)
    first.process([imp(0, "a", T0), click(0, "a", T0 + 1)])
    first.process([bad(KAFKA.impressions_topic, 1), bad(KAFKA.clicks_topic, 1)])
    again = owner(log)
    again.process([bad(KAFKA.impressions_topic, 1), bad(KAFKA.clicks_topic, 1)])
    assert sorted(log.dead) == sorted([(KAFKA.impressions_topic, 0, 1), (KAFKA.clicks_topic, 0, 1)])
    assert again.totals.summary()["redelivered_skipped"] == 2


def test_an_impression_whose_state_is_too_large_is_dead_lettered_once_when_it_is_the_last_record(log: Log) -> None:
    """Taken out of the batch's join (``_state_too_large``), it left the offsets at the good record before it."""
    big = imp(1, "big", T0 + 1, tags=[f"tag{i}" for i in range(1000)])
    batch = [imp(0, "a", T0), big]
    owner(log, state_bytes=4000).process(batch)
    again = owner(log, state_bytes=4000)
    again.process(batch)
    assert log.dead == [(KAFKA.impressions_topic, 0, 1)]
    s = again.totals.summary()
    assert (s["dead_lettered"], s["state_too_large"], s["redelivered_skipped"]) == (0, 0, 2)
    assert set(again.engines[0].pending) == {"a"}


class _Consumer:
    """What the kafka driver's batch and recovery ask of its consumer, with nothing assigned (batches are handed in)."""

    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def assignment(self) -> list[Any]:
        return []

    def committed(self, partitions: list[Any], timeout: float | None = None) -> list[Any]:
        return []

    def commit(self, **_: Any) -> None:
        pass

    def pause(self, _: Any) -> None:
        pass

    def resume(self, _: Any) -> None:
        pass


def kafka_driver(p: JoinPipeline, monkeypatch: pytest.MonkeyPatch) -> Callable[[list[Record]], object]:
    """``KafkaJoinWorker``'s batch step over ``p``: falsy where it failed and the worker rewound (``_recover``)."""
    monkeypatch.setattr(kafka_driver_module, "Consumer", _Consumer)
    w = kafka_driver_module.KafkaJoinWorker(p, KAFKA, p.js)
    w._backoff_s = 0.0  # no wait before the next batch
    return lambda batch: w._process(batch, None)


def faust_driver(p: JoinPipeline, monkeypatch: pytest.MonkeyPatch) -> Callable[[list[Record]], object]:
    """``FaustJoinWorker``'s batch step over ``p``: what it acknowledges, nothing where it failed and recovered."""
    monkeypatch.setattr(FaustJoinWorker, "_build_app", lambda _self: SimpleNamespace(consumer=SimpleNamespace(),
                                                                                 rebalancing=False))
    monkeypatch.setattr(FaustJoinWorker, "_die", staticmethod(lambda what, status=1: pytest.fail(what)))  # (os._exit)
    w = FaustJoinWorker(p, KAFKA, p.js)
    shutil.rmtree(w._datadir)
    w._behind = lambda kind, partition: False  # type: ignore[method-assign]  # (no consumer: every input read)
    return w._process


@pytest.mark.parametrize("driver", [kafka_driver, faust_driver])
def test_bad_records_of_a_batch_that_failed_are_dead_lettered_by_its_retry_not_skipped_as_redelivered(
        log: Log, monkeypatch: pytest.MonkeyPatch,
        driver: Callable[[JoinPipeline, pytest.MonkeyPatch], Callable[[list[Record]], object]]) -> None:
    """The failed try moved its engine's offsets past the bad records in memory (``handled``) and their dead letters
    were lost with the flush that failed (an outage: the driver recovers in the process and reads the batch again).
    Its recovery drops the join state, so the retry restores it from the state log, which the failed try never
    reached: the bad records are dead-lettered then. Kept in memory, the retry took them as redelivered and skipped
    them: the dead letters lost, in silence."""
    p = owner(log)
    step = driver(p, monkeypatch)
    batch = [imp(0, "a", T0), bad(KAFKA.impressions_topic, 1), click(0, "a", T0 + 1), bad(KAFKA.clicks_topic, 1)]
    log.lost = DeliveryFailed("the broker acknowledged nothing")
    assert not step(batch)  # failed: nothing processed, nothing committed
    assert log.dead == []  # its dead letters lost
    assert step(batch)
    assert sorted(log.dead) == sorted([(KAFKA.impressions_topic, 0, 1), (KAFKA.clicks_topic, 0, 1)])
    assert p.totals.summary()["redelivered_skipped"] == 0
    assert "a" in p.engines[0].pending


_COUNTERS = [("streamrec_events_total", {"stage": "join", "topic": "impressions"}),
             ("streamrec_events_total", {"stage": "join", "topic": "clicks"}),
             ("streamrec_join_samples_total", {"label": "1"}), ("streamrec_join_samples_total", {"label": "0"}),
             ("streamrec_join_clicks_total", {"outcome": "joined"}),
             ("streamrec_join_clicks_total", {"outcome": "orphan"}),
             ("streamrec_join_batches_failed_total", {})]
_TIMES = ("elapsed_s", "max_rss_mb", "process_s", "events_per_s", "stage_s")  # time spent: a failed try's too


def _counted(monkeypatch: pytest.MonkeyPatch,
             driver: Callable[[JoinPipeline, pytest.MonkeyPatch], Callable[[list[Record]], object]],
             fail_first: bool) -> tuple[dict[str, Any], list[float]]:
    """The summary's counts and the joiner's counters' increments of one worker that joins a batch (its first try
    failing at the producer's flush, ``fail_first``: an outage, recovered in the process and done again) and drains."""
    log = Log()  # a broker of its own: the run starts from no state
    monkeypatch.setattr(state_log_module, "read_to_end", log.read_to_end)
    monkeypatch.setattr(pipeline_module, "topic_identities", lambda kafka, topics, *_: {t: {} for t in topics})
    before = [REGISTRY.get_sample_value(name, labels) or 0.0 for name, labels in _COUNTERS]
    p = owner(log)
    step = driver(p, monkeypatch)
    batch = [imp(0, "a", T0), imp(1, "b", T0 + 2), bad(KAFKA.impressions_topic, 2), click(0, "a", T0 + 1),
             click(1, "nobody", T0 + 3), bad(KAFKA.clicks_topic, 2)]
    if fail_first:
        log.lost = DeliveryFailed("the broker acknowledged nothing")
        assert not step(batch)
    assert step(batch)
    p.drain()
    after = [REGISTRY.get_sample_value(name, labels) or 0.0 for name, labels in _COUNTERS]
    summary = {k: v for k, v in p.totals.summary().items() if k not in _TIMES}
    return summary, [a - b for a, b in zip(after, before, strict=True)]


@pytest.mark.parametrize("driver", [kafka_driver, faust_driver])
def test_a_batch_that_failed_once_counts_in_the_summary_and_the_counters_as_the_same_batch_without_the_failure(
        monkeypatch: pytest.MonkeyPatch,
        driver: Callable[[JoinPipeline, pytest.MonkeyPatch], Callable[[list[Record]], object]]) -> None:
    """Its first try joined the batch, sent its samples and dead letters, and failed at the flush before its state was
    durable: what it counted (impressions, clicks, samples, dead letters, ...) is dropped, and the retry counts them
    once. Counted at each try, the summary and the streamrec_join_* counters said twice what the samples topic held.
    The failed try is counted apart: batches_failed, streamrec_join_batches_failed_total."""
    clean, clean_counters = _counted(monkeypatch, driver, fail_first=False)
    retried, retried_counters = _counted(monkeypatch, driver, fail_first=True)
    assert (clean["impressions"], clean["clicks"], clean["dead_lettered"], clean["samples"]) == (2, 2, 2, 2)
    assert clean_counters == [2, 2, 1, 1, 1, 1, 0]
    tries = retried.pop("batches_failed", None), clean.pop("batches_failed", None)
    assert retried == clean  # events, samples, dead_lettered, ...: once
    assert retried_counters[:-1] == clean_counters[:-1]
    assert tries == (1, 0) and retried_counters[-1] == 1
