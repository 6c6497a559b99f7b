"""Which files in a checkpoint directory are checkpoints, and which is the newest: by the name a save gives
(``<prefix><samples trained>-<ms>``, compared as numbers), not by the name's text."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from learner import checkpoint as ck
from learner import sharded_checkpoint
from tests.unit.learner.test_checkpoint import meta, state


def test_an_operators_copy_named_otherwise_is_neither_resumed_from_nor_pruned(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``cp ckpt-...100-....pt ckpt-backup.pt``: sorted by name, the copy came after every checkpoint, so a restart
    resumed from it (the state and offsets of the past: its samples trained again) and pruning never removed it."""
    old = ck.save(tmp_path, state(), meta(100), keep=5)
    for suffix in (".pt", ".json"):
        shutil.copy(old.with_suffix(suffix), tmp_path / f"ckpt-backup{suffix}")
    newest = ck.save(tmp_path, state(), meta(200), keep=5)
    with caplog.at_level(logging.WARNING, logger="streamrec.checkpoint"):
        got = ck.load_latest(tmp_path, safe=True)
        assert got is not None and got.path == newest and got.samples_trained == 200
        assert ck.latest_meta(tmp_path)["samples_trained"] == 200
        ck.save(tmp_path, state(), meta(300), keep=1)
    assert (tmp_path / "ckpt-backup.pt").exists() and not old.exists() and not newest.exists()
    said = [r.getMessage() for r in caplog.records if "ckpt-backup.pt" in r.getMessage()]
    assert len(said) == 1 and "not named as a checkpoint" in said[0] and "move it out" in said[0], said


def test_the_newest_checkpoint_is_told_by_its_numbers_not_the_text_of_its_name(tmp_path: Path) -> None:
    """Two checkpoints of one sample count whose times have other widths: ``-9`` sorts after ``-10`` as text."""
    ck.save(tmp_path, state(), meta(100))
    first = sorted(tmp_path.glob("ckpt-*.pt"))[0]
    older, newer = first.with_name("ckpt-000000000000100-9.pt"), first.with_name("ckpt-000000000000100-10.pt")
    first.rename(older)
    shutil.copy(older, newer)
    assert ck.list_checkpoints(tmp_path) == [older, newer]


def test_a_sharded_checkpoints_copy_named_otherwise_is_not_listed(tmp_path: Path) -> None:
    for name in ("dcp-000000000000100-5", "dcp-backup", "dcp-000000000000200-4"):
        (tmp_path / name).mkdir()
        (tmp_path / name / sharded_checkpoint.META).write_text("{}")
    assert [p.name for p in sharded_checkpoint.list_complete(tmp_path)] == ["dcp-000000000000100-5",
                                                                            "dcp-000000000000200-4"]
