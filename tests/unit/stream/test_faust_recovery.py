"""The faust join driver recovers from an infrastructure failure in the process, as the kafka driver does
(stream/joiner/worker.py, module docstring): a batch that fails because Redis or the broker is away reports nothing
processed and drops the join state and what is held (faust's consumer then drops the hand and seeks back to the
committed offsets: tests/unit/stream/test_faust_delivery.py), and the consumer waits a doubling backoff before it
fetches again; any other failure still ends the process before anything is acknowledged. Against real Redis:
tests/integration/test_faults.py (the Redis restart, ``-m slow`` for faust)."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import redis

from stream.idle_clock import IdleClock
from stream.joiner.worker import FaustJoinWorker
from stream.strikes import RECOVERY_BACKOFF_S


class _Died(Exception):
    pass


def _worker(monkeypatch: pytest.MonkeyPatch, fail: list[BaseException]) -> tuple[FaustJoinWorker, SimpleNamespace]:
    """A worker over a fake pipeline whose next batches raise what ``fail`` holds, in turn (then succeed)."""
    from stream.config import KafkaSettings
    from stream.joiner.config import JoinerSettings

    monkeypatch.setattr(FaustJoinWorker, "_build_app", lambda _self: SimpleNamespace(consumer=SimpleNamespace(),
                                                                                 rebalancing=False))
    monkeypatch.setattr(FaustJoinWorker, "_die", staticmethod(lambda what, status=1: (_ for _ in ()).throw(
        _Died(status))))
    calls: dict[str, list] = {"forget": [], "drop_held": [], "close": []}

    def process_new(records: list, behind: object) -> None:
        if fail:
            raise fail.pop(0)
        pipeline.processed = {("impressions", 0): 10}

    pipeline = SimpleNamespace(
        held_counts={("clicks", 0): 3}, engines={0: object(), 1: object()}, processed={}, restore=lambda _p: None,
        process_new=process_new, waiting=lambda: {}, input_times=lambda: {}, held_per_input=lambda: {},
        forget=calls["forget"].append, drop_held=calls["drop_held"].append, awake=IdleClock(1.0, 0.0),
        close=lambda: calls["close"].append(True), take_started_over=set,  # (no input made again)
        check_topics=lambda: None)
    w = FaustJoinWorker(pipeline, KafkaSettings(), JoinerSettings())  # type: ignore[arg-type]
    shutil.rmtree(w._datadir)
    w._assigned, w._settled = {0, 1}, True  # partitions 0 and 1 assigned, no rebalance since
    w._behind = lambda kind, partition: False  # type: ignore[method-assign]
    return w, SimpleNamespace(**calls)


def test_a_batch_failing_for_want_of_redis_reports_nothing_processed_drops_the_state_and_backs_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    down = redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
    w, calls = _worker(monkeypatch, [down, redis.TimeoutError("Timeout reading from socket")])
    assert w._process([]) == {}  # nothing acknowledged: the consumer seeks back to the committed offsets
    assert calls.forget == [{0, 1}] and calls.drop_held == [{("clicks", 0)}]  # restored from the state log next
    assert (w.recoveries, w._wait_s(), w._wait_s()) == (1, RECOVERY_BACKOFF_S[0], 0.0)  # one wait, once
    assert w._process([]) == {}
    assert (w.recoveries, w._wait_s()) == (2, 2 * RECOVERY_BACKOFF_S[0])  # doubling
    assert w._process([]) == {("impressions", 0): 10}  # Redis is back
    assert w._wait_s() == 0.0 and w._backoff_s == RECOVERY_BACKOFF_S[0]  # and the next failure waits 1 s again


def test_the_backoff_stops_doubling_at_its_longest(monkeypatch: pytest.MonkeyPatch) -> None:
    w, _ = _worker(monkeypatch, [redis.ConnectionError("refused") for _ in range(8)])
    waits = []
    for _ in range(8):
        w._process([])
        waits.append(w._wait_s())
    assert waits == [min(RECOVERY_BACKOFF_S[1], RECOVERY_BACKOFF_S[0] * 2 ** i) for i in range(8)]
    assert max(waits) == RECOVERY_BACKOFF_S[1]


@pytest.mark.parametrize("exc", [ValueError("a bug"), redis.ResponseError("WRONGTYPE Operation against a key")],
                         ids=["bug", "message_fault"])
def test_a_batch_failing_for_any_other_reason_still_ends_the_process_unacknowledged(
        monkeypatch: pytest.MonkeyPatch, exc: Exception) -> None:
    w, calls = _worker(monkeypatch, [exc])
    with pytest.raises(_Died):
        w._process([])
    assert w.recoveries == 0 and calls.forget == []
    # the day counts of the batches already durable written first (the pipeline's close), as the kafka driver does
    assert calls.close == [True]


def test_a_crash_exit_goes_on_when_the_day_counts_cannot_be_written(monkeypatch: pytest.MonkeyPatch) -> None:
    w, calls = _worker(monkeypatch, [ValueError("a bug")])

    def close() -> None:
        raise redis.ConnectionError("Connection refused")

    w.pipeline.close = close  # type: ignore[method-assign]
    with pytest.raises(_Died) as died:
        w._process([])
    assert died.value.args == (1,)


@pytest.mark.parametrize("stopped_by", [KeyboardInterrupt, SystemExit])
def test_a_crash_exit_goes_on_when_the_last_counts_flush_is_interrupted(monkeypatch: pytest.MonkeyPatch,
                                                                     stopped_by: type[BaseException]) -> None:
    """The flush before the exit blocks on Redis; a KeyboardInterrupt (a second Ctrl-C where Python's own handler is
    in place) or a SystemExit out of it escaped past os._exit: the batch's exception gone, and faust, not the
    worker, deciding what happens to the batch in hand."""
    w, calls = _worker(monkeypatch, [ValueError("a bug")])

    def close() -> None:
        raise stopped_by()

    w.pipeline.close = close  # type: ignore[method-assign]
    with pytest.raises(_Died) as died:
        w._process([])
    assert died.value.args == (1,)


def test_a_run_that_exits_when_idle_does_not_end_during_a_recoverys_wait_but_after_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the recovery reset the idle clock and faust's consumer then slept the backoff while the idle timer kept ticking:
    # with exit_when_idle_s under the wait the run ended (drained, committed) before the rewound records were read
    # again, their pending impressions drained as label-0 samples (the kafka driver counts idleness from the wait's end)
    import asyncio
    import time

    from stream.joiner.config import JoinerSettings

    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    w, _ = _worker(monkeypatch, [redis.ConnectionError("refused")])
    w.js = JoinerSettings(exit_when_idle_s=0.5)
    w.pipeline.held_counts = {}

    def ticks(seconds: float) -> bool:  # the idle timer's ticks over ``seconds``: whether the run ended
        for _ in range(int(seconds / 0.25)):
            clock[0] += 0.25
            asyncio.run(w._idle_check())
        return w._stopping

    assert w._process([]) == {}
    assert not ticks(0.75)  # the failed batch returned, its wait not taken yet by the consumer
    wait = w._wait_s()  # the consumer sleeps it now
    assert wait == RECOVERY_BACKOFF_S[0] and not ticks(wait)
    assert ticks(0.75)  # nothing came after the wait: idle, the run ends


def test_a_rebalance_bringing_partitions_the_topics_disagree_on_stops_the_worker_with_status_2(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from faust.types import TP

    from stream.errors import ConfigError

    w, _ = _worker(monkeypatch, [])

    def assigned(partitions: object) -> None:
        raise ConfigError("topic impressions has 8 partitions and topic clicks has 4")

    w.pipeline.layout = SimpleNamespace(assigned=assigned)  # type: ignore[attr-defined]
    with pytest.raises(_Died) as died:
        asyncio.run(w._on_assigned(None, {TP("impressions", 7)}))
    assert died.value.args == (2,)


def test_a_rebalance_whose_layout_check_the_broker_cannot_answer_stops_the_worker_with_status_1(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the check's admin metadata request timing out raised out of faust's signal handler (a traceback, faust's crash)
    import asyncio

    from confluent_kafka import KafkaError, KafkaException
    from faust.types import TP

    w, _ = _worker(monkeypatch, [])

    def assigned(partitions: object) -> None:
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "list_topics(): timed out"))

    w.pipeline.layout = SimpleNamespace(assigned=assigned)  # type: ignore[attr-defined]
    with pytest.raises(_Died) as died:
        asyncio.run(w._on_assigned(None, {TP("impressions", 7)}))
    assert died.value.args == (1,) and w._assigned == {0, 1}  # (the fixture's): nothing of the assignment taken


@pytest.mark.parametrize("status", [2, 1], ids=["topics_disagree", "broker_cannot_say"])
def test_a_rebalance_that_stops_the_worker_writes_the_day_counts_of_the_durable_batches_first(
        monkeypatch: pytest.MonkeyPatch, status: int) -> None:
    # os._exit skips every finally: the day counts buffered for batches already durable and committed were lost
    # (never counted again: their offsets are committed), where the kafka driver's layout failure raises through the
    # CLI, whose close writes them, and the faust driver's crash exit in a batch writes them too (_close_pipeline)
    import asyncio

    from confluent_kafka import KafkaError, KafkaException
    from faust.types import TP

    from stream.errors import ConfigError

    w, calls = _worker(monkeypatch, [])
    error = (ConfigError("topic impressions has 8 partitions and topic clicks has 4") if status == 2
             else KafkaException(KafkaError(KafkaError._TIMED_OUT, "list_topics(): timed out")))

    def assigned(partitions: object) -> None:
        raise error

    w.pipeline.layout = SimpleNamespace(assigned=assigned)  # type: ignore[attr-defined]
    with pytest.raises(_Died) as died:
        asyncio.run(w._on_assigned(None, {TP("impressions", 7)}))
    assert died.value.args == (status,) and calls.close == [True]


def test_a_faust_run_that_crashed_is_not_summarised_as_stopped_by_a_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A service of faust's worker that crashes (outside a batch: ``_die`` covers those) ends
    ``execute_from_commandline`` as mode's ``exiting`` does, SystemExit(1), not by raising: the run returns 1 and
    ``streamrec join`` writes its summary. Its reason said "signal" (``_stopping`` is only the idle exit's), an
    operator's stop for a crash."""
    import asyncio

    from mode import Service, Worker

    class Crashing(Service):
        async def on_start(self) -> None:
            raise RuntimeError("a consumer thread died")

    w, _ = _worker(monkeypatch, [])
    loop = asyncio.new_event_loop()
    monkeypatch.setattr(w, "_faust_worker", lambda: Worker(Crashing(loop=loop), loop=loop, quiet=True,
                                                           override_logging=False, redirect_stdouts=False))
    assert w.run() == 1
    assert w.stop_reason != "signal"
