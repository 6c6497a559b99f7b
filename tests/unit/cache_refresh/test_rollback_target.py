"""A rollback goes to the version live just before the current one, never to one an operator rolled back from
(cache_refresh/publish.py, ``rolled_back_from`` in ``CURRENT_HISTORY``). Before, it went to the newest older version
by name that was ever current: after publish A, B, C, a rollback (C was bad) and a publish of D, the next rollback
made C current again, the version the operator had rejected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cache_refresh.publish import HISTORY, rollback
from learner import artifact_versions as V
from learner.artifact_versions import ArtifactError
from tests.unit.cache_refresh.test_rollback_lock import ckpt, put  # noqa: F401 - the fixture


def test_rollback_after_a_rollback_and_a_publish_goes_to_the_version_live_before_not_the_rejected_one(
        tmp_path: Path, ckpt: dict) -> None:  # noqa: F811
    for v in ("v001", "v002", "v003"):
        put(tmp_path, ckpt, v)
    assert rollback(tmp_path) == "v002"  # v003 was bad
    put(tmp_path, ckpt, "v004")
    assert rollback(tmp_path) == "v002"  # live just before v004; v003 was rolled back from
    assert V.current_version(tmp_path) == "v002"
    assert rollback(tmp_path) == "v001"  # v004 and v003 both rolled back from
    with pytest.raises(ArtifactError, match="rolled back from"):
        rollback(tmp_path)  # nothing left that was live before and not rejected
    assert V.current_version(tmp_path) == "v001"


def test_a_history_written_before_rolled_back_from_was_recorded_still_excludes_its_rejected_versions(
        tmp_path: Path, ckpt: dict) -> None:  # noqa: F811
    for v in ("v001", "v002", "v003"):
        put(tmp_path, ckpt, v)
    assert rollback(tmp_path) == "v002"
    put(tmp_path, ckpt, "v004")
    history = json.loads((tmp_path / HISTORY).read_text())
    history.pop("rolled_back_from", None)  # as the refresh before it wrote the file
    for e in history["versions"]:
        e.pop("from", None)
    (tmp_path / HISTORY).write_text(json.dumps(history))
    assert rollback(tmp_path) == "v002"  # the rollback record's predecessor, v003, was rolled back from
