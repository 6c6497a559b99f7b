"""A ``.staging`` in a publish root that is a symbolic link (planted on a shared volume, or an operator's attempt to
stage on another directory) is removed as a link by the next refresh's cleanup (``cache_refresh/publish.py``
``clean_leftovers``), its target left alone. Before, the cleanup followed it and deleted, in the directory it points
to, every entry older than an hour and every entry whose name ends in ``-<pid>`` of a process that is gone: any
directory the refresh's user may write."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from cache_refresh.publish import clean_leftovers, refresh_lock
from learner import artifact_versions


def test_a_symlinked_staging_is_unlinked_and_nothing_in_its_target_is_deleted(tmp_path: Path) -> None:
    root, victim = tmp_path / "serving", tmp_path / "victim"
    root.mkdir()
    victim.mkdir()
    old = victim / "report.csv"
    old.write_text("precious")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    (victim / "build-999999999").mkdir()  # ends in the pid of a process that does not exist
    (root / artifact_versions.STAGING).symlink_to(victim)
    with refresh_lock(root):
        cleaned = clean_leftovers(root)
    assert old.read_text() == "precious" and (victim / "build-999999999").is_dir()
    assert cleaned == [artifact_versions.STAGING]
    assert not (root / artifact_versions.STAGING).is_symlink() and not (root / artifact_versions.STAGING).exists()


def _victim(tmp_path: Path) -> tuple[Path, Path]:
    root, victim = tmp_path / "serving", tmp_path / "victim"
    (root / artifact_versions.STAGING).mkdir(parents=True)
    victim.mkdir()
    (victim / "build-999999999").mkdir()  # ends in the pid of a process that does not exist
    return root, victim


def test_a_staging_swapped_for_a_symlink_after_the_check_is_not_followed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``.staging`` replaced by a link between the cleanup's check (a directory, no link) and its listing: the
    listing followed the link and deleted the dead-pid-named entries of the directory it points to."""
    root, victim = _victim(tmp_path)
    staging, real_is_symlink = root / artifact_versions.STAGING, Path.is_symlink

    def is_symlink_then_swapped(self: Path) -> bool:
        answer = real_is_symlink(self)
        if self == staging and not answer:  # the race: checked a directory, then made a link
            staging.rmdir()
            staging.symlink_to(victim)
        return answer

    monkeypatch.setattr(Path, "is_symlink", is_symlink_then_swapped)
    with refresh_lock(root):
        clean_leftovers(root)
    assert (victim / "build-999999999").is_dir()


def test_a_staging_link_removed_before_it_is_read_is_no_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The link gone between the check and reading where it points (``os.readlink``): the FileNotFoundError ended the
    cleanup, and the refresh with it."""
    root, victim = _victim(tmp_path)
    staging = root / artifact_versions.STAGING
    staging.rmdir()
    staging.symlink_to(victim)
    real_readlink = os.readlink

    def removed_first(path: Any) -> str:
        os.unlink(path)
        return real_readlink(path)

    monkeypatch.setattr(os, "readlink", removed_first)
    with refresh_lock(root):
        clean_leftovers(root)
    assert not staging.exists() and not staging.is_symlink() and (victim / "build-999999999").is_dir()
