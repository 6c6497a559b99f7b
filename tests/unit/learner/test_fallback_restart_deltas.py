"""A restart that falls back past a damaged newest checkpoint (N+1) onto the one before it (N), while serving already
runs the artifact refreshed from N+1: serving must end up serving the restarted learner's state, not a mix of it and
the abandoned training's (tests/unit/learner/test_restart_id_maps.py: the restart resend's id maps)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cache_refresh.publish import publish
from learner import checkpoint as ck
from learner.artifact import build_artifact
from learner.batch import to_tensors
from learner.config import LearnerSettings
from learner.daemon import Learner
from learner.delta_reader import DeltaReader
from learner.delta_writer import DeltaWriter
from learner.deltas import ABANDONED, delta_path, list_deltas
from serving.metrics import ServingMetrics
from serving.model import ScoringModel
from serving.swap import ModelHolder, ModelUpdater
from tests.unit.learner.test_delta_writer_removals import _refuse_delta_unlinks
from tests.unit.learner.test_restart_id_maps import AFTER, CFG, KAFKA, _settings, samples


def _served_equals_learner(served: ScoringModel, learner: Learner) -> None:
    """Every row of the table and every id's row as ``learner`` holds them."""
    assert learner.trainer is not None and learner.mapper is not None
    weight = learner.trainer.model.state_dict()["sparse.bag.weight"]  # (num_rows, D + 1)
    given, _ = served._given(served._live, np.arange(CFG.num_rows))  # (num_rows, D + 1)
    differ = np.flatnonzero(~np.isclose(given, weight.float().numpy()).all(axis=1))
    assert differ.tolist() == []
    users = np.array([101, 102, 103, 201, 202])
    assert served.map_rows(0, users).tolist() == learner.mapper.rows(0, users).tolist()


def test_serving_on_the_artifact_of_a_checkpoint_the_restart_fell_back_past_ends_on_the_restarted_state(
        tmp_path: Path) -> None:
    """Checkpoint N (16 samples), N+1 (24) and a delta after it (40, the id maps giving 101's and 102's rows to 201
    and 202); serving runs the artifact of N+1 with that delta. N+1 is damaged on disk, the learner restarts from N
    and trains other samples than the first run did after N (the first run's were past the topic's retention, say):
    its deltas (24 and 40 samples) were skipped by name up to 24 samples, the restart's resend of every admitted
    row with it, so serving kept rows and ids of a training the learner no longer has."""
    ls = _settings(tmp_path)
    first = Learner(KAFKA, ls)
    try:
        first._build(CFG, first._model_settings())
        assert first.trainer is not None and first.deltas is not None
        first._train(to_tensors(samples([101, 102] * 8, 0), CFG))
        first.save()  # N
        first._train(to_tensors(AFTER[0], CFG))
        first.save()  # N+1
        first._train(to_tensors(AFTER[1], CFG))
        assert first.deltas.write(first.trainer.model, first.trainer.samples) is not None
    finally:
        first.close()
    older, newest = ck.list_checkpoints(tmp_path / "ck")
    root = tmp_path / "serving"
    source = ck.load_latest(tmp_path / "ck")
    assert source is not None and source.path == newest and source.samples_trained == 24
    publish(root, build_artifact(source, root, np.zeros(0, np.int64), version="v1"), keep=3)
    holder = ModelHolder()
    updater = ModelUpdater(holder, ServingMetrics(holder.model), root, tmp_path / "deltas")
    updater.check_now()
    served = holder.model()
    assert served is not None and served.delta_samples == 40

    newest.write_bytes(newest.read_bytes()[:100])  # damaged: the restart falls back to N
    second = Learner(KAFKA, ls)
    try:
        assert second._restore() and second.trainer is not None and second.deltas is not None
        assert second.trainer.samples == 16
        for users, start in (([104, 105] * 4, 100), ([106] * 16, 200)):  # 24, then 40 samples: neither the first's
            second._train(to_tensors(samples(users, start), CFG))
            assert second.deltas.write(second.trainer.model, second.trainer.samples) is not None
            updater.check_now()
            _served_equals_learner(served, second)
    finally:
        second.close()


def _dead_run_after_n(tmp_path: Path) -> LearnerSettings:
    """Checkpoint N (16 samples, no delta yet), then a run that trains on to 40 samples, writes delta 1 and dies before
    its next checkpoint; the learner's settings."""
    ls = _settings(tmp_path)
    first = Learner(KAFKA, ls)
    try:
        first._build(CFG, first._model_settings())
        assert first.trainer is not None and first.deltas is not None
        first._train(to_tensors(samples([101, 102] * 8, 0), CFG))
        first.save()  # N
        for b in AFTER:
            first._train(to_tensors(b, CFG))
        assert first.deltas.write(first.trainer.model, first.trainer.samples) is not None  # seq 1, 40 samples
    finally:
        first.close()
    return ls


def test_an_artifact_of_the_restarted_learners_checkpoint_applies_no_delta_of_the_run_it_abandoned(
        tmp_path: Path) -> None:
    """Checkpoint N (16 samples, no delta yet); the first run trains on to 40 samples, writes delta 1 and dies before
    its next checkpoint. The restart from N writes delta 2 at 24 samples and checkpoint M (24, delta_seq 2). An
    artifact of M: delta 1 (seq below M's, trained past it) was taken for a restarted numbering (a rewind), and the
    re-base on samples applied it, rows of a training no checkpoint holds."""
    ls = _dead_run_after_n(tmp_path)
    second = Learner(KAFKA, ls)
    try:
        assert second._restore() and second.trainer is not None and second.deltas is not None
        second._train(to_tensors(samples([104, 105] * 4, 100), CFG))
        assert second.deltas.write(second.trainer.model, second.trainer.samples) is not None  # seq 2, 24 samples
        second.save()  # M
    finally:
        second.close()
    m = ck.load_latest(tmp_path / "ck")
    assert m is not None and m.samples_trained == 24 and m.meta["delta_seq"] == 2
    reader = DeltaReader(tmp_path / "deltas")
    applied = [d.seq for d in reader.newer(2, 24, m.meta["lineage"], applied_samples=0)]
    assert (applied, reader.rewinds) == ([], 0)


def test_a_checkpoint_the_restore_fell_back_past_is_set_aside_so_only_the_first_restart_resends_every_row(
        tmp_path: Path) -> None:
    """N (16 samples) and a damaged N+1 (24): the restart falls back to N and resends every row. N+1 stayed in the
    directory (pruning keeps files named after the newest), so every later restart fell back past it again and
    resent the whole table (~760 MB at 10 M rows). It is renamed ``.damaged``, kept, and never listed again."""
    ls = _settings(tmp_path)
    first = Learner(KAFKA, ls)
    try:
        first._build(CFG, first._model_settings())
        first._train(to_tensors(samples([101, 102] * 8, 0), CFG))
        first.save()  # N
        first._train(to_tensors(AFTER[0], CFG))
        first.save()  # N+1
    finally:
        first.close()
    newest = ck.list_checkpoints(tmp_path / "ck")[-1]
    damaged = newest.read_bytes()[:100]
    newest.write_bytes(damaged)
    for restart in range(2):
        learner = Learner(KAFKA, ls)
        try:
            assert learner._restore() and learner.trainer is not None and learner.deltas is not None
            assert learner.trainer.samples == 16
            resent = int(learner.deltas.touched.sum())
            assert (resent == CFG.num_rows) == (restart == 0)
            assert learner.deltas.write(learner.trainer.model, learner.trainer.samples) is not None
        finally:
            learner.close()
    assert newest not in ck.list_checkpoints(tmp_path / "ck")
    assert newest.with_name(newest.name + ".damaged").read_bytes() == damaged


def test_serving_that_applied_a_dead_runs_deltas_ends_on_the_restarted_state_row_for_row(tmp_path: Path) -> None:
    """Checkpoint N (16 samples, no newer checkpoint file); the first run trains on to 40 samples, writes delta 1
    (serving, on N's artifact, applies it) and dies. The restart from N trains other samples (the first run's were
    past retention, say) and resends admitted ids' rows and the pending list only: the item and bucket rows only the
    dead delta touched kept its values in serving until the next artifact."""
    ls = _dead_run_after_n(tmp_path)
    root = tmp_path / "serving"
    source = ck.load_latest(tmp_path / "ck")
    assert source is not None and source.samples_trained == 16
    publish(root, build_artifact(source, root, np.zeros(0, np.int64), version="v1"), keep=3)
    holder = ModelHolder()
    updater = ModelUpdater(holder, ServingMetrics(holder.model), root, tmp_path / "deltas")
    updater.check_now()
    served = holder.model()
    assert served is not None and served.delta_seq == 1

    second = Learner(KAFKA, ls)
    try:
        assert second._restore() and second.trainer is not None and second.deltas is not None
        assert second.trainer.samples == 16
        second._train(to_tensors(samples([104, 105] * 4, 100), CFG))  # not the first run's samples
        assert second.deltas.write(second.trainer.model, second.trainer.samples) is not None
        updater.check_now()
        assert served.delta_seq == 2
        _served_equals_learner(served, second)
    finally:
        second.close()


def _restart_after_a_dead_branch(tmp_path: Path) -> tuple[Path, str]:
    """Delta 1 (16 samples), checkpoint N (delta_seq 1); the first run writes deltas 2 and 3 (24, 40) and dies; the
    restart from N removes them and writes delta 4. The deltas directory and N's lineage."""
    ls = _settings(tmp_path)
    first = Learner(KAFKA, ls)
    try:
        first._build(CFG, first._model_settings())
        assert first.trainer is not None and first.deltas is not None
        first._train(to_tensors(samples([101, 102] * 8, 0), CFG))
        assert first.deltas.write(first.trainer.model, first.trainer.samples) is not None  # seq 1
        first.save()  # N
        for b in AFTER:
            first._train(to_tensors(b, CFG))
            assert first.deltas.write(first.trainer.model, first.trainer.samples) is not None  # seq 2, 3
    finally:
        first.close()
    second = Learner(KAFKA, ls)
    try:
        assert second._restore() and second.trainer is not None and second.deltas is not None
        second._train(to_tensors(samples([104, 105] * 4, 100), CFG))
        assert second.deltas.write(second.trainer.model, second.trainer.samples) is not None  # seq 4
    finally:
        second.close()
    return tmp_path / "deltas", ck.lineage(tmp_path / "ck")


def test_deltas_a_restart_removed_as_a_dead_branch_are_no_gap_for_an_artifact_of_its_checkpoint(
        tmp_path: Path) -> None:
    """Serving loads N's artifact (delta_seq 1) after the restart: deltas 2 and 3 are missing before 4, removed as a
    dead branch (their rows are in 4), not pruned unread; they were counted as a gap (the gaps metric, its alert)."""
    directory, lineage = _restart_after_a_dead_branch(tmp_path)
    assert [s for s, _, _ in list_deltas(directory)] == [1, 4]
    reader = DeltaReader(directory)
    assert [d.seq for d in reader.newer(1, 16, lineage, applied_samples=0)] == [4]
    assert reader.gaps == 0


def test_a_gap_counts_the_missing_seqs_no_restart_of_its_lineage_abandoned(tmp_path: Path) -> None:
    """Deltas 1 and 6 listed, 3..4 recorded abandoned by this lineage's restart, 5 by another lineage's: a reader at
    seq 1 counts 2 and 5 (pruned unread), not 3 and 4."""
    for seq in (1, 6):
        delta_path(tmp_path, seq, seq).write_bytes(b"")  # (unreadable: rejected after the gap is counted)
    (tmp_path / ABANDONED).write_text(f"3 4 {'a' * 32}\n5 5 {'b' * 32}\n")
    reader = DeltaReader(tmp_path, on_reject=lambda path, why: None)
    assert list(reader.newer(1, 1, "a" * 32)) == []
    assert reader.gaps == 2


def _write(writer: DeltaWriter, rows: list[int], samples: int) -> None:
    """One delta of ``rows`` (their vectors: the samples count) with a one-weight dense part."""
    r = torch.tensor(rows, dtype=torch.int64)
    assert writer.write_rows(r, torch.full((len(rows), 3), float(samples)), {"w": torch.zeros(1)}, samples)


def test_no_rewind_while_the_models_seqs_past_the_latest_were_all_abandoned_by_a_restart(tmp_path: Path) -> None:
    """Delta 1 (16 samples) is checkpoint N's; serving applied the dead run's 2 and 3 (seq 3, 40 samples); the restart
    from N removed them (recorded abandoned) and has not written 4 yet. newer(3, ...) saw latest seq 1 below 3: logged
    "numbering restarted" and counted a rewind, where there is simply nothing newer yet."""
    lineage = "a" * 32
    first = DeltaWriter(tmp_path, num_rows=8, every_s=1.0, lineage=lineage)
    for rows, count in (([0, 1], 16), ([2], 24), ([3], 40)):
        _write(first, rows, count)
    DeltaWriter(tmp_path, num_rows=8, every_s=1.0, lineage=lineage).abandon_after(1, 16)
    assert [s for s, _, _ in list_deltas(tmp_path)] == [1]
    reader = DeltaReader(tmp_path)
    assert (list(reader.newer(3, 16, lineage, applied_samples=40)), reader.rewinds) == ([], 0)
    assert (list(reader.newer(3, 16, "b" * 32, applied_samples=40)), reader.rewinds) == ([], 1)  # not its restart's


def _dead_run(directory: Path, keep: int) -> DeltaWriter:
    """Delta 1 (16 samples, checkpoint N's delta_seq); the dead run writes 2, 3, 4 (rows 2, 3, 4) with ``keep``; the
    restart's writer, after ``abandon_after(1, 16)``."""
    first = DeltaWriter(directory, num_rows=8, every_s=1.0, keep=keep, lineage="a" * 32)
    for rows, count in (([0, 1], 16), ([2], 24), ([3], 32), ([4], 40)):
        _write(first, rows, count)
    restart = DeltaWriter(directory, num_rows=8, every_s=1.0, keep=keep, lineage="a" * 32)
    restart.abandon_after(1, 16)
    return restart


def test_a_restart_resends_every_row_when_the_dead_run_pruned_some_of_its_own_deltas(tmp_path: Path) -> None:
    """keep 2: the dead run pruned its own delta 2 (row 2) before it died; serving may have applied it, and the
    restart, reading only 3 and 4, resent rows 3 and 4: row 2 kept the dead training's value in serving."""
    restart = _dead_run(tmp_path, keep=2)
    assert bool(restart.touched.all())


def test_a_restart_resends_only_the_dead_deltas_rows_when_all_of_them_are_on_disk(tmp_path: Path) -> None:
    """keep 3: deltas 2..4 all there (only 1, the checkpoint's, pruned): their rows, not the whole table."""
    restart = _dead_run(tmp_path, keep=3)
    assert restart.touched.nonzero().squeeze(1).tolist() == [2, 3, 4]


def test_a_restart_does_not_resend_every_row_for_a_hole_an_earlier_restart_recorded_abandoned(tmp_path: Path) -> None:
    """Deltas 2 and 3 (rows 2, 3) removed by an earlier restart from N (recorded abandoned; their rows pending), which
    wrote 4 and 5 (rows 5, 6) and died: the hole 2..3 before 4 lost nothing, so no resend of the whole table."""
    first = DeltaWriter(tmp_path, num_rows=8, every_s=1.0, lineage="a" * 32)
    for rows, count in (([0, 1], 16), ([2], 24), ([3], 32)):
        _write(first, rows, count)
    earlier = DeltaWriter(tmp_path, num_rows=8, every_s=1.0, lineage="a" * 32)
    earlier.abandon_after(1, 16)
    _write(earlier, [5], 24)
    _write(earlier, [6], 32)
    restart = DeltaWriter(tmp_path, num_rows=8, every_s=1.0, lineage="a" * 32)
    restart.abandon_after(1, 16)
    assert restart.touched.nonzero().squeeze(1).tolist() == [2, 3, 5, 6]


def test_a_second_quick_restart_numbers_past_the_seqs_the_first_abandoned_when_delta_seq_could_not_be_recorded(
        tmp_path: Path) -> None:
    """The checkpoint volume is full (DELTA_SEQ cannot be written). Serving applied the dead run's deltas 2 and 3;
    the restart from N (delta_seq 1) removed them and died before its first delta; the second restart numbered its
    deltas 2 and 3 again (the directory's largest seq was 1): serving, at seq 3, skipped both (the resend of the dead
    rows with them) and kept the dead training's values."""
    lineage, seq_file = "a" * 32, tmp_path / "full-volume" / "DELTA_SEQ"  # (its directory missing: every write fails)
    deltas = tmp_path / "deltas"
    first = DeltaWriter(deltas, num_rows=8, every_s=1.0, lineage=lineage, seq_file=seq_file)
    for rows, count in (([0, 1], 16), ([2], 24), ([3], 40)):
        _write(first, rows, count)
    DeltaWriter(deltas, num_rows=8, every_s=1.0, lineage=lineage, seq_file=seq_file).abandon_after(1, 16)
    second = DeltaWriter(deltas, num_rows=8, every_s=1.0, lineage=lineage, seq_file=seq_file)
    second.abandon_after(1, 16)
    _write(second, [5], 24)
    reader = DeltaReader(deltas)
    assert [d.seq for d in reader.newer(3, 16, lineage, applied_samples=40)] == [4]


def test_a_crash_loop_of_restarts_from_one_checkpoint_keeps_the_ranges_earlier_restarts_abandoned(
        tmp_path: Path) -> None:
    """Delta 1 is N's; the restart from N removed the dead 2..3 and wrote 4 (checkpoint M: delta_seq 4) and 5, then
    died; every restart from M since (a crash loop before the first delta) recorded 5..5 once more: after 64 of them
    the file held only those lines, and a serving process loading N's artifact counted 2..3 as pruned unread."""
    lineage = "a" * 32
    first = DeltaWriter(tmp_path, num_rows=8, every_s=1.0, lineage=lineage)
    for rows, count in (([0, 1], 16), ([2], 24), ([3], 40)):
        _write(first, rows, count)
    restart = DeltaWriter(tmp_path, num_rows=8, every_s=1.0, lineage=lineage)
    restart.abandon_after(1, 16)
    _write(restart, [4], 24)  # seq 4: checkpoint M
    _write(restart, [5], 32)  # seq 5: dies
    for _ in range(70):
        DeltaWriter(tmp_path, num_rows=8, every_s=1.0, lineage=lineage).abandon_after(4, 24)
    reader = DeltaReader(tmp_path)
    assert [d.seq for d in reader.newer(1, 16, lineage, applied_samples=0)] == [4]
    assert reader.gaps == 0


def test_a_restart_whose_dead_deltas_cannot_be_removed_still_starts_and_resends_their_rows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deltas directory refuses removals (EPERM: a sticky directory whose files another user owns; EROFS): the
    restart's abandon_after raised the PermissionError out of the restore, and the learner did not start (a raw
    traceback; the sharded rank 0 left the other ranks waiting in their next collective), for a side output."""
    lineage = "a" * 32
    first = DeltaWriter(tmp_path, num_rows=8, every_s=1.0, lineage=lineage)
    for rows, count in (([0, 1], 16), ([2], 24), ([3], 40)):
        _write(first, rows, count)
    _refuse_delta_unlinks(monkeypatch)
    restart = DeltaWriter(tmp_path, num_rows=8, every_s=1.0, lineage=lineage)
    restart.abandon_after(1, 16)
    assert restart.touched.nonzero().squeeze(1).tolist() == [2, 3]
    assert restart.seq == 3


def test_a_dead_delta_the_restart_could_not_remove_is_never_applied_to_a_later_artifact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The restart could not remove the dead run's deltas 2 and 3 (a directory refusing removals) but recorded them
    abandoned; an artifact of a later checkpoint (delta_seq 5, 24 samples: its seq past them, its count below the dead
    delta 3's 40) took them for a restarted numbering, counted a rewind and applied the dead training's rows."""
    lineage = "a" * 32
    first = DeltaWriter(tmp_path, num_rows=8, every_s=1.0, lineage=lineage)
    for rows, count in (([0, 1], 16), ([2], 24), ([3], 40)):
        _write(first, rows, count)
    with monkeypatch.context() as m:
        _refuse_delta_unlinks(m)
        restart = DeltaWriter(tmp_path, num_rows=8, every_s=1.0, lineage=lineage)
        restart.abandon_after(1, 16)
    _write(restart, [2, 3], 20)  # seq 4
    _write(restart, [5], 24)  # seq 5: checkpoint M's delta_seq
    assert [s for s, _, _ in list_deltas(tmp_path)] == [1, 2, 3, 4, 5]  # the dead 2 and 3 still there
    reader = DeltaReader(tmp_path)
    assert (list(reader.newer(5, 24, lineage, applied_samples=24)), reader.rewinds, reader.gaps) == ([], 0, 0)
    assert [d.seq for d in reader.newer(1, 16, lineage)] == [4, 5]  # an artifact of N: the restart's deltas only
