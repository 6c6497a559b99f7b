"""serving/model.py: the id maps a delta carries are built for lookups only. Serving built a full learner map per
dynamic field for every delta with maps (207 MiB each at capacity 1 M, beside the live ones: 406 MiB of peak RSS per
delta at id_capacity 1 M, bench/README.md "Delta memory"), though it only ever maps ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from learner.artifact import open_artifact, read_id_maps
from learner.id_map import IdMap
from learner.row_mapper import RowMapper
from serving.model import ScoringModel
from stream.features import hash_value
from tests.unit.serving.test_pinned_snapshot import USER_FIELD, _moved_row_delta, _own_user
from tests.unit.serving.test_unknown_ids import trained_artifact


def test_a_delta_s_id_maps_are_served_by_lookup_only_maps_under_half_the_size_that_map_like_the_learner_s(
        tmp_path: Path) -> None:
    model = ScoringModel.load(trained_artifact(tmp_path))
    user, _ = _own_user(model)
    delta = _moved_row_delta(model, user, "newcomer")
    model.apply_delta(**delta)
    learners = RowMapper.from_state(model.feature_config, delta["id_maps"])  # the learner's kind of map
    probe = np.array([hash_value(u) for u in [*range(40), "newcomer", "stranger"]], np.int64)
    assert np.array_equal(model.map_rows(USER_FIELD, probe), learners.rows(USER_FIELD, probe))
    served = model.pinned()._live.mapper.maps
    assert set(served) == set(learners.maps)
    for name, m in served.items():
        assert m.nbytes() < 0.5 * learners.maps[name].nbytes(), name


def test_an_artifact_s_id_maps_are_served_by_lookup_only_maps_too(tmp_path: Path) -> None:
    model = ScoringModel.load(trained_artifact(tmp_path))
    with open_artifact(model.version_dir) as files:
        id_maps = read_id_maps(files)
    assert id_maps
    for name, m in model.pinned()._live.mapper.maps.items():
        assert m.nbytes() < 0.5 * IdMap(**id_maps[name]["config"]).nbytes(), name
