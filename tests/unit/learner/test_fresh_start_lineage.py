"""A learner that starts a new model in a checkpoint directory that held an earlier training (its checkpoints moved
away, as the restore's error tells the operator to do to train a new model there; its ``LINEAGE`` and ``DELTA_SEQ``
left): serving runs the earlier training's artifact, and the new model's deltas must never apply to it."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from cache_refresh.publish import publish
from learner import checkpoint as ck
from learner.artifact import build_artifact
from learner.batch import to_tensors
from learner.daemon import Learner
from serving.metrics import ServingMetrics
from serving.swap import ModelHolder, ModelUpdater
from tests.unit.learner.test_restart_id_maps import CFG, KAFKA, _settings, samples


def test_a_new_model_started_where_checkpoints_were_moved_away_never_changes_the_earlier_trainings_artifact(
        tmp_path: Path) -> None:
    """The first training writes delta 1 and checkpoints (16 samples), and serving runs its artifact. Its checkpoints
    are moved away and a learner starts a new model there: it took the directory's LINEAGE (the first training's),
    numbered its deltas past DELTA_SEQ, and serving applied an untrained model's rows and dense weights to the first
    training's artifact."""
    ls = _settings(tmp_path)
    first = Learner(KAFKA, ls)
    try:
        first._build(CFG, first._model_settings())
        assert first.trainer is not None
        first._train(to_tensors(samples([101, 102] * 8, 0), CFG))
        assert first.deltas is not None and first.deltas.write(first.trainer.model, 16) is not None
        first.save()  # (delta_seq 1)
    finally:
        first.close()
    source = ck.load_latest(tmp_path / "ck")
    assert source is not None
    root = tmp_path / "serving"
    publish(root, build_artifact(source, root, np.zeros(0, np.int64), version="v1"), keep=3)
    holder = ModelHolder()
    updater = ModelUpdater(holder, ServingMetrics(holder.model), root, tmp_path / "deltas")
    updater.check_now()
    served = holder.model()
    assert served is not None
    before = served._given(served._live, np.arange(CFG.num_rows))[0].copy()  # (num_rows, D + 1)
    dense_before = {k: v.clone() for k, v in served._live.scorer.state_dict().items()}

    moved = tmp_path / "moved"
    moved.mkdir()
    for p in ck.list_checkpoints(tmp_path / "ck"):
        shutil.move(p, moved / p.name)
    second = Learner(KAFKA, ls)
    try:
        assert not second._restore()  # nothing to resume: a new model
        second._build(CFG, second._model_settings())
        assert second.trainer is not None and second.deltas is not None
        assert second.deltas.lineage != source.meta["lineage"]
        second._train(to_tensors(samples([104, 105] * 8, 100), CFG))
        assert second.deltas.write(second.trainer.model, second.trainer.samples) is not None
    finally:
        second.close()
    updater.check_now()
    assert served.delta_seq == 0  # nothing of the new model applied
    after = served._given(served._live, np.arange(CFG.num_rows))[0]
    assert np.array_equal(after, before)
    assert all(torch.equal(v, dense_before[k]) for k, v in served._live.scorer.state_dict().items())
