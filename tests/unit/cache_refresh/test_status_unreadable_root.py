"""``streamrec refresh --status`` on a publish root it may not read (an operator's account, a root-owned ``versions/``
of mode 0700): a status whose ``error`` names the root and the reason, exit 1. Before, the PermissionError of listing
``versions/`` escaped ``job.status`` and the command ended in a Python traceback."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from cache_refresh import job
from learner import artifact as A
from streamrec.cli import main


def test_status_of_a_root_whose_versions_cannot_be_listed_is_an_error_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    (A.versions_dir(tmp_path) / "v001").mkdir(parents=True)
    (tmp_path / A.CURRENT).write_text("v001\n")

    def unreadable(root: Path) -> list[str]:
        raise PermissionError(errno.EACCES, "Permission denied", str(A.versions_dir(root)))

    # (job imported above: a module first imported under the patch, cache_refresh.publish, would keep the fake)
    monkeypatch.setattr(job.artifact, "list_versions", unreadable)  # as root (the tests), a mode of 0700 reads
    rc = main(["refresh", "--status", "--json", "--publish-root", str(tmp_path)])
    st = json.loads(capsys.readouterr().out)
    assert rc == 1 and st["current"] is None
    assert f"cannot read the publish root {tmp_path}" in st["error"] and "permission denied" in st["error"]
