"""Served quality resolves an observed 0 by the joiner's own watermark (learner/served.py), fed here by the join engine
itself (stream/joiner/engine.py): what the daemon reads from each samples message's header."""

from __future__ import annotations

import random

import numpy as np
import pytest

from learner.served import ServedQuality
from stream.events import Click, Impression
from stream.joiner.engine import JoinConfig, PartitionJoin
from stream.samples import DELAYED_POSITIVE, NO_WATERMARK


def _imp(imp_id: str, ts: int) -> Impression:
    return Impression(impression_id=imp_id, ts=ts, user_id="u", item_id="i")


class Joined:
    """One partition's join engine feeding a ServedQuality batch by batch, as joiner + daemon do: each batch's samples
    with the engine's watermark after it. ``probs``: the prediction served for each impression id."""

    def __init__(self, cfg: JoinConfig, probs: dict[str, float]) -> None:
        self.engine, self.probs = PartitionJoin(0, cfg), probs
        self.served = ServedQuality(cfg.window_ms)
        self.labels: dict[str, int] = {}  # the joiner's final label of each impression
        self._offsets = [0, 0]

    def batch(self, imps: list[tuple[str, int]], clicks: list[tuple[str, int]], with_watermark: bool = True) -> None:
        pairs_i = [(self._offsets[0] + n, _imp(i, t)) for n, (i, t) in enumerate(imps)]
        pairs_c = [(self._offsets[1] + n, Click(impression_id=i, ts=t)) for n, (i, t) in enumerate(clicks)]
        self._offsets[0] += len(imps)
        self._offsets[1] += len(clicks)
        res = self.engine.apply(pairs_i, pairs_c)
        for s in res.samples:
            self.labels[s.pending.impression_id] = max(self.labels.get(s.pending.impression_id, 0), s.label)
        ids = np.array([s.pending.impression_id for s in res.samples], object)
        wm = NO_WATERMARK if self.engine.watermark is None else self.engine.watermark  # the header's value
        self.served.record(ids, np.array([s.pending.ts for s in res.samples], np.int64),
                           np.array([s.kind for s in res.samples], np.int8),
                           np.array([s.label for s in res.samples], np.float32),
                           np.array([self.probs[i] for i in ids.tolist()]), None,
                           np.zeros(len(ids), np.int64), np.array([s.label_delay_ms for s in res.samples], np.int64),
                           watermarks={0: wm} if with_watermark else None)

    def served_labels(self) -> dict[float, float]:
        st = self.served.state_dict()["all"]
        return dict(zip(st["window_probs"].tolist(), st["window_labels"].tolist(), strict=True))


def test_a_click_joined_out_of_offset_order_within_the_lateness_is_served_as_the_click_it_is() -> None:
    """The reviewer's input (a): x@0 and z@300 with z's click @1300 in one batch, x's click @900 in the next. The
    engine joins x's click (within the lateness: the watermark is still -200), but the click clock of 1300 had closed
    x's window: x was served as a 0 and its delayed positive counted unmatched."""
    j = Joined(JoinConfig(window_ms=1000, lateness_ms=500, watermark_quorum=1, policy="fake_negative"),
               {"x": 0.9, "z": 0.8})
    j.batch([("x", 0), ("z", 300)], [("z", 1300)])
    j.batch([], [("x", 900)])
    assert j.labels == {"x": 1, "z": 1}  # the joiner's labels
    assert j.served.unmatched == 0 and j.served.pending == 0
    assert j.served_labels() == {0.9: 1.0, 0.8: 1.0}


def test_one_impression_an_hour_ahead_and_its_click_close_no_other_impression() -> None:
    """The reviewer's input (b): one impression stamped an hour ahead (accepted: ``[limits] future_ts_s`` is 3600)
    with its click. The watermark quorum ignores it; the click clock took it, served every pending impression of the
    partition as a 0, and their real clicks then went unmatched (AUC 0.33 where the truth is 1.0)."""
    hour = 3_600_000
    probs = {"a": 0.9, "b": 0.8, "n": 0.1, "f": 0.5, "later1": 0.3, "later2": 0.35}
    j = Joined(JoinConfig(window_ms=60_000, lateness_ms=1000, watermark_quorum=2, policy="fake_negative"), probs)
    j.batch([("a", 0), ("b", 10), ("n", 20), ("f", hour)], [("f", hour + 100)])
    j.batch([], [("a", 5000), ("b", 6000)])
    j.batch([("later1", 200_000), ("later2", 200_001)], [("c1", 200_000), ("c2", 200_001)])  # time moves on
    assert j.served.unmatched == 0
    assert j.served_labels() == {0.9: 1.0, 0.8: 1.0, 0.1: 0.0, 0.5: 1.0}
    assert j.served.all.auc == pytest.approx(1.0)


def test_served_labels_equal_the_joiners_on_random_out_of_order_streams() -> None:
    """Exactness over the class: whatever the batching, out-of-order clicks, lateness and quorum, every impression is
    served with the label the joiner gives it, and no delayed positive finds nothing."""
    rng = random.Random(7)
    for _ in range(60):
        window, lateness, quorum = rng.choice([100, 1000]), rng.choice([0, 50, 500]), rng.choice([1, 2, 3])
        n = rng.randint(5, 40)
        imps = [(f"i{k}", rng.randint(0, 3000)) for k in range(n)]
        clicks = [(i, t + rng.randint(-20, window + 200)) for i, t in imps if rng.random() < 0.5]
        probs = {i: (k + 1) / (n + 1) for k, (i, _) in enumerate(imps)}
        probs.update({f"later{k}": 0.0 for k in range(quorum)})
        j = Joined(JoinConfig(window_ms=window, lateness_ms=lateness, watermark_quorum=quorum,
                              policy="fake_negative"), probs)
        imps.sort(key=lambda e: e[1] + rng.randint(-300, 300))  # offset order: roughly in time
        clicks.sort(key=lambda e: e[1] + rng.randint(-300, 300))
        while imps or clicks:
            a, b = rng.randint(0, 6), rng.randint(0, 6)
            j.batch(imps[:a], clicks[:b])
            imps, clicks = imps[a:], clicks[b:]
        end = 10 * window + 10_000  # the input goes on: every earlier window closes on the joiner's side
        j.batch([(f"later{k}", end) for k in range(quorum)], [(f"none{k}", end) for k in range(quorum)])
        served = j.served_labels()
        assert j.served.unmatched == 0
        assert {probs[i]: float(y) for i, y in j.labels.items() if not i.startswith("later")} == \
            {p: y for p, y in served.items() if p}


def test_messages_without_the_watermark_fall_back_to_the_click_clock() -> None:
    """An older joiner writes no watermark header: the partition's click clock closes windows, as before."""
    s = ServedQuality(window_ms=1000)
    s.record(np.array(["a", "b"], object), np.array([0, 0]), np.array([1, 1], np.int8), np.zeros(2, np.float32),
             np.array([0.9, 0.1]), None, np.zeros(2, np.int64))
    s.record(np.array(["a"], object), np.array([0]), np.array([DELAYED_POSITIVE], np.int8), np.ones(1, np.float32),
             np.array([0.9]), None, np.zeros(1, np.int64), np.array([1001]))
    assert s.pending == 0 and s.all.count == 2


def test_a_partition_with_the_watermark_ignores_its_click_clock_and_closes_at_the_watermark() -> None:
    """The engine's convention: ``ts + window <= watermark`` closes an impression (its click, if any, is out)."""
    s = ServedQuality(window_ms=1000)
    s.record(np.array(["a", "b"], object), np.array([0, 1]), np.array([1, 1], np.int8), np.zeros(2, np.float32),
             np.array([0.9, 0.1]), None, np.zeros(2, np.int64), watermarks={0: 999})
    s.record(np.array(["c"], object), np.array([5000]), np.array([DELAYED_POSITIVE], np.int8),
             np.ones(1, np.float32), np.array([0.5]), None, np.zeros(1, np.int64), np.array([10]),
             watermarks={0: 999})
    assert s.pending == 2  # the click clock (5010) says nothing where the watermark is known
    s.record(np.zeros(0, object), np.zeros(0, np.int64), np.zeros(0, np.int8), np.zeros(0, np.float32), np.zeros(0),
             None, np.zeros(0, np.int64), watermarks={0: 1000})
    assert s.pending == 1  # a (0 + 1000 <= 1000) closed, b waits


def test_messages_without_the_watermark_after_ones_with_it_close_by_the_click_clock_again() -> None:
    """A joiner rolled back to a version without the header (or a partition moved to an older worker in a rolling
    upgrade): the partition's messages carried the watermark once, then none. Marked for good, the partition took no
    click clock any more: its observed 0s never closed (here b's window closed by the click at 5010 and stayed
    pending), up to ``max_pending``, where the oldest went as 0s, their clicks still to come."""
    s = ServedQuality(window_ms=1000)
    s.record(np.array(["a"], object), np.array([0]), np.array([1], np.int8), np.zeros(1, np.float32),
             np.array([0.9]), None, np.zeros(1, np.int64), np.zeros(1, np.int64), watermarks={0: NO_WATERMARK})
    assert s.pending == 1  # the new joiner: nothing closed yet
    s.record(np.array(["b", "c"], object), np.array([1, 5000]), np.array([1, 1], np.int8),
             np.array([0.0, 1.0], np.float32), np.array([0.1, 0.8]), None, np.zeros(2, np.int64),
             np.array([0, 10]))  # the older joiner: no header; c's click at 5010 closes a's and b's windows
    assert s.pending == 0 and s.all.count == 3
