"""``rollback`` on a read-only or full publish root: one clear error, CURRENT and the pin as they were
(cache_refresh/publish.py, streamrec/commands/refresh.py)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from cache_refresh import publish as publishing
from cache_refresh.publish import rollback
from learner import artifact_versions as V
from learner.artifact_versions import ArtifactError
from stream.files import NotDurable
from streamrec.cli import main
from tests.unit.cache_refresh.test_rollback_lock import ckpt, put  # noqa: F401 - the fixture

REAL_WRITE = publishing.write_atomic


def failing_write(name: str, code: int):
    def write(path: Path, data: bytes) -> None:
        if Path(path).name == name:
            raise OSError(code, "simulated", str(path))
        REAL_WRITE(path, data)

    return write


@pytest.fixture
def root(tmp_path: Path, ckpt: dict) -> Path:  # noqa: F811
    put(tmp_path, ckpt, "v001")
    put(tmp_path, ckpt, "v002")
    return tmp_path


def test_a_read_only_root_fails_before_anything_changes(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(publishing, "write_atomic", failing_write(V.PIN, errno.EROFS))
    with pytest.raises(ArtifactError, match="cannot roll back to v001: writing .*PINNED failed: the file system is "
                                            "read-only.*CURRENT still names v002"):
        rollback(root)
    assert V.current_version(root) == "v002" and V.read_pin(root) is None


def test_a_full_root_after_the_pin_takes_the_pin_back(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(publishing, "write_atomic", failing_write(V.CURRENT, errno.ENOSPC))
    with pytest.raises(ArtifactError, match="writing .*CURRENT failed: the file system is full.*CURRENT still "
                                            "names v002"):
        rollback(root)
    assert V.current_version(root) == "v002" and V.read_pin(root) is None  # no stale pin left behind
    monkeypatch.undo()
    assert rollback(root) == "v001"


def test_a_current_in_place_but_not_durable_and_unreadable_again_is_a_rollback_done_and_recorded(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CURRENT renamed into place, then the root's fsync and every read of CURRENT fail (EIO, NFS). Before, the read
    of CURRENT that was to tell whether it changed raised: the rollback failed ("cannot be read") with CURRENT and the
    pin naming v001, and the history never recorded it (a second rollback went by the wrong history)."""
    real_set, switched = publishing._set_current, []

    def set_current(path: Path, version: str) -> None:
        real_set(path, version)
        switched.append(version)
        raise NotDurable(errno.EIO, f"{path} is in place, but the fsync of its directory failed (Input/output error)")

    def current_version(path: Path) -> str | None:
        if switched:
            raise ArtifactError(f"{path / V.CURRENT} cannot be read (EIO)")
        return "v002"

    monkeypatch.setattr(publishing, "_set_current", set_current)
    monkeypatch.setattr(publishing, "current_version", current_version)
    assert rollback(root) == "v001"
    monkeypatch.undo()
    assert V.current_version(root) == "v001" and V.read_pin(root) is not None
    history = publishing.read_history(root)
    assert history is not None and history.versions[-1] == "v001"


def test_the_cli_says_so_in_one_line_and_exits_1(root: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(publishing, "write_atomic", failing_write(V.PIN, errno.EROFS))
    assert main(["refresh", "--rollback", "--publish-root", str(root)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "streamrec refresh: error: cannot roll back to v001" in err and "read-only" in err

    def unreadable(_root: Path) -> list[str]:
        raise PermissionError(errno.EACCES, "Permission denied", str(V.versions_dir(_root)))

    monkeypatch.setattr(publishing, "list_versions", unreadable)  # any OSError of the publish root
    assert main(["refresh", "--rollback", "--publish-root", str(root)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("streamrec refresh: error: ") and "permission denied" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert V.current_version(root) == "v002"


def test_a_current_renamed_whose_write_reports_eio_is_a_rollback_done_pinned_and_recorded(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rename of CURRENT happened, its write reported EIO all the same (a retransmitted NFS rename). Before, any
    OSError but NotDurable meant "CURRENT unchanged": the pin was taken back and the rollback said "CURRENT still names
    v002" with CURRENT naming v001, unpinned (the next scheduled refresh published over it)."""
    real = publishing.write_atomic

    def write(path: Path, data: bytes) -> None:
        real(path, data)
        if Path(path).name == V.CURRENT:
            raise OSError(errno.EIO, "simulated", str(path))

    monkeypatch.setattr(publishing, "write_atomic", write)
    assert rollback(root) == "v001"
    monkeypatch.undo()
    assert V.current_version(root) == "v001" and V.pin_holding(root) is not None
    history = publishing.read_history(root)
    assert history is not None and history.versions[-1] == "v001"
