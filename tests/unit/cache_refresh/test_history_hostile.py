"""A history of CURRENT (``CURRENT_HISTORY``) holding hostile text: ``refresh --rollback`` refuses it in one short,
printable line naming the file and the fix. Its ``began`` was quoted whole (``{began!r}``): a file of 100 k
characters put 100 k characters on the operator's error line. And ``refresh`` printed its rollback and ``--now``
errors itself, raw, past the one quoting every other command's error line goes through (streamrec/cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cache_refresh import publish as publishing
from learner.artifact_versions import ArtifactError
from streamrec.cli import main
from tests.unit.cache_refresh.test_rollback_lock import ckpt, put  # noqa: F401 - the fixture

HOSTILE = "\x1b[31m" + "A" * 100_000


@pytest.fixture
def root(tmp_path: Path, ckpt: dict) -> Path:  # noqa: F811
    put(tmp_path, ckpt, "v001")
    put(tmp_path, ckpt, "v002")
    (tmp_path / publishing.HISTORY).write_text(json.dumps({"began": HOSTILE, "versions": []}))
    return tmp_path


def test_a_hostile_began_is_quoted_bounded_in_the_error(root: Path) -> None:
    with pytest.raises(ArtifactError) as info:
        publishing.read_history(root)
    text = str(info.value)
    assert text.isprintable() and len(text) < 600 and "began is '\\x1b[31mAAA" in text and "more chars)" in text
    assert "remove it to roll back by the version names alone" in text


def test_refresh_rollback_over_it_is_one_short_printable_error_line_and_exit_1(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["refresh", "--rollback", "--publish-root", str(root)]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.rstrip("\n").isprintable()
    assert err.startswith("streamrec refresh: error: ") and publishing.HISTORY in err and len(err) < 700


def test_any_rollback_error_is_the_clis_error_line_escaped_and_bounded(
        root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def refused(*_args: object, **_kwargs: object) -> str:
        raise ArtifactError("cannot roll back: " + HOSTILE)

    monkeypatch.setattr(publishing, "rollback", refused)
    assert main(["refresh", "--rollback", "--publish-root", str(root)]) == 1
    err = capsys.readouterr().err.rstrip("\n")
    assert err.startswith("streamrec refresh: error: cannot roll back: \\x1b[31mAAA") and err.isprintable()
    assert len(err) < 2100 and err.endswith("more chars)")
