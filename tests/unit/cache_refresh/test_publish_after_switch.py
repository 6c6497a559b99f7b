"""What a publish does after ``CURRENT`` names its version (cache_refresh/publish.py): pruning keeps the versions a
rollback can go to, and nothing there turns the publish into an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache_refresh import publish as publishing
from learner import artifact as A
from learner.artifact import ArtifactError
from tests.unit.cache_refresh.test_rollback_lock import ckpt, put  # noqa: F401 - the fixture


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
