"""What killed refreshes left in a publish root is removed by the next run (cache_refresh/publish.py clean_leftovers),
also when that run has the killed one's pid."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from cache_refresh import job
from cache_refresh.publish import clean_leftovers, refresh_lock
from cache_refresh.settings import RefreshSettings
from learner import artifact_manifest, artifact_versions
from stream.config import KafkaSettings, RedisSettings


def test_leftovers_named_with_this_processs_own_pid_are_an_earlier_processs_and_removed(tmp_path: Path) -> None:
    """A refresh in a container is pid 1 on every run (a CronJob, `docker run`): a staged artifact and the temp files
    of ``CURRENT`` or ``last_run.json`` a killed run left carry the pid the next run has. Holding the lock, with
    nothing of its own in flight, the run knows they are an earlier process's. They were left: the temp files for
    ever, a staged directory (a whole copy of the cold rows) for an hour."""
    root = tmp_path / "serving"
    staged = root / artifact_versions.STAGING / f"20260101T030000000Z-{os.getpid()}"
    staged.mkdir(parents=True)
    (staged / artifact_manifest.COLD_FILE).write_bytes(b"\0" * 1024)
    temps = [root / f".{artifact_versions.CURRENT}.tmp-{os.getpid()}-1", root / f".last_run.json.tmp-{os.getpid()}-2"]
    for t in temps:
        t.write_bytes(b"half")
    with refresh_lock(root):
        cleaned = clean_leftovers(root)
    assert sorted(cleaned) == sorted(str(p.relative_to(root)) for p in [staged, *temps])
    assert not staged.exists() and not any(t.exists() for t in temps)


def test_a_publish_root_that_cannot_be_listed_fails_at_stage_cleanup_not_signing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cleanup of leftovers runs first and lists the publish root; when that fails (permission denied) the run
    fails naming that stage, in its error, alert and ``streamrec_refresh_runs_total{stage}``: it was reported as
    stage ``signing`` (the stage before), sending an operator to the signing key."""
    def unreadable(root: Path) -> list[str]:
        raise PermissionError(errno.EACCES, "Permission denied", str(root / artifact_versions.STAGING))

    monkeypatch.setattr(job, "clean_leftovers", unreadable)
    rs = RefreshSettings(checkpoint_dir=tmp_path / "ckpt", publish_root=tmp_path / "serving", alerts_topic="")
    before = REGISTRY.get_sample_value("streamrec_refresh_runs_total", {"outcome": "failed", "stage": "cleanup"}) or 0
    with pytest.raises(job.RefreshError, match="at cleanup: permission denied") as err:
        job.run_once(rs, KafkaSettings(), RedisSettings())
    assert err.value.stage == "cleanup"
    assert REGISTRY.get_sample_value("streamrec_refresh_runs_total",
                                     {"outcome": "failed", "stage": "cleanup"}) == before + 1
