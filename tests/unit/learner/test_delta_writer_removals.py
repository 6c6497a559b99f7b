"""``DeltaWriter``'s removals (pruning past ``keep``) and ``abandon_after`` on a deltas directory that lost its files:
a side output never stops training, and serving never keeps a dead training's rows."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest
import torch

from learner import delta_writer
from learner.delta_reader import DeltaReader
from learner.delta_writer import DeltaWriter
from learner.deltas import SEQ_FILE, SUFFIX, list_deltas


def _write(writer: DeltaWriter, rows: list[int], samples: int) -> Path | None:
    r = torch.tensor(rows, dtype=torch.int64)
    return writer.write_rows(r, torch.full((len(rows), 3), float(samples)), {"w": torch.zeros(1)}, samples)


def _refuse_delta_unlinks(monkeypatch: pytest.MonkeyPatch) -> None:
    real = Path.unlink

    def refuse(self: Path, missing_ok: bool = False) -> None:
        if self.name.startswith("delta-"):
            raise PermissionError(1, "Operation not permitted", str(self))
        real(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)


def test_a_prune_the_directory_refuses_is_logged_once_per_file_and_the_delta_just_written_stands(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """keep 1, the deltas directory refuses removals (EPERM, EROFS): pruning delta 1 after writing delta 2 raised the
    PermissionError out of write_rows (after_step: out of the training loop), stopping training for a side output."""
    _refuse_delta_unlinks(monkeypatch)
    writer = DeltaWriter(tmp_path, num_rows=8, every_s=1.0, keep=1)
    assert _write(writer, [0, 1], 16) is not None
    with caplog.at_level(logging.ERROR, logger="streamrec.deltas"):
        for rows, samples in (([2], 24), ([3], 32)):
            path = _write(writer, rows, samples)
            assert path is not None and path.exists()
    assert writer.seq == 3 and not bool(writer.touched.any())
    assert [s for s, _, _ in list_deltas(tmp_path)] == [1, 2, 3]
    refused = [r.getMessage() for r in caplog.records if "cannot prune" in r.getMessage()]
    assert len(refused) == 2 and "000000000001-" in refused[0] and "000000000002-" in refused[1]  # not 1 again


def test_a_prune_that_cannot_list_the_directory_after_a_write_leaves_the_delta_written_and_training_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prune's listing after a delta is in place raises EIO. Before, the OSError left write_rows (after_step: the
    training loop) with the delta written and its rows still marked: training stopped for a side output."""
    writer = DeltaWriter(tmp_path, num_rows=8, every_s=1.0, keep=1)
    assert _write(writer, [0, 1], 16) is not None
    real = delta_writer.list_deltas

    def unlistable(directory: Path) -> list:
        raise OSError(errno.EIO, "Input/output error", str(directory))

    monkeypatch.setattr(delta_writer, "list_deltas", unlistable)
    path = _write(writer, [2], 24)
    monkeypatch.setattr(delta_writer, "list_deltas", real)
    assert path is not None and path.exists() and writer.seq == 2 and not bool(writer.touched.any())
    assert _write(writer, [3], 32) is not None  # the next delta prunes what was left
    assert [s for s, _, _ in list_deltas(tmp_path)] == [3]


LINEAGE = "a" * 32


def _writer(tmp_path: Path) -> DeltaWriter:
    (tmp_path / "ck").mkdir(exist_ok=True)
    return DeltaWriter(tmp_path / "deltas", num_rows=8, every_s=1.0, lineage=LINEAGE,
                       seq_file=tmp_path / "ck" / SEQ_FILE)


def _dead_run(tmp_path: Path) -> None:
    """Delta 1 (16 samples: checkpoint N's delta_seq), then the dead run's 2 and 3 (rows 2, 3; 24 and 40 samples)."""
    first = _writer(tmp_path)
    for rows, samples in (([0, 1], 16), ([2], 24), ([3], 40)):
        assert _write(first, rows, samples) is not None


def test_a_restart_after_the_deltas_directory_was_emptied_resends_every_row(tmp_path: Path) -> None:
    """Every delta file removed (a new volume, an operator's rm), the checkpoints and DELTA_SEQ kept: the restart from
    N (delta_seq 1) marked no row and recorded 2..3 abandoned, so serving at seq 3 (it applied the dead 2 and 3) counted
    no gap and no rewind and kept the dead training's rows 2 and 3 until the next artifact."""
    _dead_run(tmp_path)
    for _, _, p in list_deltas(tmp_path / "deltas"):
        p.unlink()
    restart = _writer(tmp_path)
    restart.abandon_after(1, 16)
    assert bool(restart.touched.all())
    assert _write(restart, restart.touched.nonzero().squeeze(1).tolist(), 20) is not None  # seq 4
    reader = DeltaReader(tmp_path / "deltas")
    got = list(reader.newer(3, 16, LINEAGE, applied_samples=40))
    assert [d.seq for d in got] == [4] and sorted(got[0].rows.tolist()) == list(range(8))


def test_a_restart_after_a_restart_that_reserved_a_seq_it_never_wrote_does_not_resend_every_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first restart from N removed 2..3 (recorded abandoned, rows 2 and 3 pending), recorded seq 4 in DELTA_SEQ
    and died before delta 4 was written: seq 4 reached no reader, so the next restart resends rows 2 and 3 only."""
    _dead_run(tmp_path)
    first_restart = _writer(tmp_path)
    first_restart.abandon_after(1, 16)
    real = delta_writer.write_atomic

    def no_delta(path: Path, data: bytes) -> None:
        if path.name.endswith(SUFFIX):
            raise OSError(28, "No space left on device", str(path))
        real(path, data)

    with monkeypatch.context() as m:
        m.setattr(delta_writer, "write_atomic", no_delta)
        assert _write(first_restart, [5], 20) is None
    assert (tmp_path / "ck" / SEQ_FILE).read_text() == "4"
    restart = _writer(tmp_path)
    restart.abandon_after(1, 16)
    assert restart.touched.nonzero().squeeze(1).tolist() == [2, 3]


def test_a_delta_in_place_whose_directory_fsync_failed_keeps_its_seq_so_the_next_delta_takes_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory's fsync failed (EIO) after the delta was renamed into place: the write counted as failed and the
    seq did not advance, so the retry wrote a second delta of seq 1 ([(1, 16), (1, 24)]), which a reader that had
    applied the first skipped for good."""
    import stream.files

    real, calls = stream.files.fsync_dir, []

    def fails_once(path: Path) -> None:
        calls.append(path)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        real(path)

    monkeypatch.setattr(stream.files, "fsync_dir", fails_once)
    writer = DeltaWriter(tmp_path, num_rows=8, every_s=1.0, lineage="a" * 32)
    assert _write(writer, [0, 1], 16) is None  # counted failed: the rows stay marked
    assert _write(writer, [2], 24) is not None
    assert [(s, n) for s, n, _ in list_deltas(tmp_path)] == [(1, 16), (2, 24)]
    assert [d.seq for d in DeltaReader(tmp_path).newer(1, 16, "a" * 32)] == [2]


def test_a_dataloader_workers_death_raised_while_serving_is_notified_is_raised_not_logged_as_a_lost_notice(
        tmp_path: Path) -> None:
    """torch raises a DataLoader worker's death once, from its SIGCHLD handler, wherever the learner is: here in the
    Redis publish announcing a delta. Logged as a lost notification, it was never raised again and the dead worker's
    partitions stalled for good (learner/lag.py has the same rule)."""
    def notify(seq: int) -> None:
        raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. ")

    writer = DeltaWriter(tmp_path, num_rows=8, every_s=1.0, notify=notify)
    with pytest.raises(RuntimeError, match="DataLoader worker"):
        _write(writer, [0, 1], 16)
    assert [s for s, _, _ in list_deltas(tmp_path)] == [1]  # the delta itself was written before the notice


def test_a_prune_that_leaves_deltas_it_should_remove_is_counted_in_prune_failures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only logged before (once per file): a deltas directory that could not be pruned for days had no metric."""
    from prometheus_client import REGISTRY

    def count() -> float:
        return REGISTRY.get_sample_value("streamrec_learner_prune_failures_total", {"directory": "deltas"}) or 0.0

    writer = DeltaWriter(tmp_path, num_rows=8, every_s=1.0, keep=1)
    assert _write(writer, [0, 1], 16) is not None
    before = count()

    def unlistable(directory: Path) -> list:
        raise OSError(errno.EIO, "Input/output error", str(directory))

    monkeypatch.setattr(delta_writer, "list_deltas", unlistable)
    assert _write(writer, [2], 24) is not None
    monkeypatch.undo()
    assert count() == before + 1
    assert _write(writer, [3], 32) is not None  # pruned: not counted
    assert count() == before + 1
