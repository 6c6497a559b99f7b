"""A learner delta of finite but overflowing rows (``serving/model.py`` ``apply_delta``): refused whole, as a misfit,
instead of going live and answering every request touching its rows 200 with ``null`` scores (float32 overflow in
the FM's squared sums: inf - inf = NaN)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.integration.test_serving import TinyLearner, publish_version
from tests.unit.serving.test_app import call, make_app


@pytest.mark.parametrize("big", [1e19, 3e38])
def test_a_delta_of_finite_rows_too_large_for_float32_sums_is_refused_and_scores_stay_finite(
        tmp_path: Path, big: float) -> None:
    root = tmp_path / "serving"
    publish_version(TinyLearner(seed=31), root, "v001")
    app = make_app(root)
    model = app.holder.live.model  # type: ignore[union-attr]
    before = call(app, "POST", "/v1/score", {"user_id": "a", "items": [1, 2]})[2]["scores"]
    n, width = model.table.shape
    with pytest.raises(ValueError, match="beyond"):
        model.apply_delta(torch.arange(n), torch.full((n, width), big), None, 1)
    status, _, out = call(app, "POST", "/v1/score", {"user_id": "a", "items": [1, 2]})
    assert status == 200 and out["delta_seq"] == 0 and out["scores"] == before
    assert all(s is not None and np.isfinite(s) for s in out["scores"])
