"""HoldBound: a join driver pauses an input for the records it holds past the frontier, with hysteresis, so a
replay's leading input is not paused and resumed (its prefetched messages purged and fetched again) every batch; and
InputPauses, what both drivers keep paused for the gate and for the hold."""

from __future__ import annotations

import pytest

from stream.joiner.backpressure import (
    CLICKS,
    HOLD_BATCHES,
    HOLD_BUDGET,
    IMPRESSIONS,
    HoldBound,
    InputGate,
    InputPauses,
    hold_bounds,
)
from tests.joiner_stubs import assigning_pipeline


def test_an_input_is_paused_at_the_high_mark_and_stays_paused_until_the_low_mark() -> None:
    bound = HoldBound(high=400, low=100)
    imp = (IMPRESSIONS, 0)
    assert bound.update({imp: 399}) == set()
    assert bound.update({imp: 400}) == {imp}
    # the frontier passes some of the held records: still paused above the low mark (a plain threshold at 400
    # would resume here, purging what the consumer prefetched, and pause again with the next fetch)
    assert bound.update({imp: 399}) == {imp}
    assert bound.update({imp: 101}) == {imp}
    assert bound.update({imp: 100}) == set()
    assert bound.update({imp: 399}) == set()  # resumed: read on until the high mark again


def test_inputs_no_longer_holding_anything_are_resumed_and_others_are_independent() -> None:
    bound = HoldBound(high=10, low=2)
    assert bound.update({(IMPRESSIONS, 0): 12, (CLICKS, 1): 11}) == {(IMPRESSIONS, 0), (CLICKS, 1)}
    # partition 1's held records were dropped (revoked, or the worker rewound): absent means none held
    assert bound.update({(IMPRESSIONS, 0): 5}) == {(IMPRESSIONS, 0)}
    assert bound.update({}) == set()


def test_the_marks_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="low < high"):
        HoldBound(high=5, low=5)


def test_pauses_a_driver_makes_for_its_hold_are_counted_with_the_gates_own() -> None:
    gate = InputGate(cap=100, max_drift_ms=None)
    gate.count({(IMPRESSIONS, 0), (IMPRESSIONS, 1)}, set())
    gate.count({(CLICKS, 2)}, {(IMPRESSIONS, 0)})
    assert gate.pauses == {IMPRESSIONS: 2, CLICKS: 1}
    assert gate.paused == set()  # counted only: what the gate itself pauses is unchanged


@pytest.mark.parametrize(("cap", "batch"), [(100, 20), (100_000, 5000), (1000, 7), (10, 5)])
def test_held_clicks_stay_within_the_waiting_caps_margin_while_impressions_get_the_full_bound(cap: int,
                                                                                              batch: int) -> None:
    # Held clicks join into the waiting ones once the frontier passes them, past the gate's pause: the waiting count
    # at the gate's high mark plus every held click must stay within the cap.
    gate = InputGate(cap=cap, max_drift_ms=None, headroom=batch)
    bounds = hold_bounds(batch, 1, gate)
    assert (bounds[IMPRESSIONS].high, bounds[IMPRESSIONS].low) == (HOLD_BATCHES * batch, HOLD_BATCHES * batch // 4)
    clicks = bounds[CLICKS]
    assert gate.high + clicks.high <= cap or clicks.high == 2
    assert 0 < clicks.low < clicks.high
    # the clicks' bound pauses at its own high mark, not the impressions'
    key = (CLICKS, 0)
    assert clicks.update({key: clicks.high - 1}) == set()
    assert clicks.update({key: clicks.high}) == {key}


@pytest.mark.parametrize("partitions", [1, 4, 5, 16, 64, 65, 1000])
def test_a_worker_with_more_partitions_holds_fewer_batches_each_within_its_budget(partitions: int) -> None:
    batch = 5000
    high = hold_bounds(batch, partitions, InputGate(cap=100_000, max_drift_ms=None, headroom=batch))[IMPRESSIONS].high
    assert high % batch == 0 and batch <= high <= HOLD_BATCHES * batch
    # within the worker's budget, except that a partition may always hold one batch
    assert partitions * high <= max(HOLD_BUDGET, partitions) * batch
    if partitions <= HOLD_BUDGET // HOLD_BATCHES:
        assert high == HOLD_BATCHES * batch  # a few partitions: the full bound each


def test_the_kafka_worker_sizes_its_hold_for_each_assignment() -> None:
    from confluent_kafka import OFFSET_INVALID, TopicPartition

    from stream.config import KafkaSettings
    from stream.joiner.config import JoinerSettings
    from stream.joiner.kafka_driver import KafkaJoinWorker

    class Consumer:  # what _on_assign asks of the consumer: the committed offsets (none here), then the assignment
        def committed(self, partitions: list, timeout: float) -> list:
            return [TopicPartition(tp.topic, tp.partition, OFFSET_INVALID) for tp in partitions]

        def assign(self, partitions: list) -> None:
            self.assigned = partitions

    kafka, js = KafkaSettings(bootstrap_servers="127.0.0.1:1"), JoinerSettings()
    worker = KafkaJoinWorker(assigning_pipeline(), kafka, js)  # type: ignore[arg-type]  # only the layout is used
    try:
        def assign(n: int) -> int:
            worker._assigned.clear()  # as a revocation leaves it
            worker._on_assign(Consumer(), [TopicPartition(t, p) for p in range(n)  # type: ignore[arg-type]
                                           for t in (kafka.impressions_topic, kafka.clicks_topic)])
            return worker.pauses.bounds[IMPRESSIONS].high // js.batch_max

        assert assign(4) == HOLD_BATCHES
        assert assign(32) == HOLD_BUDGET // 32
        assert assign(1000) == 1
    finally:
        worker.consumer.close()


def test_a_driver_pauses_what_the_gate_or_the_hold_wants_and_resumes_the_rest_counting_only_the_holds_pauses() -> None:
    gate = InputGate(cap=100, max_drift_ms=None, headroom=10)
    pauses = InputPauses(gate, batch_max=10)
    high = pauses.bounds[IMPRESSIONS].high  # 16 batches of 10 held: one partition assigned
    imp0, clk1 = (IMPRESSIONS, 0), (CLICKS, 1)
    gate.paused = {clk1}  # the gate's own pause (it counts those itself)
    assert pauses.sync({imp0: high}) == ({imp0, clk1}, set())
    assert gate.pauses == {IMPRESSIONS: 1, CLICKS: 0}  # the hold's pause counted; the gate's not twice
    assert pauses.sync({imp0: high}) == (set(), set())  # nothing changed: nothing to do
    gate.paused = set()
    assert pauses.sync({imp0: high // 4}) == (set(), {imp0, clk1})  # at the low mark, and the gate let go
    assert pauses.paused == set()


def test_clicks_the_gate_holds_for_their_waiting_count_do_not_hold_the_impressions_back() -> None:
    gate = InputGate(cap=100, max_drift_ms=None)
    pauses = InputPauses(gate, batch_max=10)
    gate.paused = {(CLICKS, 0)}

    def behind(kind: str, partition: int) -> bool:
        return True  # both inputs have more to read

    assert not pauses.holds_back(CLICKS, 0, waiting=gate.low + 1, behind=behind)  # waiting on them would stop both
    assert pauses.holds_back(CLICKS, 0, waiting=gate.low, behind=behind)  # the waiting ones are down: they bound again
    assert pauses.holds_back(IMPRESSIONS, 0, waiting=gate.low + 1, behind=behind)
    assert not pauses.holds_back(IMPRESSIONS, 0, waiting=0, behind=lambda kind, p: False)  # read to the end


def test_the_holds_bound_is_sized_again_for_each_assignment() -> None:
    pauses = InputPauses(InputGate(cap=100_000, max_drift_ms=None), batch_max=5000)
    pauses.resize(32)
    assert pauses.bounds[IMPRESSIONS].high == HOLD_BUDGET // 32 * 5000
