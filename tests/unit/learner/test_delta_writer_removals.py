"""``DeltaWriter``'s removals (pruning past ``keep``) and ``abandon_after`` on a deltas directory that lost its files:
a side output never stops training, and serving never keeps a dead training's rows."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from learner.deltas import DeltaWriter, list_deltas


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
