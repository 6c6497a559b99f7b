"""``streamrec refresh --status`` on a publish root it may not read (an operator's account, a root-owned ``versions/``
of mode 0700): a status whose ``error`` names the root and the reason, exit 1. Before, the PermissionError of listing
``versions/`` escaped ``cache_refresh.status.status`` and the command ended in a Python traceback."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from cache_refresh import status as refresh_status
from learner import artifact_versions as V
from streamrec.cli import main


def test_status_of_a_root_whose_versions_cannot_be_listed_is_an_error_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    (V.versions_dir(tmp_path) / "v001").mkdir(parents=True)
    (tmp_path / V.CURRENT).write_text("v001\n")

    def unreadable(root: Path) -> list[str]:
        raise PermissionError(errno.EACCES, "Permission denied", str(V.versions_dir(root)))

    # (status imported above: a module first imported under the patch, cache_refresh.publish, would keep the fake)
    # as root (the tests), a mode of 0700 reads
    monkeypatch.setattr(refresh_status.artifact_versions, "list_versions", unreadable)
    rc = main(["refresh", "--status", "--json", "--publish-root", str(tmp_path)])
    st = json.loads(capsys.readouterr().out)
    assert rc == 1 and st["current"] is None
    assert f"cannot read the publish root {tmp_path}" in st["error"] and "permission denied" in st["error"]


def test_status_of_a_root_in_a_directory_it_may_not_search_is_an_error_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The root's own stat failing (its parent of mode 0700, another user's): ``Path.is_dir`` raises PermissionError
    (only a missing path is False), which escaped ``cache_refresh.status.status`` as a traceback."""
    root = tmp_path / "serving"
    real_stat = Path.stat

    def stat(self: Path, *args: object, **kwargs: object) -> object:
        if self == root:  # as root (the tests), a parent of mode 0700 is searched all the same
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_stat(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "stat", stat)
    rc = main(["refresh", "--status", "--json", "--publish-root", str(root)])
    st = json.loads(capsys.readouterr().out)
    assert rc == 1 and st["current"] is None
    assert f"cannot read the publish root {root}" in st["error"] and "permission denied" in st["error"]
