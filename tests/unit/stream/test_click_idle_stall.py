"""A stall is no click idleness. ``click_idle_s`` without a click lets a partition's impressions drive event time
alone; the time a joiner stood still (SIGSTOP, a long GC pause, a paused VM) counted toward it, so the first batch
after a stall that brought impressions only closed windows whose clicks were written meanwhile, unread yet."""

from __future__ import annotations

import time

import pytest

from stream.events import Click, Impression
from stream.joiner.engine import JoinConfig, PartitionJoin
from stream.samples import SampleBatch
from tests.unit.stream.test_samples_watermark_header import KAFKA, _pipeline


@pytest.mark.parametrize(("gap", "label"), [("stall", 1), ("quiet", 0)])
def test_a_stall_does_not_count_as_click_idleness_but_a_quiet_click_input_still_does(
        gap: str, label: int, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    p, sent = _pipeline()
    p.engines[3] = PartitionJoin(3, JoinConfig(window_ms=1000, lateness_ms=0, watermark_quorum=1))
    p._apply_all([(3, [(0, Impression("a", 0, "u", "i"))], [(0, Click("z", 0))])])
    if gap == "stall":
        clock[0] += 60  # stopped a minute: no round ran, clicks were written meanwhile
    else:
        for _ in range(60):  # a minute of rounds (the driver's, one a second) that read no click
            clock[0] += 1
            p.awake.tick()
    p._apply_all([(3, [(1, Impression("b", 1500, "u", "i"))], [])])  # impressions only, past a's window
    p._apply_all([(3, [], [(1, Click("a", 900)), (2, Click("b", 1500))])])
    batches = [SampleBatch.decode(v).batch for topic, v, _, _ in sent.messages if topic == KAFKA.samples_topic]
    labels = {i: lab for b in batches
              for i, lab in zip(b.column("impression_id").to_pylist(), b.column("label").to_pylist(), strict=True)}
    assert labels["a"] == label


def test_a_click_input_quiet_while_every_round_is_slow_still_becomes_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds each longer than ``batch_within_s`` + 2 s (a backlog's big batches, a slow broker or Redis; under faust a
    batch that keeps the event loop from its idle check) are time the joiner ran. Each was taken for a stall and counted
    nothing: a quiet click input never became idle, however long it stayed quiet (on the wall clock, before the
    stall fix, it did after ``click_idle_s``)."""
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    p, sent = _pipeline()
    p.engines[3] = PartitionJoin(3, JoinConfig(window_ms=1000, lateness_ms=0, watermark_quorum=1))
    p._apply_all([(3, [(0, Impression("a", 0, "u", "i"))], [(0, Click("z", 0))])])
    for _ in range(60):  # three minutes of 3 s rounds that read no click
        clock[0] += 3
        p.awake.tick()
    p._apply_all([(3, [(1, Impression("b", 1500, "u", "i"))], [])])  # impressions only, past a's window
    p._apply_all([(3, [], [(1, Click("a", 900))])])
    batches = [SampleBatch.decode(v).batch for topic, v, _, _ in sent.messages if topic == KAFKA.samples_topic]
    labels = {i: lab for b in batches
              for i, lab in zip(b.column("impression_id").to_pylist(), b.column("label").to_pylist(), strict=True)}
    assert labels["a"] == 0
