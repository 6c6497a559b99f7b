"""What a publish does after ``CURRENT`` names its version (cache_refresh/publish.py): pruning keeps the versions a
rollback can go to, and nothing there turns the publish into an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache_refresh import publish as publishing
from cache_refresh.publish import rollback
from learner import artifact as A
from learner.artifact import ArtifactError
from tests.unit.cache_refresh.test_rollback_history import killed_before_current
from tests.unit.cache_refresh.test_rollback_lock import ckpt, put  # noqa: F401 - the fixture


def test_a_version_that_never_was_current_does_not_push_the_rollback_target_out(
        tmp_path: Path, ckpt: dict, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    put(tmp_path, ckpt, "v001", keep=2)
    killed_before_current(tmp_path, ckpt, "v002", monkeypatch)  # complete, verifies, never current
    put(tmp_path, ckpt, "v003", keep=2)
    # before: v001, v002 and v003 counted toward keep 2, v001 (the only version a rollback may go to) was pruned and
    # `--rollback` refused ("no version older than v003 was ever current")
    assert A.list_versions(tmp_path) == ["v001", "v002", "v003"]  # v002 is among the last 2 of all: --status names it
    assert rollback(tmp_path) == "v001"
    put(tmp_path, ckpt, "v004", keep=2)  # an operator's publish over the pin: v001 and v004 are the two counted
    # v002, not among the last 2 of all, is pruned as before; v003, rolled back from, no rollback target, is not counted
    assert A.list_versions(tmp_path) == ["v001", "v003", "v004"]
    assert rollback(tmp_path) == "v001"  # live just before v004 (before: v003, the version rolled back from)


def test_a_prune_that_raises_after_the_switch_leaves_the_publish_done(
        tmp_path: Path, ckpt: dict, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    put(tmp_path, ckpt, "v001")

    def unreadable(*_a: object) -> None:
        raise ArtifactError(f"{tmp_path / A.CURRENT} cannot be read (EIO)")

    monkeypatch.setattr(publishing, "_prune", unreadable)
    # before: the ArtifactError escaped publish() although CURRENT named v002; job.run_once then reported a failed
    # publish and deleted the embedding-store rows of the version that was live
    assert put(tmp_path, ckpt, "v002").name == "v002"
    assert A.current_version(tmp_path) == "v002"
