"""ClickGate: which partitions' click input to pause while clicks run ahead of their impressions."""

from __future__ import annotations

from stream.joiner.backpressure import ClickGate


def behind(*partitions: int):
    return lambda p: p in partitions


def test_a_partition_near_the_cap_whose_impressions_lag_is_paused() -> None:
    gate = ClickGate(cap=100)
    pause, resume = gate.update({0: 80, 1: 79}, behind(0, 1))
    assert (pause, resume) == ({0}, set())
    assert gate.paused == {0} and gate.pauses == 1


def test_clicks_are_not_paused_when_the_impressions_are_read_to_the_end() -> None:
    # their impressions are not coming: pausing would only stall; the cap's overflow is the answer
    gate = ClickGate(cap=100)
    assert gate.update({0: 95}, behind()) == (set(), set())


def test_a_paused_partition_resumes_at_the_low_mark_not_before() -> None:
    gate = ClickGate(cap=100)
    gate.update({0: 90}, behind(0))
    assert gate.update({0: 51}, behind(0)) == (set(), set())  # hysteresis: 51 > 50
    assert gate.update({0: 50}, behind(0)) == (set(), {0})
    assert gate.paused == set()


def test_a_paused_partition_resumes_once_its_impressions_are_caught_up() -> None:
    gate = ClickGate(cap=100)
    gate.update({0: 90}, behind(0))
    assert gate.update({0: 90}, behind()) == (set(), {0})


def test_a_partition_no_longer_held_is_resumed() -> None:
    gate = ClickGate(cap=100)
    gate.update({0: 90, 1: 90}, behind(0, 1))
    assert gate.update({1: 90}, behind(0, 1)) == (set(), {0})
    assert gate.paused == {1}


def test_release_forgets_the_named_partitions_or_all() -> None:
    gate = ClickGate(cap=100)
    gate.update({0: 90, 1: 90, 2: 90}, behind(0, 1, 2))
    assert gate.release({1, 7}) == {1}
    assert gate.release() == {0, 2} and gate.paused == set()


def test_disabled_never_pauses() -> None:
    gate = ClickGate(cap=100, enabled=False)
    assert gate.update({0: 100}, behind(0)) == (set(), set())


def test_a_tiny_cap_still_has_a_positive_high_mark() -> None:
    assert ClickGate(cap=1).high == 1


def test_the_high_mark_leaves_room_for_one_more_batch() -> None:
    # the engine gives clicks up past the cap after a batch: one batch of clicks on top of the high mark must fit
    assert ClickGate(cap=100, headroom=20).high == 80
    assert ClickGate(cap=100, headroom=40).high == 60
