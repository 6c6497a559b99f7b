"""serving/model.py ``PinnedModel``: a request's ids are mapped to rows and those rows scored with one snapshot of the
id maps and the rows they point at. A learner delta that evicts user V and gives V's row to a new user U landed
between the two (the history read, collected after every other field is mapped, is such a moment): the request for V
was scored with U's vector."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from learner.artifact import open_artifact, read_id_maps
from learner.config import Device
from serving.app import ScoringApp
from serving.metrics import ServingMetrics
from serving.model import ScoringModel
from serving.settings import ServeSettings
from serving.swap import ModelHolder, _live_model
from stream.features import hash_value
from tests.unit.serving.test_unknown_ids import trained_artifact

USER_FIELD = 0  # user_id, the feature config's first field (tests/unit/learner/test_row_mapper.py CFG)


def _own_user(model: ScoringModel) -> tuple[int, int]:
    """(raw id, row) of a user of the artifact with its own row (not a hash bucket)."""
    first, _ = model.feature_config.blocks[USER_FIELD]
    buckets = model.feature_config.fields[USER_FIELD].num_buckets
    for user in range(40):
        row = int(model.map_rows(USER_FIELD, np.array([hash_value(user)], np.int64))[0])
        if row >= first + buckets:
            return user, row
    raise AssertionError("the artifact admitted no user")


def _moved_row_delta(model: ScoringModel, user: int, newcomer: str) -> dict[str, Any]:
    """A delta that evicts ``user`` and gives its row to ``newcomer``, with a vector far from the old one."""
    with open_artifact(model.version_dir) as files:
        id_maps = read_id_maps(files)
    assert id_maps is not None
    state = id_maps["user_id"]
    keys = state["row_key"].clone()
    slot = int(np.flatnonzero(keys.numpy() == hash_value(user))[0])
    keys[slot] = hash_value(newcomer)
    id_maps["user_id"] = {**state, "row_key": keys}
    row = int(model.map_rows(USER_FIELD, np.array([hash_value(user)], np.int64))[0])
    return {"rows": torch.tensor([row]), "vectors": torch.full((1, model.spec.dim + 1), 3.0), "dense_state": None,
            "seq": 1, "id_maps": id_maps}


class DeltaDuringHistoryRead:
    """``UserHistory.as_of`` that applies a delta to the model while the request is being encoded."""

    def __init__(self, model: ScoringModel, delta: dict[str, Any] | None) -> None:
        self.model, self.delta = model, delta

    def as_of(self, users: list[int], _ts: list[int]) -> list[list[int]]:
        if self.delta is not None:
            self.model.apply_delta(**self.delta)
            self.delta = None
        return [[] for _ in users]


def _score(model: ScoringModel, user: int | str, delta: dict[str, Any] | None) -> tuple[list[float], int]:
    """POST /v1/score for ``user`` on ``model``, ``delta`` applied while the request's history is read."""
    holder = ModelHolder()
    holder.live = _live_model(model)
    app = ScoringApp(ServeSettings(port=0, device=Device.CPU), holder, ServingMetrics(holder.model),
                     DeltaDuringHistoryRead(model, delta))  # type: ignore[arg-type]
    status, _, body = app.handle("POST", "/v1/score", json.dumps({"user_id": user, "items": [1, 2, 3]}).encode())
    assert status == 200, body
    answer = json.loads(body)
    return answer["scores"], answer["delta_seq"]


def test_a_delta_moving_a_users_row_to_a_newcomer_mid_request_does_not_score_the_request_with_the_newcomers_vector(
        tmp_path: Path) -> None:
    model = ScoringModel.load(trained_artifact(tmp_path))
    user, row = _own_user(model)
    before, _ = _score(model, user, None)
    during, seq = _score(model, user, _moved_row_delta(model, user, "newcomer"))
    assert during == before and seq == 0  # the snapshot the request started on: V's row, V's vector
    # and the delta did land: the newcomer now has that row (with the delta's vector), the user a hash bucket
    assert int(model.map_rows(USER_FIELD, np.array([hash_value("newcomer")], np.int64))[0]) == row
    assert int(model.map_rows(USER_FIELD, np.array([hash_value(user)], np.int64))[0]) != row
    after, seq = _score(model, "newcomer", None)
    assert seq == 1 and after != before
