"""``streamrec refresh --status`` on a publish root whose CURRENT names a version that is gone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from learner import artifact_manifest as M
from learner import artifact_versions as V
from streamrec.cli import main


def status(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    rc = main(["refresh", "--status", "--json", "--publish-root", str(root)])
    return rc, json.loads(capsys.readouterr().out)


def test_current_naming_a_missing_version_is_reported_as_such(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    rc, st = status(tmp_path, capsys)  # nothing published: no error, exit 1
    assert rc == 1 and st["current"] is None and st["error"] is None
    (V.versions_dir(tmp_path) / "v001").mkdir(parents=True)
    (tmp_path / V.CURRENT).write_text("v009\n")
    rc, st = status(tmp_path, capsys)
    assert rc == 1 and st["current"] is None
    assert st["error"] and "names v009, which is not in" in st["error"] and st["versions"] == ["v001"]


def test_status_names_what_in_versions_is_no_complete_version(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Half-written or foreign directories were skipped by pruning and rollback but said nowhere: they hold disk
    and an operator could not tell them from versions."""
    d = V.versions_dir(tmp_path)
    (d / "v001").mkdir(parents=True)
    (d / "v001" / M.MANIFEST).write_text("{}")
    (d / "v002").mkdir()  # half-written: no manifest
    (d / "notes.txt").write_text("x")  # not a version directory
    (d / "bad\x1bname").mkdir()  # a name that is no version name, with a control character
    (d / ".trash-v000-1").mkdir()  # a pruned version being removed: not reported
    _, st = status(tmp_path, capsys)
    assert st["versions"] == ["v001", "v002"]
    left = st["not_versions"]
    assert set(left) == {"'v002'", "'notes.txt'", "'bad\\x1bname'"} and "no manifest.json" in left["'v002'"]
    (d / "v002" / M.MANIFEST).write_text("{}")
    for p in ("notes.txt",):
        (d / p).unlink()
    (d / "bad\x1bname").rmdir()
    _, st = status(tmp_path, capsys)
    assert "not_versions" not in st
