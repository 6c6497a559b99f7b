"""``ScoringModel.apply_delta`` is all or nothing: a delta that fails half-way through its checks (rows fine but the
dense state or the id maps not, or the other way round) leaves the model exactly as it was: overrides, dense
weights, id maps, seq and scores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from learner.artifact import build_artifact
from serving.model import ScoringModel
from tests.unit.learner.test_artifact import CFG, make_checkpoint, probe

W = CFG.embedding_dim + 1


def _state(model: ScoringModel) -> tuple[Any, ...]:
    live = model._live
    return (live, live.override_ids.copy(), live.override_vectors.copy(), live.mapper,
            {k: v.clone() for k, v in live.scorer.state_dict().items()}, model.delta_seq, model.delta_samples)


def _dense(ckpt: dict, **changed: torch.Tensor) -> dict[str, torch.Tensor]:
    return {**{k: v.clone() for k, v in ckpt["model"].items() if not k.startswith("sparse.")}, **changed}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[ScoringModel, dict]:
    ckpt = make_checkpoint(seed=3)
    path = build_artifact(ckpt, Path(tmp_path_factory.mktemp("a")), np.zeros(0), format="eager")
    m = ScoringModel.load(path)
    m.apply_delta(torch.tensor([1, 2]), torch.ones(2, W), None, seq=1, samples_trained=5)  # overrides to keep
    return m, ckpt


@pytest.mark.parametrize("case", ["dense_shape", "dense_unknown", "row_past_table", "id_maps", "dense_nan"])
def test_a_delta_failing_after_its_good_rows_leaves_the_model_exactly_as_before(model: tuple, case: str) -> None:
    m, ckpt = model
    rows, vectors = torch.tensor([3, 4]), torch.full((2, W), 0.5)
    dense: dict[str, torch.Tensor] | None = _dense(ckpt, bias=torch.full((1,), 2.0))
    id_maps = None
    if case == "dense_shape":
        dense = _dense(ckpt, bias=torch.zeros(2))
    elif case == "dense_unknown":
        dense = _dense(ckpt, extra=torch.zeros(1))
    elif case == "dense_nan":
        dense = _dense(ckpt, bias=torch.full((1,), float("nan")))
    elif case == "row_past_table":  # a row of the last field's block, then one past the fused table
        rows = torch.tensor([CFG.num_rows - 1, CFG.num_rows])
    else:
        id_maps = {"user_id": {"row_key": "not a map"}}
    values, offsets, dense_in = probe(CFG)
    before, scores = _state(m), m.score(values, offsets, dense_in)
    match = {"dense_shape": "has shape", "dense_unknown": "unknown", "dense_nan": "non-finite",
             "row_past_table": "rows must lie", "id_maps": "id maps do not fit"}[case]
    with pytest.raises(ValueError, match=match):
        m.apply_delta(rows, vectors, dense, seq=2, id_maps=id_maps, samples_trained=9)
    after = _state(m)
    assert after[0] is before[0] and after[3] is before[3] and after[5:] == before[5:] == (1, 5)
    assert np.array_equal(after[1], before[1]) and np.array_equal(after[2], before[2])
    assert all(torch.equal(after[4][k], v) for k, v in before[4].items())
    assert torch.equal(m.score(values, offsets, dense_in), scores)
