"""What killed refreshes left in a publish root is removed by the next run (cache_refresh/publish.py clean_leftovers),
also when that run has the killed one's pid."""

from __future__ import annotations

import os
from pathlib import Path

from cache_refresh.publish import clean_leftovers, refresh_lock
from learner import artifact


def test_leftovers_named_with_this_processs_own_pid_are_an_earlier_processs_and_removed(tmp_path: Path) -> None:
    """A refresh in a container is pid 1 on every run (a CronJob, `docker run`): a staged artifact and the temp files
    of ``CURRENT`` or ``last_run.json`` a killed run left carry the pid the next run has. Holding the lock, with
    nothing of its own in flight, the run knows they are an earlier process's. They were left: the temp files for
    ever, a staged directory (a whole copy of the cold rows) for an hour."""
    root = tmp_path / "serving"
    staged = root / artifact.STAGING / f"20260101T030000000Z-{os.getpid()}"
    staged.mkdir(parents=True)
    (staged / artifact.COLD_FILE).write_bytes(b"\0" * 1024)
    temps = [root / f".{artifact.CURRENT}.tmp-{os.getpid()}-1", root / f".last_run.json.tmp-{os.getpid()}-2"]
    for t in temps:
        t.write_bytes(b"half")
    with refresh_lock(root):
        cleaned = clean_leftovers(root)
    assert sorted(cleaned) == sorted(str(p.relative_to(root)) for p in [staged, *temps])
    assert not staged.exists() and not any(t.exists() for t in temps)
