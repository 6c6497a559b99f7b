"""A ``.staging`` in a publish root that is a symbolic link (planted on a shared volume, or an operator's attempt to
stage on another directory) is removed as a link by the next refresh's cleanup (``cache_refresh/publish.py``
``clean_leftovers``), its target left alone. Before, the cleanup followed it and deleted, in the directory it points
to, every entry older than an hour and every entry whose name ends in ``-<pid>`` of a process that is gone: any
directory the refresh's user may write."""

from __future__ import annotations

import os
import time
from pathlib import Path

from cache_refresh.publish import clean_leftovers, refresh_lock
from learner import artifact


def test_a_symlinked_staging_is_unlinked_and_nothing_in_its_target_is_deleted(tmp_path: Path) -> None:
    root, victim = tmp_path / "serving", tmp_path / "victim"
    root.mkdir()
    victim.mkdir()
    old = victim / "report.csv"
    old.write_text("precious")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    (victim / "build-999999999").mkdir()  # ends in the pid of a process that does not exist
    (root / artifact.STAGING).symlink_to(victim)
    with refresh_lock(root):
        cleaned = clean_leftovers(root)
    assert old.read_text() == "precious" and (victim / "build-999999999").is_dir()
    assert cleaned == [artifact.STAGING]
    assert not (root / artifact.STAGING).is_symlink() and not (root / artifact.STAGING).exists()
