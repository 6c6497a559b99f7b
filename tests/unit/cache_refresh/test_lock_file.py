"""The publish root's lock (``cache_refresh/publish.py`` ``refresh_lock``) is opened without following a symlink, and
the pid is written only into a regular file of its own: a ``.refresh.lock`` symlink planted in a publish root (a
shared volume) had every refresh truncate its target, any file the refresh's user may write, to the pid. A symlink
there fails the run at stage ``lock`` saying what it is; a hard link or a FIFO is locked but never written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cache_refresh import job
from cache_refresh.publish import LOCK, refresh_lock, rollback
from cache_refresh.settings import RefreshSettings
from learner.artifact_versions import ArtifactError
from stream.config import KafkaSettings, RedisSettings


def test_a_symlink_in_place_of_the_lock_fails_the_run_at_stage_lock_and_leaves_its_target_alone(
        tmp_path: Path) -> None:
    root, victim = tmp_path / "serving", tmp_path / "victim"
    (root / "versions").mkdir(parents=True)
    victim.write_text("precious")
    (root / LOCK).symlink_to(victim)
    rs = RefreshSettings(checkpoint_dir=tmp_path / "ckpt", publish_root=root, alerts_topic="")
    with pytest.raises(job.RefreshError, match=r"at lock: cannot open the publish root's lock .*: it is a symbolic "
                                               r"link, which no refresh makes: remove it"):
        job.run_once(rs, KafkaSettings(), RedisSettings(), sleep=lambda _s: None)
    with pytest.raises(ArtifactError, match="symbolic link"):
        rollback(root)
    assert victim.read_text() == "precious"


def test_a_hard_link_or_a_fifo_is_locked_but_not_written(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "a").mkdir()
    os.link(victim, tmp_path / "a" / LOCK)
    with refresh_lock(tmp_path / "a"):
        pass
    assert victim.read_text() == "precious"
    (tmp_path / "b").mkdir()
    os.mkfifo(tmp_path / "b" / LOCK)
    with refresh_lock(tmp_path / "b"):  # neither hangs nor writes
        pass
    with refresh_lock(tmp_path / "c"):  # the usual case: made, holding the pid
        assert (tmp_path / "c" / LOCK).read_text() == str(os.getpid())
