"""A learner delta of finite but overflowing rows or dense weights (``serving/model.py`` ``apply_delta``): refused
whole, as a misfit, instead of going live and answering requests 200 with ``null`` scores (float32 overflow in the
FM's squared sums or the MLP's: inf - inf = NaN). A full artifact past the same bounds is refused at load, like any
bad artifact, and the live one keeps serving."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from learner.delta_writer import DeltaWriter
from serving.swap import ModelUpdater
from tests.integration.test_serving import CFG, TinyLearner, publish_version
from tests.unit.serving.test_app import call, make_app, sample


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


@pytest.mark.parametrize("weights, dense", [
    ("scaled", None),  # the trained weights x 1e30: inf - inf in the MLP on an ordinary request
    ("signs", 1.8e19),  # every weight +-1e12, and a request's dense value at its own bound (|x| < 2**64)
])
def test_a_delta_of_finite_dense_weights_too_large_for_float32_is_rejected_counted_and_scores_stay(
        tmp_path: Path, weights: str, dense: float | None) -> None:
    learner = TinyLearner(seed=31)
    root = tmp_path / "serving"
    publish_version(learner, root, "v001")
    request = {"user_id": "a", "items": [1, 2], **({"dense": {"price": dense}} if dense else {})}
    before = call(make_app(root), "POST", "/v1/score", request)[2]["scores"]
    writer = DeltaWriter(tmp_path / "deltas", CFG.num_rows, every_s=1.0)
    for tb in learner.train(1):
        writer.mark(tb.values)
    with torch.no_grad():
        for p in (*learner.model.dense_arch.parameters(), learner.model.bias):
            p.copy_(p * 1e30 if weights == "scaled" else torch.sign(p) * 1e12)
    assert writer.write(learner.model, learner.trainer.samples) is not None
    app = make_app(root, deltas=tmp_path / "deltas")
    assert app.metrics.registry.get_sample_value("streamrec_serving_rejected_total", {"kind": "delta"}) == 1
    status, _, out = call(app, "POST", "/v1/score", request)
    assert status == 200 and out["delta_seq"] == 0 and out["scores"] == before, out


@pytest.mark.parametrize("part", ["hot_row", "cold_row", "dense"])
def test_a_full_artifact_of_finite_weights_beyond_the_delta_bounds_is_refused_and_the_live_one_keeps_serving(
        tmp_path: Path, part: str) -> None:
    learner = TinyLearner(seed=31)
    root = tmp_path / "serving"
    publish_version(learner, root, "v001")  # hot rows 0, 3, 6, ...: row 0 hot, row 1 cold
    app = make_app(root)
    request = {"user_id": "a", "items": [1, 2]}
    before = call(app, "POST", "/v1/score", request)[2]["scores"]
    with torch.no_grad():
        if part == "dense":  # every weight +-1e12: a probe of zero dense values scores, a request's 1.8e19 is NaN
            for p in (*learner.model.dense_arch.parameters(), learner.model.bias):
                p.copy_(torch.sign(p) * 1e12)
        else:
            learner.model.state_dict()["sparse.bag.weight"][0 if part == "hot_row" else 1, 0] = 1e19
    publish_version(learner, root, "v002")
    ModelUpdater(app.holder, app.metrics, root, None, device="cpu").check_now()  # the swap serving would try
    assert app.holder.live is not None and app.holder.live.model.version == "v001"
    assert sample(app, "streamrec_serving_rejected_total", {"kind": "artifact"}) == 1
    assert "beyond" in (app.holder.problem or ""), app.holder.problem
    status, _, out = call(app, "POST", "/v1/score", request)
    assert status == 200 and out["scores"] == before, out
