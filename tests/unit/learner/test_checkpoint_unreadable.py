"""learner/checkpoint_read.load_latest: a newest checkpoint this process may not read (EACCES: a backup tool's or
another user's mode) is no damaged file to the learner's resume: a CheckpointError naming it and the fix, never a
resume from the previous checkpoint (which set the newest aside and pruned it, training lost for good)."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from learner import checkpoint as ck
from learner import checkpoint_read
from stream import files
from tests.unit.learner.test_checkpoint import meta, state


def _newest_unreadable(monkeypatch: pytest.MonkeyPatch, newest: Path) -> None:
    real = files.open_regular

    @contextlib.contextmanager
    def denied(path: Path) -> Iterator[Any]:
        if Path(path) == newest:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        with real(path) as opened:
            yield opened

    monkeypatch.setattr(checkpoint_read, "open_regular", denied)


def test_the_learners_resume_refuses_a_newest_checkpoint_it_may_not_read_naming_it_and_the_fix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck.save(tmp_path, state(), meta(100))
    newest = ck.save(tmp_path, state(), meta(200))
    _newest_unreadable(monkeypatch, newest)

    with pytest.raises(ck.CheckpointError) as info:
        ck.restore_latest(tmp_path, check=lambda c: None)
    assert str(newest) in str(info.value) and "permission denied" in str(info.value)
    assert "read access" in str(info.value)


def test_the_refresh_still_skips_a_newest_checkpoint_it_may_not_read_and_reports_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = ck.save(tmp_path, state(), meta(100))
    newest = ck.save(tmp_path, state(), meta(200))
    _newest_unreadable(monkeypatch, newest)

    problems: list[tuple[Path, str]] = []
    got = ck.load_latest(tmp_path, problems=problems, accept=lambda c: None)
    assert got is not None and got.path == first and [p for p, _ in problems] == [newest]
