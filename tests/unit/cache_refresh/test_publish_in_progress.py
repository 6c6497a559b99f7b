"""``streamrec refresh --status`` tells a publish running now apart from one that never made its version current
(cache_refresh/publish.py ``unfinished``, the ``.publishing.lock`` a publish holds from its move until ``CURRENT`` and
the history name the version). Before, the version a running publish had just moved into ``versions/`` was listed as
``never_current``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cache_refresh import publish as publishing
from cache_refresh.publish import PUBLISHING, publish, refresh_lock, rollback
from cache_refresh.status import status
from learner import artifact_versions as V
from learner.artifact import build_artifact
from learner.artifact_versions import ArtifactError
from tests.unit.cache_refresh.test_rollback_history import killed_before_current
from tests.unit.cache_refresh.test_rollback_lock import ckpt, put  # noqa: F401 - the fixture


def publish_seeing(root: Path, ckpt: dict, version: str, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                   look: Any) -> Any:
    """Publish ``version``, calling ``look()`` after the move into versions/, before CURRENT is written (a publish in
    progress, as another process's ``--status`` or ``--rollback`` finds it); returns what ``look`` returned."""
    real = publishing._set_current
    seen: list[Any] = []

    def set_current(root: Path, name: str) -> None:
        seen.append(look())
        real(root, name)

    with monkeypatch.context() as m:
        m.setattr(publishing, "_set_current", set_current)
        with refresh_lock(root):  # as job.run_once holds it around its publish
            publish(root, build_artifact(ckpt, root, np.zeros(0), format="eager", version=version), keep=5)
    return seen[0]


def test_status_during_a_publish_shows_its_version_as_publishing_not_never_current(
        tmp_path: Path, ckpt: dict, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    put(tmp_path, ckpt, "v001")
    got = publish_seeing(tmp_path, ckpt, "v002", monkeypatch, lambda: status(tmp_path))
    assert got["current"] == "v001" and "v002" in got["versions"]
    assert got.get("publishing") == "v002" and "never_current" not in got
    after = status(tmp_path)  # published: neither
    assert after["current"] == "v002" and "publishing" not in after and "never_current" not in after


def test_a_killed_publish_shows_as_never_current_beside_one_in_progress(
        tmp_path: Path, ckpt: dict, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    put(tmp_path, ckpt, "v001")
    killed_before_current(tmp_path, ckpt, "v002", monkeypatch)  # its process gone: the lock is released
    assert status(tmp_path)["never_current"] == ["v002"] and "publishing" not in status(tmp_path)
    got = publish_seeing(tmp_path, ckpt, "v003", monkeypatch, lambda: status(tmp_path))
    assert got["never_current"] == ["v002"] and got["publishing"] == "v003"


def test_a_rollback_during_a_publish_fails_at_once_and_changes_nothing(
        tmp_path: Path, ckpt: dict, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    put(tmp_path, ckpt, "v001")
    put(tmp_path, ckpt, "v002")

    def roll() -> str:
        with pytest.raises(ArtifactError, match=rf"cannot roll back now: another refresh \(pid {os.getpid()}\)"):
            rollback(tmp_path)
        return "refused"

    assert publish_seeing(tmp_path, ckpt, "v003", monkeypatch, roll) == "refused"
    assert V.current_version(tmp_path) == "v003" and V.read_pin(tmp_path) is None
    assert rollback(tmp_path) == "v002"  # the version that was current, not one moved in and never made current


def test_a_symlink_at_the_publishing_lock_fails_the_publish_with_nothing_changed(
        tmp_path: Path, ckpt: dict) -> None:  # noqa: F811
    put(tmp_path, ckpt, "v001")
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / PUBLISHING).unlink()
    (tmp_path / PUBLISHING).symlink_to(victim)
    with pytest.raises(ArtifactError, match="symbolic link.*nothing was published"):
        put(tmp_path, ckpt, "v002")
    assert V.current_version(tmp_path) == "v001" and V.list_versions(tmp_path) == ["v001"]
    assert victim.read_text() == "keep me"
    assert "never_current" not in status(tmp_path)  # the status cannot probe it: said in the log, nothing misnamed


def test_a_status_probe_that_never_lets_go_delays_a_publish_by_a_bound_not_forever(
        tmp_path: Path, ckpt: dict, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    """A ``--status`` stopped while it holds its shared probe (Ctrl-Z, SIGSTOP) held the nightly publish for as long
    as it stayed stopped: the publish waited on the lock without a bound."""
    import fcntl
    import threading

    put(tmp_path, ckpt, "v001")
    monkeypatch.setattr(publishing, "PUBLISHING_WAIT_S", 0.2)
    fd = os.open(tmp_path / PUBLISHING, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # the stopped status's probe
    try:
        done = threading.Event()
        t = threading.Thread(target=lambda: (put(tmp_path, ckpt, "v002"), done.set()), daemon=True)
        t.start()
        assert done.wait(10), "the publish waited on the status probe without a bound"
    finally:
        os.close(fd)
    assert V.current_version(tmp_path) == "v002"
    assert any("still held by a status probe" in r.getMessage() for r in caplog.records)


def test_a_publish_leaves_no_name_behind_for_the_next_publishs_first_moment(
        tmp_path: Path, ckpt: dict) -> None:  # noqa: F811
    """The lock file kept the last publish's name after it ended: a status in the next publish's moment between its
    lock and its write read that name and, after a rollback made it not current, showed it as ``publishing``."""
    import fcntl

    put(tmp_path, ckpt, "v001")
    put(tmp_path, ckpt, "v002")
    assert rollback(tmp_path) == "v001"
    fd = os.open(tmp_path / PUBLISHING, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a publish that has the lock and has not written its name yet
    try:
        got = status(tmp_path)
    finally:
        os.close(fd)
    assert got["current"] == "v001" and "publishing" not in got


def test_a_hard_linked_publishing_lock_is_refused_and_the_file_it_links_to_left_whole(
        tmp_path: Path, ckpt: dict) -> None:  # noqa: F811
    """Emptying the lock file when a publish ends ran on the refusal's path too: the file a planted hard link pointed
    to was emptied by the publish that refused to touch it."""
    put(tmp_path, ckpt, "v001")
    other = tmp_path / "other.txt"
    other.write_text("precious data")
    (tmp_path / PUBLISHING).unlink()
    os.link(other, tmp_path / PUBLISHING)
    with pytest.raises(ArtifactError, match="not a regular file of its own"):
        put(tmp_path, ckpt, "v002")
    assert other.read_text() == "precious data" and V.current_version(tmp_path) == "v001"
