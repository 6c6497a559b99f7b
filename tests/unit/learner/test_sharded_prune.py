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
