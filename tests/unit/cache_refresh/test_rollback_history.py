"""``rollback`` goes only to a version that was current before (cache_refresh/publish.py, ``CURRENT_HISTORY``): a
version moved into ``versions/`` by a publish that was killed before it wrote ``CURRENT`` is complete and verifies,
and rollback chose it by its name. A root written before the history was kept rolls back as before."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cache_refresh import publish as publishing
from cache_refresh.publish import HISTORY, publish, rollback
from learner import artifact_versions as V
from learner.artifact import build_artifact
from learner.artifact_versions import ArtifactError
from tests.unit.cache_refresh.test_rollback_lock import ckpt, put  # noqa: F401 - the fixture


class Killed(BaseException):
    """The process killed: nothing of publish's own error handling runs."""


def killed_before_current(root: Path, ckpt: dict, version: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """A publish of ``version`` killed after the rename into versions/, before CURRENT was written."""
    def kill(root: Path, version: str) -> None:
        raise Killed

    with monkeypatch.context() as m:
        m.setattr(publishing, "_set_current", kill)
        with pytest.raises(Killed):
            publish(root, build_artifact(ckpt, root, np.zeros(0), format="eager", version=version), keep=5)
    assert (V.versions_dir(root) / version).is_dir()


def test_rollback_skips_a_version_a_killed_publish_left_that_was_never_current(
        tmp_path: Path, ckpt: dict, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    put(tmp_path, ckpt, "v001")
    put(tmp_path, ckpt, "v002")
    killed_before_current(tmp_path, ckpt, "v003", monkeypatch)
    assert V.current_version(tmp_path) == "v002"
    put(tmp_path, ckpt, "v004")
    assert rollback(tmp_path) == "v002"
    assert V.current_version(tmp_path) == "v002"
    assert rollback(tmp_path) == "v001"  # and the next rollback goes on back through versions that were current


def test_rollback_refuses_when_no_older_version_was_ever_current(
        tmp_path: Path, ckpt: dict, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    killed_before_current(tmp_path, ckpt, "v001", monkeypatch)  # the root's first publish, killed
    put(tmp_path, ckpt, "v002")
    with pytest.raises(ArtifactError, match="no version older than v002 .* was ever current \\(v001 never was"
                                            ".*CURRENT still names v002"):
        rollback(tmp_path)
    assert V.current_version(tmp_path) == "v002" and V.read_pin(tmp_path) is None


def test_a_root_written_before_the_history_rolls_back_by_name_and_begins_one(
        tmp_path: Path, ckpt: dict, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    for v in ("v001", "v002", "v003"):
        put(tmp_path, ckpt, v)
    (tmp_path / HISTORY).unlink()  # as a refresh before the history wrote it
    assert rollback(tmp_path) == "v002"  # as before
    history = json.loads((tmp_path / HISTORY).read_text())
    assert history["began"] == "v003" and [e["version"] for e in history["versions"]] == ["v003", "v002"]
    # a later publish killed before CURRENT, then a publish: rollback skips the killed one, still reaches older ones
    killed_before_current(tmp_path, ckpt, "v004", monkeypatch)
    put(tmp_path, ckpt, "v005")
    assert rollback(tmp_path) == "v002"  # live before v005; v004 never was current, v003 was rolled back from
    assert rollback(tmp_path) == "v001"  # predates the history, by name


def test_status_names_the_versions_that_never_were_current(
        tmp_path: Path, ckpt: dict, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from cache_refresh.status import status

    put(tmp_path, ckpt, "v001")
    assert "never_current" not in status(tmp_path)
    killed_before_current(tmp_path, ckpt, "v002", monkeypatch)
    put(tmp_path, ckpt, "v003")
    got = status(tmp_path)
    assert got["current"] == "v003" and got["never_current"] == ["v002"] and "v002" in got["versions"]
    (tmp_path / HISTORY).write_text("{not json")
    got = status(tmp_path)
    assert "never_current" not in got and HISTORY in got["history_error"] and got["current"] == "v003"
