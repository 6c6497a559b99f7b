"""A deltas directory restored from a backup (its latest seq below the model's) holds deltas the model applied already:
serving re-based on them as on a restarted numbering and applied them again, so every row a later delta it held had
changed went back to its older value until the next artifact (``learner.delta_reader.DeltaReader.newer``, ``_held``).
A restarted numbering (deltas written after the newest one the model applied) still applies."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from cache_refresh.publish import publish
from learner.artifact import build_artifact
from learner.delta_reader import DeltaReader
from learner.delta_writer import DeltaWriter
from serving.metrics import ServingMetrics
from serving.swap import ModelHolder, ModelUpdater
from tests.integration.test_serving import CFG, TinyLearner

LINEAGE = "c" * 32


def _served_row(served: object, row: int) -> np.ndarray:
    live = served._live  # type: ignore[attr-defined]
    i = int(np.searchsorted(live.override_ids, row))
    assert live.override_ids[i] == row
    return np.asarray(live.override_vectors[i])


def test_a_deltas_directory_restored_from_a_backup_applies_none_of_the_deltas_the_model_holds_again(
        tmp_path: Path) -> None:
    learner = TinyLearner()
    root, deltas = tmp_path / "serving", tmp_path / "deltas"
    ckpt = learner.checkpoint()
    ckpt["meta"].update(lineage=LINEAGE, delta_seq=0)
    publish(root, build_artifact(ckpt, root, np.arange(0, CFG.num_rows, 3), version="v1"), keep=30)
    w = DeltaWriter(deltas, CFG.num_rows, every_s=1.0, lineage=LINEAGE, seq_file=tmp_path / "DELTA_SEQ")
    row = 1  # a cold row (not hot: every third is), written by every delta
    for i in range(5):
        (tb,) = learner.train(1)
        w.mark(torch.cat([tb.values, torch.tensor([row])]))
        with torch.no_grad():
            learner.model.sparse.bag.weight[row] = float(i + 1)  # each delta's value of the row its own
        w.write(learner.model, learner.trainer.samples)
        if i == 2:
            shutil.copytree(deltas, tmp_path / "backup")  # deltas 1..3
    holder = ModelHolder()
    updater = ModelUpdater(holder, ServingMetrics(holder.model), root, deltas)
    updater.check_now()
    served = holder.model()
    assert served is not None and served.delta_seq == 5
    assert np.all(_served_row(served, row) == 5.0)
    shutil.rmtree(deltas)
    shutil.copytree(tmp_path / "backup", deltas)  # the operator restores the directory: seqs 1..3, already applied
    updater.check_now()
    assert served.delta_seq == 5 and np.all(_served_row(served, row) == 5.0)  # not delta 3's 3.0
    assert updater.metrics.deltas_applied._value.get() == 5
    w2 = DeltaWriter(deltas, CFG.num_rows, every_s=1.0, lineage=LINEAGE, seq_file=tmp_path / "DELTA_SEQ")
    (tb,) = learner.train(1)
    w2.mark(tb.values)
    w2.write(learner.model, learner.trainer.samples)  # seq 6 (DELTA_SEQ): applies as usual
    updater.check_now()
    assert served.delta_seq == 6
    assert np.array_equal(_served_row(served, row), learner.model.sparse.bag.weight.detach()[row].numpy())


def test_a_restarted_numbering_of_the_lineage_written_after_the_models_deltas_still_applies(tmp_path: Path) -> None:
    """The rewind serving was built for: the same lineage numbering from 1 again (no DELTA_SEQ), trained no further
    than the model (the learner fell back), written after the newest delta the model applied: its rows apply."""
    learner = TinyLearner()
    old = DeltaWriter(tmp_path, CFG.num_rows, every_s=1.0, lineage=LINEAGE)
    for _ in range(3):
        for tb in learner.train(1):
            old.mark(tb.values)
        old.write(learner.model, learner.trainer.samples)
    reader = DeltaReader(tmp_path)
    applied = list(reader.newer(0, 0, LINEAGE, applied_samples=0, applied_created=0.0))
    seq, samples, created = applied[-1].seq, applied[-1].samples_trained, applied[-1].created
    for p in list(tmp_path.glob("delta-*")):
        p.unlink()
    restarted = DeltaWriter(tmp_path, CFG.num_rows, every_s=1.0, lineage=LINEAGE)  # numbers from 1 again
    for tb in learner.train(1):
        restarted.mark(tb.values)
    restarted.write(learner.model, samples - 1)  # a fallback: its count below the model's
    assert [d.seq for d in reader.newer(seq, 0, LINEAGE, applied_samples=samples, applied_created=created)] == [1]
    assert reader.rewinds == 1
