"""learner/progressive.py: the progressive metrics' state, as a checkpoint restores it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from learner.progressive import ProgressiveMetrics


def _saved() -> dict[str, Any]:
    m = ProgressiveMetrics(window=8)
    rng = np.random.default_rng(0)
    m.update(rng.random(32), (rng.random(32) < 0.3).astype(np.float64))
    return m.state_dict()


CORRUPT: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "short_histogram": (lambda d: d.__setitem__("pos", d["pos"][:5]), "pos is a int64 histogram of shape (5,)"),
    "negative_bin": (lambda d: d["neg"].__setitem__(3, -2), "neg is a int64 histogram of shape (10000,) with negative"),
    "fractional_histogram": (lambda d: d.__setitem__("pos", d["pos"] + 0.5), "pos is a float64 histogram"),
    "nan_loss_sum": (lambda d: d.__setitem__("loss_sum", float("nan")), "loss_sum nan"),
    "negative_count": (lambda d: d.__setitem__("count", -1), "count -1"),
    "count_as_bool": (lambda d: d.__setitem__("count", True), "count True"),  # a bool is an int: it was 1 sample
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_a_progressive_metrics_state_no_update_makes_is_refused_at_load_naming_the_value(case: str) -> None:
    """A damaged or edited checkpoint's metrics are refused when loaded (the restore uses the previous checkpoint):
    a histogram of another length loaded, and every later batch's update raised, striking the batch's messages."""
    corrupt, named = CORRUPT[case]
    state = _saved()
    corrupt(state)
    m = ProgressiveMetrics(window=8)
    with pytest.raises(ValueError, match="progressive metrics state") as err:
        m.load_state_dict(state)
    assert named in str(err.value)
    m.update(np.array([0.2, 0.7]), np.array([0.0, 1.0]))  # a batch still records: nothing of the state was kept
    assert m.count == 2


def test_a_sound_progressive_metrics_state_loads_as_it_was_saved() -> None:
    state = _saved()
    m = ProgressiveMetrics(window=8)
    m.load_state_dict(state)
    assert m.count == 32 and np.isfinite(m.auc)
    np.testing.assert_array_equal(m.pos, state["pos"])
    assert m.loss_sum == state["loss_sum"]
