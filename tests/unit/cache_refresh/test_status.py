"""``streamrec refresh --status`` on a publish root whose CURRENT names a version that is gone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from learner import artifact as A
from streamrec.cli import main


def status(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    rc = main(["refresh", "--status", "--json", "--publish-root", str(root)])
    return rc, json.loads(capsys.readouterr().out)


def test_current_naming_a_missing_version_is_reported_as_such(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    rc, st = status(tmp_path, capsys)  # nothing published: no error, exit 1
    assert rc == 1 and st["current"] is None and st["error"] is None
    (A.versions_dir(tmp_path) / "v001").mkdir(parents=True)
    (tmp_path / A.CURRENT).write_text("v009\n")
    rc, st = status(tmp_path, capsys)
    assert rc == 1 and st["current"] is None
    assert st["error"] and "names v009, which is not in" in st["error"] and st["versions"] == ["v001"]
