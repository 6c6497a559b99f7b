"""The sharded learner's checkpoint at exit failing (a full disk), as one process's (README "Runs": "the one at exit
must succeed (else exit 1 ...)"): :class:`learner.checkpoint_write.ExitCheckpointFailed` naming the directory and the
errno, which ``streamrec train`` prints as one line on each rank (tests/integration/test_learner_exit_save.py)."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from learner import checkpoint, sharded_checkpoint
from learner.batch import to_tensors
from tests.integration.test_learner import sample_batch
from tests.unit.learner.test_sharded_metrics import CFG, run_sharded


def test_a_full_disk_at_the_sharded_exit_checkpoint_is_exit_checkpoint_failed_naming_the_path_and_errno(
        one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exit checkpoint's OSError (ENOSPC, every rank alike: ``sharded_checkpoint.save``) left each torchrun rank's
    ``streamrec train`` as a Python traceback, where one process's exit is one ``streamrec train: error:`` line."""

    def full_disk(directory: Path, *a: Any, **k: Any) -> Path:
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / ".tmp-x"))

    monkeypatch.setattr(sharded_checkpoint, "save", full_disk)
    batches = [to_tensors(sample_batch(np.random.default_rng(0), 4), CFG, [(0, 0, 4)])]
    with pytest.raises(checkpoint.ExitCheckpointFailed, match=r"\[errno ENOSPC\]") as failed:
        run_sharded(tmp_path, monkeypatch, batches)
    assert str(tmp_path / "ckpt") in str(failed.value) and "the file system is full" in str(failed.value)
    assert isinstance(failed.value.__cause__, OSError)


def test_an_exit_oserror_without_an_errno_has_no_errno_tag_and_an_unknown_one_says_its_number(tmp_path: Path) -> None:
    """An ``OSError`` raised with only a message (a library's own ``OSError("...")``) has no errno: its exit line said
    ``[errno None]``; one with an errno names its symbol, and an unknown number is said as the number."""
    plain = str(checkpoint.exit_save_failed(tmp_path, OSError("the mount went away")))
    assert "the mount went away" in plain and "errno" not in plain
    assert "[errno EROFS]" in str(checkpoint.exit_save_failed(tmp_path, OSError(errno.EROFS, "Read-only file system")))
    assert "[errno 9999]" in str(checkpoint.exit_save_failed(tmp_path, OSError(9999, "odd")))
