"""``checkpoint_files.set_aside``: a checkpoint the learner's restore fell back past is never listed again, even when it
cannot be renamed, and the ones set aside are pruned by count."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from learner import checkpoint as ck
from learner import checkpoint_files


def test_a_checkpoint_that_cannot_be_renamed_aside_is_still_never_listed_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rename of the damaged newest checkpoint fails (EPERM: a sticky directory, a file of another owner); it was
    only logged, so every later restart fell back past it again and resent every row to serving."""
    good, bad = tmp_path / "ckpt-000000000000016-1.pt", tmp_path / "ckpt-000000000000024-2.pt"
    for p in (good, bad):
        p.write_bytes(b"x")
    real = Path.rename

    def refuse(self: Path, target: Path | str) -> Path:
        if self == bad:
            raise PermissionError(1, "Operation not permitted", str(self))
        return real(self, target)

    monkeypatch.setattr(Path, "rename", refuse)
    ck.set_aside([bad])
    assert bad.exists() and ck.list_checkpoints(tmp_path) == [good]


def test_save_keeps_the_newest_keep_checkpoints_set_aside_with_their_sidecars(tmp_path: Path) -> None:
    aside = [tmp_path / f"ckpt-{n:015d}-{n}.pt" for n in (100, 200, 300)]
    for p in aside:
        p.write_bytes(b"x")
        p.with_suffix(".json").write_text("{}")
    ck.set_aside(aside)
    ck.save(tmp_path, {"model": {}}, {"samples_trained": 5}, keep=2)
    left = sorted(p.name for p in tmp_path.glob(f"*{ck.DAMAGED}"))
    assert left == [p.name + ck.DAMAGED for p in aside[1:] for p in (p.with_suffix(".json"), p)]


def _refuse_renames_of(monkeypatch: pytest.MonkeyPatch, refused: set[Path]) -> None:
    real = Path.rename

    def refuse(self: Path, target: Path | str) -> Path:
        if self in refused:
            raise PermissionError(1, "Operation not permitted", str(self))
        return real(self, target)

    monkeypatch.setattr(Path, "rename", refuse)


def test_set_aside_logs_a_refused_marker_not_a_rename_it_did_not_make(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The rename fails and a .refused marker is written: the log still said "set aside as <name>.damaged", sending
    an operator to look for a file that does not exist."""
    bad = tmp_path / "ckpt-000000000000024-2.pt"
    bad.write_bytes(b"x")
    _refuse_renames_of(monkeypatch, {bad})
    with caplog.at_level(logging.WARNING, logger=ck.log.name):
        ck.set_aside([bad])
    said = " ".join(r.getMessage() for r in caplog.records)
    assert bad.name + ck.DAMAGED not in said and bad.name + ck.REFUSED in said


def test_set_aside_that_could_neither_rename_nor_mark_does_not_log_it_set_aside(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    bad = tmp_path / "ckpt-000000000000024-2.pt"
    bad.write_bytes(b"x")
    _refuse_renames_of(monkeypatch, {bad})

    def full(path: Path, data: object) -> None:
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint_files, "write_atomic", full)
    with caplog.at_level(logging.WARNING, logger=ck.log.name):
        ck.set_aside([bad])
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "set aside as" not in said and "nor mark it refused" in said


def test_save_keeps_the_newest_keep_refused_checkpoints_with_their_sidecars_and_markers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints that got a .refused marker (their rename refused) were never pruned, nor their .json sidecars nor
    the markers: each restart that fell back past one left a whole checkpoint's size behind for good. Pruned with the
    ones set aside (the newest ``keep`` of both kept), the checkpoint first and its marker only once it is gone."""
    pts = [tmp_path / f"ckpt-{n:015d}-{n}.pt" for n in (100, 200, 300, 400)]
    for p in pts:
        p.write_bytes(b"x")
        p.with_suffix(".json").write_text("{}")
    _refuse_renames_of(monkeypatch, {pts[0], pts[0].with_suffix(".json"), pts[2], pts[2].with_suffix(".json")})
    ck.set_aside(pts)  # 100 and 300 refused, 200 and 400 renamed .damaged
    ck.save(tmp_path, {"model": {}}, {"samples_trained": 5}, keep=2)
    left = sorted(p.name for p in tmp_path.glob("ckpt-*") if not p.name.startswith("ckpt-000000000000005-"))
    assert left == sorted([pts[2].name, pts[2].with_suffix(".json").name, pts[2].name + ck.REFUSED,
                           pts[3].name + ck.DAMAGED, pts[3].with_suffix(".json").name + ck.DAMAGED])


def test_a_refused_checkpoint_that_cannot_be_pruned_keeps_its_marker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pts = [tmp_path / f"ckpt-{n:015d}-{n}.pt" for n in (100, 200)]
    for p in pts:
        p.write_bytes(b"x")
    _refuse_renames_of(monkeypatch, set(pts))
    ck.set_aside(pts)
    real = Path.unlink

    def refuse(self: Path, missing_ok: bool = False) -> None:
        if self == pts[0]:
            raise PermissionError(1, "Operation not permitted", str(self))
        real(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    ck.save(tmp_path, {"model": {}}, {"samples_trained": 5}, keep=1)
    assert pts[0].exists() and pts[0].with_name(pts[0].name + ck.REFUSED).exists()
    assert ck.list_checkpoints(tmp_path) == list(tmp_path.glob("ckpt-000000000000005-*.pt"))


def test_a_save_whose_prune_of_an_older_checkpoint_is_refused_still_returns_its_durable_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """keep 1, removing the older checkpoint refused (EPERM): save raised the PermissionError after the new checkpoint
    was durable (the daemon counted a failed checkpoint and committed no group offsets)."""
    first = ck.save(tmp_path, {"model": {}}, {"samples_trained": 5}, keep=1)
    real = Path.unlink

    def refuse(self: Path, missing_ok: bool = False) -> None:
        if self == first:
            raise PermissionError(1, "Operation not permitted", str(self))
        real(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    second = ck.save(tmp_path, {"model": {}}, {"samples_trained": 9}, keep=1)
    assert ck.list_checkpoints(tmp_path) == [first, second]
