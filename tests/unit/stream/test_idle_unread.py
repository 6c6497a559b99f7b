"""Neither driver's idle exit ends a bounded run with input it has not read. The faust driver's idle clock ran while
the worker held no partition (a rebalance: revoked, the group's next generation not formed yet; a group join slower
than the limit under load) and while an assigned input had not been fetched yet, or had more to read than its
batches had brought: ``--exit-when-idle 4 --drain`` could end the run there, its pending impressions drained as 0s
with their clicks unread (seen once: the fake_negative policy's faust run in tests/integration/test_join_policies.py
with no delayed positive). Both drivers now count idleness only outside a rebalance and once every assigned input is
read to its end, by the high watermark its fetcher saw (``backpressure.unread``; an input never fetched counts as
unread for ``Unfetched``'s grace, so a partition whose fetch keeps failing cannot keep a run from ending, and a run
that ends idle with one ends with status 1, undrained: ``backpressure.never_fetched``)."""

from __future__ import annotations

import pytest

from stream.joiner.backpressure import CLICKS
from stream.joiner.config import JoinerSettings
from stream.unfetched import UNFETCHED_GRACE_S, Unfetched
from tests.unit.stream.test_idle_stall import Clock, idle_worker, run_kafka_worker, tick_until

LIMIT_S = 10.0  # idle_worker's and run_kafka_worker's --exit-when-idle


def clicks_unread_until(clock: Clock, end: float, before: bool | None) -> object:
    """A fetcher's ``fetched_more`` for a worker's inputs: clicks ``before`` (True: more to read, None: not fetched
    yet) until ``end``, then read to their end; impressions read to their end throughout."""
    def fetched_more(tp: tuple[str, int]) -> bool | None:
        return before if tp[0] == "clicks" and clock.t < end else False
    return fetched_more


def test_the_faust_driver_does_not_exit_idle_during_a_rebalance(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, drained = Clock(), list[float]()
    monkeypatch.setattr("time.monotonic", clock)
    w = idle_worker(monkeypatch, clock, drained)
    w.app.consumer.fetched_more = clicks_unread_until(clock, 0.0, None)
    w._assigned, w._settled = set(), False  # a rebalance under way: revoked, not assigned again yet
    tick_until(w, clock, 30.0)
    assert drained == [] and not w._stopping
    w._assigned, w._settled = {0}, True  # assigned at 30 s, everything read already
    tick_until(w, clock, 60.0)
    assert w._stopping and drained == [pytest.approx(30.0 + LIMIT_S, abs=0.3)]


def test_the_faust_driver_does_not_exit_idle_once_faust_says_a_rebalance_started(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """faust's flag comes first (aiokafka's listener sets it), the revocation signal only after faust's own work."""
    clock, drained = Clock(), list[float]()
    monkeypatch.setattr("time.monotonic", clock)
    w = idle_worker(monkeypatch, clock, drained)
    w.app.rebalancing = True
    tick_until(w, clock, 30.0)
    assert drained == [] and not w._stopping
    w.app.rebalancing = False  # the flow resumed at 30 s
    tick_until(w, clock, 60.0)
    assert w._stopping and drained == [pytest.approx(30.0 + LIMIT_S, abs=0.3)]


def test_a_faust_member_assigned_no_partition_exits_idle_once_its_empty_assignment_came(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """More workers than partitions: a member assigned nothing took that for a rebalance under way for good, and its
    bounded run never ended."""
    clock, drained = Clock(), list[float]()
    monkeypatch.setattr("time.monotonic", clock)
    w = idle_worker(monkeypatch, clock, drained)
    w._assigned = set()  # the group's generation gave it nothing
    tick_until(w, clock, 30.0)
    assert w._stopping and drained == [pytest.approx(LIMIT_S, abs=0.3)]


def test_the_faust_driver_does_not_exit_idle_before_every_assigned_input_is_read_to_its_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Clicks with more to read until 25 s: idleness counts from 25 s."""
    clock, drained = Clock(), list[float]()
    monkeypatch.setattr("time.monotonic", clock)
    w = idle_worker(monkeypatch, clock, drained)
    w.unfetched = Unfetched(clock=clock)
    w.app.consumer.fetched_more = clicks_unread_until(clock, 25.0, True)
    tick_until(w, clock, 60.0)
    assert w._stopping and w.exit_code == 0 and drained == [pytest.approx(25.0 + LIMIT_S, abs=0.3)]


def test_the_faust_driver_ends_a_bounded_run_with_status_1_undrained_when_an_input_is_never_fetched(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Clicks never fetched (every fetch fails): the run ends once their grace (from the first idle check) and the
    limit have passed, so a partition whose fetch keeps failing does not keep it from ending; but it ended idle,
    status 0, and drained their impressions as 0s over clicks never read."""
    clock, drained = Clock(), list[float]()
    monkeypatch.setattr("time.monotonic", clock)
    w = idle_worker(monkeypatch, clock, drained)
    w.unfetched = Unfetched(clock=clock)
    w.app.consumer.fetched_more = clicks_unread_until(clock, float("inf"), None)
    tick_until(w, clock, 60.0)
    assert w._stopping and clock.t == pytest.approx(UNFETCHED_GRACE_S + LIMIT_S, abs=0.3)
    assert w.exit_code == 1 and drained == [] and "[('clicks', 0)] were never fetched" in caplog.text


def test_the_kafka_driver_does_not_exit_idle_before_every_assigned_input_is_read_to_its_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its polls bring nothing while the clicks' fetcher says there is more (a fetch slower than the limit): it ended
    the run at the limit all the same."""
    clock = Clock()
    drained = run_kafka_worker(monkeypatch, clock, stall_s=0.0,
                               behind=lambda kind, _p: kind == CLICKS and clock.t < 25.0)
    round_s = JoinerSettings().batch_within_s  # idleness counts from the last round that found them unread
    assert drained and drained[0] >= 25.0 - round_s + LIMIT_S


def test_the_kafka_driver_ends_a_bounded_run_with_status_1_undrained_when_an_input_is_never_fetched(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Every fetch of the clicks fails (their end never known): past their grace they stopped counting as unread and
    the run ended idle, status 0, its impressions drained as 0s over clicks never read."""
    from stream.joiner import kafka_driver

    clock = Clock()
    monkeypatch.setattr(kafka_driver, "fetched_more",
                        lambda _c, topic, _p, _start: None if topic == "clicks" else False)
    drained = run_kafka_worker(monkeypatch, clock, stall_s=0.0, behind=None, status=1)
    assert drained == []
    assert "[('clicks', 0)] were never fetched" in caplog.text


def test_a_kafka_member_assigned_no_partition_exits_idle_once_its_empty_assignment_came(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """More workers than partitions: it left its loop only while it held an assignment, so its bounded run never ended
    beside a member that kept running (tests/integration/test_idle_exit.py against the real broker)."""
    clock = Clock()
    drained = run_kafka_worker(monkeypatch, clock, stall_s=0.0, assigned=frozenset())
    assert drained and drained[0] == pytest.approx(LIMIT_S, abs=JoinerSettings().batch_within_s)
