"""The broker calls that can block for their whole timeout before a reader's first stop check (``watermarks``'
metadata and offset requests, ``read_to_end``'s metadata request; the refresh's holdout read calls both): with a
``between`` stop check they ask the broker in short tries, with the check between tries, so a stop the refresh kept
pending ends them within one try, not after up to 10 s (holdout_timeout_s for the watermarks). The overall timeout
stays what it was. Pure loop logic over a fake consumer and a fake clock: no broker."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from stream import kafka
from stream.config import KafkaSettings


class Stopped(Exception):
    pass


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class UnansweredBroker:
    """A consumer whose broker never answers: every request waits its whole timeout (on the fake clock), then fails
    as librdkafka's do with the broker down (``_TRANSPORT`` for metadata, ``_ALL_BROKERS_DOWN`` for offsets)."""

    def __init__(self, clock: Clock, metadata_answers: bool = False) -> None:
        self.clock, self.metadata_answers = clock, metadata_answers
        self.timeouts: list[tuple[str, float]] = []

    def list_topics(self, topic: str, timeout: float) -> Any:
        self.timeouts.append(("metadata", timeout))
        if not self.metadata_answers:
            self.clock.now += timeout
            raise KafkaException(KafkaError(KafkaError._TRANSPORT))

        class Md:
            error = None
            partitions = {0: None, 1: None, 2: None}

        class Topics:
            topics = {topic: Md()}

        return Topics()

    def get_watermark_offsets(self, tp: Any, timeout: float) -> tuple[int, int]:
        self.timeouts.append(("offsets", timeout))
        self.clock.now += timeout
        raise KafkaException(KafkaError(KafkaError._ALL_BROKERS_DOWN))

    def assign(self, partitions: Any) -> None:
        raise AssertionError("assigned after the stop")

    def close(self) -> None:
        pass


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(kafka.time, "monotonic", c.monotonic)
    return c


def _stop_at_first_check() -> None:
    raise Stopped


def test_a_stop_checked_between_tries_ends_an_unanswered_watermarks_metadata_request_within_one_short_try(
        monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    broker = UnansweredBroker(clock)
    monkeypatch.setattr(kafka, "new_consumer", lambda *a, **k: broker)
    with pytest.raises(Stopped):
        kafka.watermarks(KafkaSettings(), "samples", 30.0, between=_stop_at_first_check)
    assert broker.timeouts == [("metadata", kafka.BROKER_TRY_S)]  # one short try, not the whole 30 s


def test_a_stop_checked_between_tries_ends_an_unanswered_watermark_offsets_request_within_one_short_try(
        monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    broker = UnansweredBroker(clock, metadata_answers=True)
    monkeypatch.setattr(kafka, "new_consumer", lambda *a, **k: broker)
    with pytest.raises(Stopped):
        kafka.watermarks(KafkaSettings(), "samples", 30.0, between=_stop_at_first_check)
    assert broker.timeouts == [("metadata", kafka.BROKER_TRY_S), ("offsets", kafka.BROKER_TRY_S)]


def test_a_stop_checked_between_tries_ends_read_to_ends_unanswered_metadata_request_within_one_short_try(
        monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    broker = UnansweredBroker(clock)
    monkeypatch.setattr(kafka, "new_consumer", lambda *a, **k: broker)
    with pytest.raises(Stopped):
        kafka.read_to_end(KafkaSettings(), "samples", lambda m: None, timeout_s=60.0, between=_stop_at_first_check)
    assert broker.timeouts == [("metadata", kafka.BROKER_TRY_S)]  # not the 10 s of its metadata timeout


@pytest.mark.parametrize("reader", ["watermarks", "read_to_end"])
def test_broker_calls_asked_in_short_tries_keep_their_whole_timeout_and_error(
        monkeypatch: pytest.MonkeyPatch, clock: Clock, reader: str) -> None:
    broker = UnansweredBroker(clock)
    monkeypatch.setattr(kafka, "new_consumer", lambda *a, **k: broker)
    checks: list[float] = []
    start = clock.now
    with pytest.raises(KafkaException) as err:
        if reader == "watermarks":
            kafka.watermarks(KafkaSettings(), "samples", 7.3, between=lambda: checks.append(clock.now))
        else:
            kafka.read_to_end(KafkaSettings(), "samples", lambda m: None, timeout_s=60.0,
                              between=lambda: checks.append(clock.now))
    assert err.value.args[0].code() == KafkaError._TRANSPORT  # the broker's own error, as before
    whole = 7.3 if reader == "watermarks" else 10.0
    assert clock.now - start == pytest.approx(whole)  # the same overall timeout
    assert all(t <= kafka.BROKER_TRY_S for _, t in broker.timeouts)
    assert len(checks) == len(broker.timeouts) - 1  # checked between every two tries


def test_without_a_stop_check_a_broker_call_is_one_request_with_its_whole_timeout(
        monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    broker = UnansweredBroker(clock)
    monkeypatch.setattr(kafka, "new_consumer", lambda *a, **k: broker)
    with pytest.raises(KafkaException):
        kafka.watermarks(KafkaSettings(), "samples", 7.3)
    assert broker.timeouts == [("metadata", 7.3)]


def test_the_holdout_read_passes_its_stop_check_to_the_watermarks(
        monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    from cache_refresh import validate

    broker = UnansweredBroker(clock)
    monkeypatch.setattr(kafka, "new_consumer", lambda *a, **k: broker)
    with pytest.raises(Stopped):
        validate.read_holdout(KafkaSettings(), 100, 30.0, between=_stop_at_first_check)
    assert broker.timeouts == [("metadata", kafka.BROKER_TRY_S)]


class SlowBroker(UnansweredBroker):
    """A broker that answers every request, after ``rtt`` seconds (on the fake clock): a try shorter than that times
    out as librdkafka's does with the broker up but slow (``_TIMED_OUT``), and its answer is lost with it."""

    def __init__(self, clock: Clock, rtt: float) -> None:
        super().__init__(clock, metadata_answers=True)
        self.rtt = rtt

    def _wait(self, timeout: float) -> None:
        self.clock.now += min(timeout, self.rtt)
        if timeout < self.rtt:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT))

    def list_topics(self, topic: str, timeout: float) -> Any:
        self._wait(timeout)
        return super().list_topics(topic, timeout)

    def get_watermark_offsets(self, tp: Any, timeout: float) -> tuple[int, int]:
        self.timeouts.append(("offsets", timeout))
        self._wait(timeout)
        return (0, 5)


def test_a_broker_slower_than_a_short_try_still_answers_within_the_whole_timeout_when_no_stop_comes(
        monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    """Each short try re-asked a request the slow broker had not answered yet: with every answer taking 0.8 s, every
    0.5 s try timed out and watermarks() failed with _TIMED_OUT after its 10 s, where one request answered in 0.8 s."""
    broker = SlowBroker(clock, rtt=0.8)
    monkeypatch.setattr(kafka, "new_consumer", lambda *a, **k: broker)
    start = clock.now
    assert kafka.watermarks(KafkaSettings(), "samples", 10.0, between=lambda: None) == {p: (0, 5) for p in range(3)}
    assert clock.now - start < 10.0
