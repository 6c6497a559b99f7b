"""What a publish does after ``CURRENT`` names its version (cache_refresh/publish.py): pruning keeps the versions a
rollback can go to, and nothing there (an error of a prune, of the close of a lock, of the fsync that makes CURRENT
durable) turns the publish into an error or takes the version CURRENT names back out: it is a warning of the publish."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from cache_refresh import publish as publishing
from cache_refresh.publish import rollback
from learner import artifact_manifest as M
from learner import artifact_versions as V
from learner.artifact import build_artifact
from learner.artifact_versions import ArtifactError
from stream import files
from tests.unit.cache_refresh.test_rollback_history import killed_before_current
from tests.unit.cache_refresh.test_rollback_lock import ckpt, put  # noqa: F401 - the fixture


def test_a_version_that_never_was_current_does_not_push_the_rollback_target_out(
        tmp_path: Path, ckpt: dict, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    put(tmp_path, ckpt, "v001", keep=2)
    killed_before_current(tmp_path, ckpt, "v002", monkeypatch)  # complete, verifies, never current
    put(tmp_path, ckpt, "v003", keep=2)
    # before: v001, v002 and v003 counted toward keep 2, v001 (the only version a rollback may go to) was pruned and
    # `--rollback` refused ("no version older than v003 was ever current")
    assert V.list_versions(tmp_path) == ["v001", "v002", "v003"]  # v002 is among the last 2 of all: --status names it
    assert rollback(tmp_path) == "v001"
    put(tmp_path, ckpt, "v004", keep=2)  # an operator's publish over the pin: v001 and v004 are the two counted
    # v002, not among the last 2 of all, is pruned as before; v003, rolled back from, no rollback target, is not counted
    assert V.list_versions(tmp_path) == ["v001", "v003", "v004"]
    assert rollback(tmp_path) == "v001"  # live just before v004 (before: v003, the version rolled back from)


def test_a_prune_that_raises_after_the_switch_leaves_the_publish_done(
        tmp_path: Path, ckpt: dict, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    put(tmp_path, ckpt, "v001")

    def unreadable(*_a: object) -> None:
        raise ArtifactError(f"{tmp_path / V.CURRENT} cannot be read (EIO)")

    monkeypatch.setattr(publishing, "_prune", unreadable)
    # before: the ArtifactError escaped publish() although CURRENT named v002; job.run_once then reported a failed
    # publish and deleted the embedding-store rows of the version that was live
    assert put(tmp_path, ckpt, "v002").name == "v002"
    assert V.current_version(tmp_path) == "v002"


def close_fails_for(monkeypatch: pytest.MonkeyPatch, name: str) -> list[str]:
    """``os.close`` of a descriptor of the file ``name`` closes it and then reports EIO (as close on NFS may); returns
    the paths it failed for."""
    real, failed = os.close, []

    def close(fd: int) -> None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        real(fd)
        if path.endswith(f"/{name}"):
            failed.append(path)
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "close", close)
    return failed


def test_a_close_of_the_publishing_lock_that_reports_eio_after_the_switch_leaves_the_publish_done_and_warned(
        tmp_path: Path, ckpt: dict, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    put(tmp_path, ckpt, "v001")
    staged = build_artifact(ckpt, tmp_path, np.zeros(0), format="eager", version="v002")
    failed = close_fails_for(monkeypatch, publishing.PUBLISHING)
    # before: the OSError of the close escaped publish() with CURRENT naming v002; the run then reported "nothing was
    # published" and deleted v002's embedding-store rows (tests/integration/test_refresh.py)
    assert publishing.publish(tmp_path, staged, keep=5).name == "v002"
    assert failed and V.current_version(tmp_path) == "v002" and V.read_current(tmp_path) is not None
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    # the publish's close, and the prune's probe of the lock (whose close failing had failed the prune): nothing else
    assert len(warned) == 2 and all(f"{publishing.PUBLISHING} failed" in w for w in warned)
    monkeypatch.undo()
    assert put(tmp_path, ckpt, "v003").name == "v003"  # the lock was released all the same


def test_a_refresh_lock_whose_close_reports_eio_is_released_and_raises_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failed = close_fails_for(monkeypatch, publishing.LOCK)
    with publishing.refresh_lock(tmp_path):  # before: the EIO escaped run_once after its publish (no summary)
        pass
    assert failed
    with publishing.refresh_lock(tmp_path):  # released: taken again at once
        pass


def test_current_in_place_whose_fsync_fails_keeps_its_version_even_when_current_cannot_be_read_again(
        tmp_path: Path, ckpt: dict, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    put(tmp_path, ckpt, "v001")
    staged = build_artifact(ckpt, tmp_path, np.zeros(0), format="eager", version="v002")
    real_fsync, real_current = files.fsync_dir, publishing.current_version
    failing: list[Path] = []

    def fsync_dir(path: Path) -> None:  # the root's fsync after CURRENT's rename: EIO (NFS), and reads fail since
        if Path(path) == tmp_path:
            failing.append(path)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(path)

    def current_version(root: Path) -> str | None:
        if failing:
            raise ArtifactError(f"{root / V.CURRENT} cannot be read (EIO)")
        return real_current(root)

    monkeypatch.setattr(files, "fsync_dir", fsync_dir)
    monkeypatch.setattr(publishing, "current_version", current_version)
    # before: CURRENT could not be read again, so v002 was taken back out of versions/ while CURRENT named it (no model
    # for serving) and publish() raised "nothing was published, CURRENT still names v001"
    assert publishing.publish(tmp_path, staged, keep=5).name == "v002"
    monkeypatch.undo()
    assert V.current_version(tmp_path) == "v002" and V.read_current(tmp_path) == V.versions_dir(tmp_path) / "v002"
    assert "v002 is current, but making that durable failed" in caplog.text


def current_written_then_eio(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """``write_atomic`` of ``CURRENT`` renames the new file into place and then reports EIO, not NotDurable (an NFS
    rename the server did whose reply was lost: the retransmitted one fails); returns the paths it did that for."""
    real, done = publishing.write_atomic, []

    def write(path: Path, data: bytes) -> None:
        real(path, data)
        if Path(path).name == V.CURRENT:
            done.append(Path(path))
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(publishing, "write_atomic", write)
    return done


def test_current_renamed_whose_write_reports_eio_is_a_publish_and_its_version_stays(
        tmp_path: Path, ckpt: dict, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    put(tmp_path, ckpt, "v001")
    staged = build_artifact(ckpt, tmp_path, np.zeros(0), format="eager", version="v002")
    done = current_written_then_eio(monkeypatch)
    said: list[str] = []
    # before: any OSError but NotDurable was taken as "CURRENT as it was": v002 was taken back out of versions/ under
    # a CURRENT naming it (no model for a restarting server) and publish() said "nothing was published"
    assert publishing.publish(tmp_path, staged, keep=5, warnings=said).name == "v002"
    monkeypatch.undo()
    assert done and V.current_version(tmp_path) == "v002"
    assert V.read_current(tmp_path) == V.versions_dir(tmp_path) / "v002"
    assert any("v002 is current, but its write reported an error" in w for w in said)


def test_current_renamed_whose_write_reports_eio_and_cannot_be_read_again_leaves_the_version_in_place(
        tmp_path: Path, ckpt: dict, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    put(tmp_path, ckpt, "v001")
    staged = build_artifact(ckpt, tmp_path, np.zeros(0), format="eager", version="v002")
    done = current_written_then_eio(monkeypatch)
    real_current = publishing.current_version

    def current_version(root: Path) -> str | None:
        if done:
            raise ArtifactError(f"{root / V.CURRENT} cannot be read (EIO)")
        return real_current(root)

    monkeypatch.setattr(publishing, "current_version", current_version)
    # not known whether v002 is live: an error saying so, and v002 is not taken out from under a CURRENT that may
    # name it (before: taken out, and CURRENT, which did name it, dangled)
    with pytest.raises(ArtifactError, match="whether v002 is live is not known"):
        publishing.publish(tmp_path, staged, keep=5)
    monkeypatch.undo()
    assert V.current_version(tmp_path) == "v002"
    assert V.read_current(tmp_path) == V.versions_dir(tmp_path) / "v002"


def test_a_version_taken_back_out_whose_removal_fails_half_way_leaves_only_what_clean_leftovers_removes(
        tmp_path: Path, ckpt: dict, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    put(tmp_path, ckpt, "v001")
    staged = build_artifact(ckpt, tmp_path, np.zeros(0), format="eager", version="v002")
    real_write, real_rename = publishing.write_atomic, os.rename

    def write(path: Path, data: bytes) -> None:
        if Path(path).name == V.CURRENT:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(path, data)

    def rename(src: object, dst: object) -> None:
        if Path(str(dst)) == staged:  # the rename back to staging fails (EIO)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_rename(src, dst)

    def rmtree(path: object, ignore_errors: bool = False) -> None:  # removes the manifest, then fails (EIO)
        (Path(str(path)) / M.MANIFEST).unlink(missing_ok=True)

    monkeypatch.setattr(publishing, "write_atomic", write)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(publishing.shutil, "rmtree", rmtree)
    with pytest.raises(ArtifactError, match="nothing was published, CURRENT still names v001"):
        publishing.publish(tmp_path, staged, keep=5)
    monkeypatch.undo()
    # before: versions/v002 stayed without its manifest: no prune removes such a directory (it may be a foreign one)
    assert V.list_versions(tmp_path) == ["v001"] and V.current_version(tmp_path) == "v001"
    publishing.clean_leftovers(tmp_path)
    assert sorted(p.name for p in V.versions_dir(tmp_path).iterdir()) == ["v001"]
