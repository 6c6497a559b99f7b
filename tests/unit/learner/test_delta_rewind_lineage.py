"""Deltas of an earlier training left in the deltas directory (another lineage: a new model started in the checkpoint
directory, a checkpoint of another lineage resumed) are no sign that the numbering restarted: a model of the new
lineage never re-bases on them (``learner.delta_reader.DeltaReader.newer``)."""

from __future__ import annotations

from pathlib import Path

import torch

from learner.delta_reader import DeltaReader
from learner.deltas import delta_path, encode_delta
from stream.files import write_atomic

OLD, NEW = "a" * 32, "b" * 32


def _write(directory: Path, seq: int, samples: int, lineage: str) -> None:
    write_atomic(delta_path(directory, seq, samples), encode_delta(
        {"seq": seq, "samples_trained": samples, "created": 1.0, "lineage": lineage,
         "rows": torch.tensor([seq], dtype=torch.int64), "vectors": torch.full((1, 5), float(seq)),
         "dense_state": {"bias": torch.zeros(1)}}))


def test_an_earlier_lineages_deltas_below_a_models_seq_are_no_rewind_and_nothing_is_applied_twice(
        tmp_path: Path) -> None:
    """The earlier training wrote deltas 1..3 (trained to 100..300 samples); the new one's checkpoint (20 samples,
    delta_seq 3: its writer numbers after them) is the artifact serving runs, and the new training writes 4 and 5.
    Those earlier deltas, at or below the model's seq and trained past it, were taken for a restarted numbering: a
    rewind counted at every round, and every delta of the new lineage read and applied again each time."""
    for seq, samples in ((1, 100), (2, 200), (3, 300)):
        _write(tmp_path, seq, samples, OLD)
    _write(tmp_path, 4, 30, NEW)
    reader = DeltaReader(tmp_path)
    seq, samples = 3, 0  # the artifact's source: delta_seq 3, no delta applied yet
    applied = []
    for d in reader.newer(seq, 20, NEW, applied_samples=samples):
        applied.append(d.seq)
        seq, samples = d.seq, max(samples, d.samples_trained)
    _write(tmp_path, 5, 40, NEW)
    for d in reader.newer(seq, 20, NEW, applied_samples=samples):
        applied.append(d.seq)
        seq, samples = d.seq, max(samples, d.samples_trained)
    assert applied == [4, 5]
    assert reader.rewinds == 0
