"""A new artifact whose load fails for a reason that is not the artifact's (serving's process short of descriptors or
memory; a file serving may not read until an operator fixes its mode) is not refused for good
(``serving/swap.py`` "Failing closed, once"): it is tried again when that passes, and the model serving keeps
answering meanwhile. Real artifacts (``cache_refresh.publish``), the fault injected where the loader opens a file."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from cache_refresh.publish import publish
from learner import artifact as A
from learner import artifact_manifest as M
from learner.artifact import build_artifact
from serving.metrics import ServingMetrics
from serving.swap import STORE_RETRY_S, ModelHolder, ModelUpdater
from tests.unit.learner.test_artifact import make_checkpoint


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _published(root: Path, seed: int) -> Path:
    return publish(root, build_artifact(make_checkpoint(seed=seed), root, np.arange(10)), keep=5)


def _updater(root: Path, clock: Clock | None = None) -> tuple[ModelUpdater, ModelHolder]:
    holder = ModelHolder()
    return ModelUpdater(holder, ServingMetrics(holder.model), root, None, clock=clock or Clock()), holder


def test_an_artifact_whose_load_ran_out_of_descriptors_is_loaded_again_once_they_are_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # EMFILE (a request storm holding every descriptor) at one file's open: the artifact was rejected and remembered
    # by its files, which never change, so serving stayed on the old model (or on none, 503) until the next publish.
    root = tmp_path / "serving"
    _published(root, 0)
    clock = Clock()
    u, holder = _updater(root, clock)
    u.check_now()
    old = holder.live
    v2 = _published(root, 1)
    real, short = A.open_entry, [True]

    def open_entry(dir_fd: int, name: str) -> int:
        if short[0]:
            raise OSError(errno.EMFILE, "Too many open files")
        return real(dir_fd, name)

    monkeypatch.setattr(A, "open_entry", open_entry)
    u.check_now()
    assert holder.live is old  # the model serving keeps answering meanwhile
    short[0] = False
    clock.now += STORE_RETRY_S[0]
    u.check_now()
    assert holder.live is not None and holder.live.model.version == v2.name
    assert holder.problem is None
    assert u.metrics.artifact_store_retries._value.get() == 0  # (no embedding store was asked)


def test_an_artifact_file_serving_could_not_read_is_loaded_once_its_mode_is_repaired(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A listed file published with mode 000 is refused ("cannot be read (Permission denied); check the publish
    # root's permissions"); chmod repairs it but changes neither its size, mtime nor inode: the rejection was
    # remembered by those, and the repaired artifact never loaded. (The tests run as root, whom modes do not stop:
    # the open fails as it does for serving's user while the file has no read bit.)
    root = tmp_path / "serving"
    v1 = _published(root, 0)
    real = A.open_entry

    def open_entry(dir_fd: int, name: str) -> int:
        if not os.stat(name, dir_fd=dir_fd).st_mode & 0o444:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(dir_fd, name)

    monkeypatch.setattr(A, "open_entry", open_entry)
    victim = v1 / M.COLD_FILE
    victim.chmod(0)
    u, holder = _updater(root)
    u.check_now()
    assert holder.live is None and holder.problem is not None and "Permission denied" in holder.problem
    victim.chmod(0o644)
    u.check_now()
    assert holder.live is not None and holder.live.model.version == v1.name



def test_a_version_directory_serving_cannot_stat_is_a_rejection_not_an_error_every_poll(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # CURRENT names a version whose directory serving's user cannot stat (versions/ without its search bit for that
    # user, EACCES; EIO or ESTALE on an NFS root): the updater's is_dir check raised out of check_now, so every poll
    # (0.5 s) logged a traceback, nothing was counted or said in /readyz, and the live model got no delta since the
    # round ended before them. Now a rejection like any other, tried again once the directory can be read.
    root = tmp_path / "serving"
    _published(root, 0)
    u, holder = _updater(root)
    u.check_now()
    old = holder.live
    v2 = _published(root, 1)
    real_stat, denied = Path.stat, [True]

    def stat(self: Path, *args: object, **kwargs: object) -> os.stat_result:
        if denied[0] and self == v2:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_stat(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "stat", stat)
    u.check_now()
    u.check_now()
    assert holder.live is old  # the model serving keeps answering
    assert u.metrics.swap_rejected._value.get() == 1  # counted once, not at every poll
    assert holder.problem is not None and str(v2) in holder.problem and "permission denied" in holder.problem
    denied[0] = False
    u.check_now()
    assert holder.live is not None and holder.live.model.version == v2.name
    assert holder.problem is None
