"""Neither driver's idle exit takes a stall for idleness. A joiner stopped past its group session (SIGSTOP,
a long GC pause, a swapping host) woke with its idle clock 12 s on: its first idle check ended the run at once and,
with ``--drain``, drained the joins it held, stale by then (the group had given its partitions to another member):
their pending impressions went out as samples labelled 0 although the new owner had joined their clicks (the
frozen-joiner fault test in tests/integration/test_faults.py, faust driver; the kafka driver had the same check)."""

from __future__ import annotations

import asyncio
import shutil
import signal
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from stream.idle_clock import IdleClock
from stream.joiner.worker import FaustJoinWorker
from stream.unfetched import Unfetched

SIGTERM_AT_S = 600.0  # run_kafka_worker's clock time at which a run still going is told to stop
HEARTBEAT_S = 1.0  # the default 6 s session's heartbeat interval (stream.kafka.heartbeat_interval_s)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def idle_worker(monkeypatch: pytest.MonkeyPatch, clock: Clock, drained: list[float],
                limit: float = 10.0) -> FaustJoinWorker:
    """A worker built as the joiner builds it (its idle clock too), with just what ``_idle_check`` reads: no records
    held, nothing paused, ``--exit-when-idle LIMIT --drain``; no faust app (that needs a broker)."""
    from stream.config import KafkaSettings
    from stream.joiner.config import JoinerSettings

    async def commit() -> None:
        return None

    monkeypatch.setattr(FaustJoinWorker, "_build_app", lambda _self: SimpleNamespace(
        consumer=SimpleNamespace(commit=commit, fetched_more=lambda _tp: False),  # every input read to its end
        rebalancing=False))
    pipeline = SimpleNamespace(held_counts={}, restore=lambda _p: None, drain=lambda: drained.append(clock.t),
                               awake=IdleClock(1.0, 0.0), take_started_over=set)  # (no input made again)
    w = FaustJoinWorker(pipeline, KafkaSettings(), JoinerSettings(exit_when_idle_s=limit,  # type: ignore[arg-type]
                                                                  drain_at_exit=True))
    shutil.rmtree(w._datadir)
    w._assigned, w._settled = {0}, True  # partition 0 assigned, no rebalance since
    return w


def tick_until(w: FaustJoinWorker, clock: Clock, end: float, every: float = 0.25) -> None:
    async def run() -> None:
        while clock.t < end and not w._stopping:
            clock.t += every
            await w._idle_check()
    asyncio.run(run())


def test_a_stall_past_the_idle_limit_is_not_idleness_and_idleness_counts_afresh_after_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock, drained = Clock(), list[float]()
    monkeypatch.setattr("time.monotonic", clock)
    w = idle_worker(monkeypatch, clock, drained)
    tick_until(w, clock, 3.0)  # ticking, idle for 3 s
    clock.t += 12.0  # the process stopped for 12 s
    asyncio.run(w._idle_check())
    assert drained == [] and not w._stopping  # the first check after it: no exit, no drain of stale joins
    woke = clock.t
    tick_until(w, clock, woke + 20.0)
    assert w._stopping and drained == [pytest.approx(woke + 10.0, abs=0.3)]  # 10 s of ticking idleness after it


def test_idleness_without_a_stall_ends_the_run_at_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, drained = Clock(), list[float]()
    monkeypatch.setattr("time.monotonic", clock)
    w = idle_worker(monkeypatch, clock, drained)
    tick_until(w, clock, 30.0)
    assert w._stopping and drained == [pytest.approx(10.0, abs=0.3)]


class StalledConsumer:
    """librdkafka's consumer as a member woken from a stall sees it: the first poll returns after the stall, with
    nothing, and the assignment still looks held; every later poll waits out its timeout."""

    def __init__(self, clock: Clock, stall_s: float, sigterm_at: float = float("inf"),
                 on_sigterm: Callable[[], None] = lambda: None) -> None:
        self.clock, self.stall_s = clock, stall_s
        self.sigterm_at, self.on_sigterm = sigterm_at, on_sigterm  # a run still going then is told to stop

    def subscribe(self, topics: list[str], **_: object) -> None:
        pass

    def consume(self, n: int, timeout: float) -> list[object]:
        self.clock.t += self.stall_s or timeout
        self.stall_s = 0.0
        if self.clock.t >= self.sigterm_at:
            self.on_sigterm()
        return []

    def assignment(self) -> list[object]:
        return [object()]

    def close(self) -> None:
        pass


def run_kafka_worker(monkeypatch: pytest.MonkeyPatch, clock: Clock, stall_s: float,
                     gate: Callable[[], set[object]] = set, limit: float = 10.0,
                     behind: Callable[[str, int], bool] | None = lambda _kind, _p: False,
                     status: int = 0, assigned: frozenset[int] = frozenset({0})) -> list[float]:
    """``KafkaJoinWorker.run`` with ``--exit-when-idle LIMIT --drain`` over a :class:`StalledConsumer` (its first poll
    returns after ``stall_s``, ``assigned`` the group's settled assignment), ``gate`` as its gate and ``behind`` saying
    which inputs have more to read (none: read to their end; None: the worker's own, over ``fetched_more`` as the test
    patched it), ending with ``status``; the clock times at which it drained."""
    from stream.config import KafkaSettings
    from stream.joiner import kafka_driver
    from stream.joiner.config import JoinerSettings

    drained = list[float]()
    monkeypatch.setattr(kafka_driver.time, "monotonic", clock)
    w = kafka_driver.KafkaJoinWorker(None, KafkaSettings(bootstrap_servers="127.0.0.1:9"),  # type: ignore[arg-type]
                                     JoinerSettings(exit_when_idle_s=limit, drain_at_exit=True))
    w.consumer.close()
    # a run not ended by the clock's SIGTERM_AT_S ends as SIGTERM ends it (no drain): a test of an exit fails, not hangs
    w.consumer = StalledConsumer(clock, stall_s=stall_s, sigterm_at=SIGTERM_AT_S,  # type: ignore[assignment]
                                 on_sigterm=lambda: w._on_signal(signal.SIGTERM, None))
    w.pipeline = SimpleNamespace(totals=SimpleNamespace(stage_s={"fetch": 0.0}), awake=IdleClock(1.0, 0.0),  # type: ignore[assignment]
                                 restore=lambda _p: None, drain=lambda: drained.append(clock.t),
                                 topics_due=lambda: False, take_started_over=set)  # (no input made again)
    monkeypatch.setattr(w, "_apply_gate", gate)
    if behind is not None:
        monkeypatch.setattr(w, "_behind", behind)
    w.unfetched = Unfetched(clock=clock)
    w._assigned, w._settled = set(assigned), True
    if not assigned:
        monkeypatch.setattr(w.consumer, "assignment", list)
    monkeypatch.setattr(w, "_commit", lambda: None)
    assert w.run() == status
    return drained


def test_the_kafka_drivers_run_puts_back_the_signal_dispositions_it_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its SIGTERM/SIGINT handlers stayed installed after the run: a later SIGTERM went to the finished worker, and
    pytest-xdist's ignored SIGINT was handled from then on, so a child started by a later test on that worker no
    longer inherited it ignored (the Ctrl-C replay test passed or failed by what ran before it)."""
    def ours(signum: int, frame: object) -> None:
        pass

    found = {signal.SIGTERM: signal.signal(signal.SIGTERM, ours), signal.SIGINT: signal.signal(signal.SIGINT,
                                                                                              signal.SIG_IGN)}
    try:
        run_kafka_worker(monkeypatch, Clock(), stall_s=0.0)
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == (ours, signal.SIG_IGN)
    finally:
        for sig, handler in found.items():
            signal.signal(sig, handler)


def test_the_kafka_driver_does_not_take_a_stall_for_idleness(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    drained = run_kafka_worker(monkeypatch, clock, stall_s=12.0)
    # woken at 12 s: the drain comes after 10 s of polls that brought nothing, not at the first one
    assert drained and drained[0] >= 12.0 + 10.0


def test_the_kafka_driver_does_not_take_a_stall_outside_its_fetch_for_idleness(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the fetch was timed: a stall that came after it (here while the gate asks the broker how far each input is
    read, a call of every idle round) was taken for the whole idle limit at once and the stale joins drained."""
    from stream.joiner.config import JoinerSettings

    clock, stalls = Clock(), [12.0]

    def gate_stalls_once() -> set[object]:
        clock.t += stalls.pop() if stalls else 0.0
        return set()

    drained = run_kafka_worker(monkeypatch, clock, stall_s=0.0, gate=gate_stalls_once)
    first_fetch = JoinerSettings().batch_within_s
    assert drained and drained[0] >= first_fetch + 12.0 + 10.0


@pytest.mark.parametrize("limit", [0.1, 0.5])
def test_an_idle_limit_under_a_heartbeat_still_waits_two_heartbeats_after_a_stall_kafka_driver(
        monkeypatch: pytest.MonkeyPatch, limit: float) -> None:
    """Idleness restarted at 0 after a stall, so a limit under a heartbeat (``--exit-when-idle 0.1``) ended the run
    at the first idle poll after it, before the heartbeat that tells the member its partitions are gone: the drain of
    stale joins the stall check exists to prevent."""
    clock = Clock()
    drained = run_kafka_worker(monkeypatch, clock, stall_s=12.0, limit=limit)
    assert drained and drained[0] >= 12.0 + 2 * HEARTBEAT_S


@pytest.mark.parametrize("limit, in_hand", [(0.1, False), (0.5, False), (0.3, True)])
def test_an_idle_limit_under_a_heartbeat_still_waits_two_heartbeats_after_a_stall_faust_driver(
        monkeypatch: pytest.MonkeyPatch, limit: float, in_hand: bool) -> None:
    clock, drained = Clock(), list[float]()
    monkeypatch.setattr("time.monotonic", clock)
    w = idle_worker(monkeypatch, clock, drained, limit=limit)
    clock.t += 12.0  # stopped for 12 s
    asyncio.run(w._idle_check())
    assert drained == [] and not w._stopping
    woke = clock.t
    if in_hand:  # records fetched before the stall, handed on before the heartbeat that says they are gone
        w._in_hand(3)
        w._in_hand(0)
    tick_until(w, clock, woke + 20.0)
    assert w._stopping and drained[0] >= woke + 2 * HEARTBEAT_S - 1e-9


@pytest.mark.parametrize("failing", ["drain", "commit"])
def test_a_drain_or_last_commit_failing_at_the_idle_exit_fails_the_run_instead_of_ending_it_as_idle(
        monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    """The faust driver's idle exit caught a failure of its drain or its last commit and ended the run with status 1
    and a summary saying "reason": "input idle", as if complete; the kafka driver's run raises it (no summary). Now
    the faust driver's run raises it too, once faust has stopped."""
    from stream.redis_client import RedisFailure

    clock, drained = Clock(), list[float]()
    monkeypatch.setattr("time.monotonic", clock)
    w = idle_worker(monkeypatch, clock, drained)
    lost = RedisFailure("Redis at localhost:6379 is unreachable")

    def fail() -> None:
        raise lost

    async def fail_commit() -> None:
        raise lost

    if failing == "drain":
        w.pipeline.drain = fail
    else:
        w.app.consumer.commit = fail_commit
    stopped: list[int] = []

    class Faust:  # faust's worker as the idle exit drives it: its checks tick until the exit shuts it down
        def _schedule_shutdown(self, signum: int) -> None:
            stopped.append(signum)

        def execute_from_commandline(self) -> None:
            tick_until(w, clock, 30.0)
            raise SystemExit(0)  # faust's shutdown after the SIGTERM path

    monkeypatch.setattr(w, "_faust_worker", Faust)
    with pytest.raises(RedisFailure) as info:
        w.run()
    assert info.value is lost and stopped == [signal.SIGTERM]
