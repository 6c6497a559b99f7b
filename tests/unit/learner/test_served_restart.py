"""Served quality across a learner restart (learner/served.py, learner/daemon.py): the impressions pending at a
checkpoint are in it, so after the restore their delayed positives are matched and their windows still close."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from learner.config import Device, LearnerSettings
from learner.daemon import Learner
from learner.features import FeatureConfig, FieldSpec
from learner.served import ServedQuality
from stream.config import KafkaSettings
from stream.samples import DELAYED_POSITIVE, OBSERVED

CFG = FeatureConfig((FieldSpec("user_id", "single", 8), FieldSpec("item_id", "single", 8)), embedding_dim=4)


def test_impressions_pending_at_a_checkpoint_are_scored_after_the_restore_their_clicks_matched(tmp_path: Path) -> None:
    ls = LearnerSettings(checkpoint_dir=tmp_path / "ck", mlp=(8,), embedding_dim=4, device=Device.CPU, amp=False,
                         attribution_window_s=10.0)
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9")  # never contacted: no offsets to commit
    first = Learner(kafka, ls)
    second = Learner(kafka, ls)
    try:
        first._build(CFG, first._model_settings())
        # a@0 on partition 0 and b@100 on partition 1 served as observed 0s; partition 1's clock at 5 s
        first.quality.served.record(np.array(["a", "b", "c"], object), np.array([0, 100, 5000]),
                                    np.array([OBSERVED, OBSERVED, OBSERVED], np.int8), np.array([0, 0, 1], np.float32),
                                    np.array([0.9, 0.2, 0.7]), None, np.array([0, 1, 1]), np.array([0, 0, 0]))
        assert first.quality.served.pending == 2
        first.save()
        assert second._restore()
        served = second.quality.served
        assert served.pending == 2 and served.all.count == 1
        # a's click after the restart is matched to the 0.9 served for it; b's window closes by partition 1's clock
        served.record(np.array(["a", "d"], object), np.array([0, 10_200]), np.array([DELAYED_POSITIVE, OBSERVED],
                      np.int8), np.array([1, 1], np.float32), np.array([0.1, 0.6]), None, np.array([0, 1]),
                      np.array([3000, 0]))
        assert served.unmatched == 0 and served.pending == 0 and served.all.count == 4
        probs, labels = served.all._window_arrays()
        assert dict(zip(probs.tolist(), labels.tolist(), strict=True)) == {0.7: 1.0, 0.9: 1.0, 0.6: 1.0, 0.2: 0.0}
    finally:
        second.close()
        first.close()


def test_a_served_state_saved_before_the_pending_impressions_loads_with_none_pending() -> None:
    old = ServedQuality(window_ms=1000)
    old.record(np.array(["a"], object), np.array([0]), np.array([OBSERVED], np.int8), np.zeros(1, np.float32),
               np.array([0.5]), None)
    state = {k: v for k, v in old.state_dict().items() if k not in ("pending", "clock")}  # an older checkpoint's
    q = ServedQuality(window_ms=1000)
    q.load_state_dict(state)
    assert q.pending == 0 and q.unmatched == 0
    q.record(np.array(["a"], object), np.array([0]), np.array([DELAYED_POSITIVE], np.int8), np.ones(1, np.float32),
             np.array([0.5]), None)
    assert q.unmatched == 1  # as before: its click finds nothing


def test_a_served_state_whose_pending_impressions_do_not_add_up_is_refused() -> None:
    q = ServedQuality(window_ms=1000)
    q.record(np.array(["a", "b"], object), np.array([0, 1]), np.full(2, OBSERVED, np.int8), np.zeros(2, np.float32),
             np.array([0.5, 0.4]), None)
    state = q.state_dict()
    state["pending"]["sizes"] = [3]
    with pytest.raises(ValueError, match="does not add up"):
        ServedQuality(window_ms=1000).load_state_dict(state)


@pytest.mark.parametrize("field, value, named", [
    ("forced", True, '"forced"'), ("unmatched", 1.5, '"unmatched"'), ("unmatched", "7", '"unmatched"'),
    ("unscored", -1, '"unscored"'),
    ("clock", [[0, True]], '"clock[0][1]"'), ("pending", {"partitions": [False], "sizes": [0]}, "partitions[0]")])
def test_a_served_state_count_that_is_no_integer_is_refused_naming_it(field: str, value: object, named: str) -> None:
    """``int()`` read a damaged checkpoint's ``true`` as 1, ``1.5`` as 1 and ``"7"`` as 7 (``false``: 0)."""
    state = {**ServedQuality(window_ms=1000).state_dict(), field: value}
    with pytest.raises(ValueError, match="served quality state") as err:
        ServedQuality(window_ms=1000).load_state_dict(state)
    assert named in str(err.value)


@pytest.mark.parametrize("column, value", [("ts", [True]), ("ts", ["42"]), ("ts", [4.5]), ("cold", ["false"]),
                                           ("cold", [2]), ("probs", ["0.5"])])
def test_a_served_state_pending_value_of_another_type_is_refused_naming_its_column(column: str, value: list) -> None:
    """``int()`` read a damaged checkpoint's pending time ``true`` as 1 ms and ``"42"`` as 42, ``bool()`` its cold
    flag ``"false"`` as cold; a text probability raised a bare TypeError."""
    q = ServedQuality(window_ms=1000)
    q.record(np.array(["a"], object), np.array([0]), np.full(1, OBSERVED, np.int8), np.zeros(1, np.float32),
             np.array([0.5]), None)
    state = q.state_dict()
    state["pending"][column] = value
    with pytest.raises(ValueError, match=f"served quality state: pending {column} hold"):
        ServedQuality(window_ms=1000).load_state_dict(state)


def test_the_delayed_positive_of_an_impression_served_a_nan_is_matched_not_counted_unmatched() -> None:
    """An observed 0 predicted NaN (a model gone non-finite for a batch) is never scored, but its click is its own,
    not a click whose impression was lost: ``unmatched`` stays 0, and nothing non-finite reaches the metrics."""
    q = ServedQuality(window_ms=1000)
    q.record(np.array(["a", "b"], object), np.array([0, 0]), np.full(2, OBSERVED, np.int8), np.zeros(2, np.float32),
             np.array([np.nan, 0.3]), None)
    q.record(np.array(["a"], object), np.array([0]), np.array([DELAYED_POSITIVE], np.int8), np.ones(1, np.float32),
             np.array([0.5]), None, label_delay_ms=np.array([400]))
    q.advance(2000)
    assert q.unmatched == 0 and q.pending == 0
    assert q.all.count == 1 and np.isfinite(q.all.logloss)  # b only


@pytest.mark.parametrize("prob", [-0.5, 1.5])
def test_a_served_state_with_a_pending_prediction_outside_0_1_is_refused_naming_it(prob: float) -> None:
    """A damaged or edited checkpoint's pending prediction of -0.5 made a negative histogram bin when its label came:
    the batch that resolved it raised (its messages struck). Refused at load: the restore uses the previous one."""
    q = ServedQuality(window_ms=1000)
    q.record(np.array(["a", "b"], object), np.array([0, 1]), np.full(2, OBSERVED, np.int8), np.zeros(2, np.float32),
             np.array([0.5, 0.4]), None)
    state = q.state_dict()
    state["pending"]["probs"] = np.array([0.5, prob])
    fresh = ServedQuality(window_ms=1000)
    with pytest.raises(ValueError, match=f"served quality state: pending probs hold {prob}"):
        fresh.load_state_dict(state)
    fresh.record(np.array(["b"], object), np.array([5000]), np.array([DELAYED_POSITIVE], np.int8),
                 np.ones(1, np.float32), np.array([0.5]), None)  # a batch still records
    assert fresh.pending == 0


def test_a_served_state_with_a_pending_nan_prediction_still_loads_as_served() -> None:
    q = ServedQuality(window_ms=1000)
    q.record(np.array(["a"], object), np.array([0]), np.array([OBSERVED], np.int8), np.zeros(1, np.float32),
             np.array([float("nan")]), None)
    again = ServedQuality(window_ms=1000)
    again.load_state_dict(q.state_dict())
    assert again.pending == 1
