"""``refresh --status`` on a publish root that does not exist said ``error: None``; ``--rollback`` on a root where
nothing is published said "no version older than None". Both now say what is the matter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from learner import artifact_versions as V
from streamrec.cli import main


def test_status_names_a_missing_or_non_directory_publish_root(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "pub_missing"
    assert main(["refresh", "--status", "--json", "--publish-root", str(missing)]) == 1
    st = json.loads(capsys.readouterr().out)
    assert st["current"] is None and st["versions"] == []
    assert st["error"] == (f"publish root {missing} does not exist: check --publish-root / [refresh] publish_root "
                           "(nothing was published there)")
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["refresh", "--status", "--publish-root", str(afile)]) == 1
    out, err = capsys.readouterr()
    assert f"error: publish root {afile} is not a directory" in out and err == ""


def test_rollback_with_nothing_published_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    V.versions_dir(tmp_path).mkdir(parents=True)
    assert main(["refresh", "--rollback", "--publish-root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err == (f"streamrec refresh: error: nothing to roll back to: no version is published in "
                   f"{V.versions_dir(tmp_path)}\n")
