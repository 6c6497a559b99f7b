"""The joiner's paced garbage collection (stream/joiner/gc_pacing.py): no automatic full collection, one full
collection between batches on the clock, cycles still reclaimed, and the process's collector given back."""

from __future__ import annotations

import gc
import weakref

import pytest

from stream.errors import ConfigError
from stream.joiner.config import JoinerSettings
from stream.joiner.gc_pacing import YOUNG_THRESHOLD, GcPacing


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def make_cycle() -> weakref.ref[Node]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_pacing_stops_automatic_full_collections_and_close_restores_the_thresholds() -> None:
    before = gc.get_threshold()
    full = gc.get_stats()[2]["collections"]
    pacing = GcPacing(every_s=3600)
    try:
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD
        keep = [[i] for i in range(3 * YOUNG_THRESHOLD)]  # enough allocations for several young collections
        assert gc.get_stats()[2]["collections"] == full  # ... and never a full one
        del keep
    finally:
        pacing.close()
    assert gc.get_threshold() == before
    pacing.close()  # twice is harmless
    assert gc.get_threshold() == before


def test_between_batches_collects_cycles_once_the_interval_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("stream.joiner.gc_pacing.time.monotonic", lambda: clock[0])
    pacing = GcPacing(every_s=60)
    try:
        cycle = make_cycle()
        assert pacing.between_batches() == 0.0 and pacing.collections == 0  # too early
        assert cycle() is not None
        clock[0] += 61
        pacing.between_batches()
        assert pacing.collections == 1
        assert cycle() is None  # the cycle was reclaimed by the paced collection
        assert pacing.between_batches() == 0.0 and pacing.collections == 1  # the clock restarted
    finally:
        pacing.close()


def test_zero_leaves_pythons_collector_alone() -> None:
    before = gc.get_threshold()
    pacing = GcPacing(every_s=0)
    assert gc.get_threshold() == before
    assert pacing.between_batches() == 0.0
    pacing.close()
    assert gc.get_threshold() == before


def test_a_negative_interval_is_a_config_error_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"\[joiner\] gc_every_s"):
        JoinerSettings(gc_every_s=-1)
    with pytest.raises(ValueError, match="gc_every_s"):
        GcPacing(-1)
