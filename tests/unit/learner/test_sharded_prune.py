"""learner/sharded_checkpoint.py: the retention's deletion of an old sharded checkpoint, killed midway."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from learner import sharded_checkpoint


class Killed(BaseException):
    """The process killed (SIGKILL, OOM) where it is raised: nothing after it runs."""


def _save(directory: Path, step: int) -> Path:
    """A one-process sharded checkpoint (no process group), keeping only the newest one."""
    return sharded_checkpoint.save(directory, {"model": {"w": torch.full((8,), float(step))}}, {"step": step},
                                   {"samples_trained": step, "world_size": 1}, 0, keep=1)


def test_a_prune_killed_after_the_old_checkpoints_meta_went_leaves_nothing_the_next_save_does_not_remove(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(tmp_path, 1)
    real = shutil.rmtree

    def killed_midway(path: Any, *args: Any, **kwargs: Any) -> None:  # rmtree's order is the directory's
        (Path(path) / sharded_checkpoint.META).unlink()
        raise Killed

    monkeypatch.setattr(sharded_checkpoint.shutil, "rmtree", killed_midway)
    with pytest.raises(Killed):
        _save(tmp_path, 2)
    monkeypatch.setattr(sharded_checkpoint.shutil, "rmtree", real)
    newest = _save(tmp_path, 3)

    left = sorted(p.name for p in tmp_path.iterdir() if p.name != "LINEAGE")
    assert left == [newest.name]  # the killed prune's half-deleted checkpoint (its data) did not stay for good
    assert sharded_checkpoint.list_complete(tmp_path) == [newest]


def test_a_prune_whose_listing_fails_leaves_the_checkpoint_written_and_counts_the_prune_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The retention lists the directory once the checkpoint is in place, on rank 0 alone: a listing that failed there
    (EIO) raised out of the save on rank 0 only, the checkpoint in place: the daemon counted a failed checkpoint that
    was written and committed no offsets for it (the other ranks did), and at exit rank 0 ended in exit_save_failed
    beside ranks that had finished. Now the save returns, and the prune failure is logged and counted."""
    import errno

    from prometheus_client import REGISTRY

    _save(tmp_path, 1)
    calls = {"n": 0}
    real = sharded_checkpoint.list_complete

    def eio_at_prune(directory: Path) -> list[Path]:  # the save's own listing (its name) first, then the prune's
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.EIO, "Input/output error", str(directory))
        return real(directory)

    failures = "streamrec_learner_prune_failures_total"
    before = REGISTRY.get_sample_value(failures, {"directory": "checkpoints"}) or 0.0
    monkeypatch.setattr(sharded_checkpoint, "list_complete", eio_at_prune)
    newest = _save(tmp_path, 2)
    monkeypatch.setattr(sharded_checkpoint, "list_complete", real)

    assert calls["n"] == 2 and sharded_checkpoint.list_complete(tmp_path)[-1] == newest
    assert REGISTRY.get_sample_value(failures, {"directory": "checkpoints"}) == before + 1
    assert _save(tmp_path, 3) == sharded_checkpoint.list_complete(tmp_path)[-1]  # the next prune keeps one
    assert len(sharded_checkpoint.list_complete(tmp_path)) == 1
