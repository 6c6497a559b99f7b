"""``rollback`` takes the publish root's refresh lock, and pruning never removes the current or a pinned version
(cache_refresh/publish.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from cache_refresh import publish as publishing
from cache_refresh.publish import publish, refresh_lock, rollback
from learner import artifact as A
from learner import artifact_versions as V
from learner.artifact import build_artifact
from learner.artifact_versions import ArtifactError
from tests.unit.learner.test_artifact import make_checkpoint


@pytest.fixture(scope="module")
def ckpt() -> dict:
    return make_checkpoint()


def put(root: Path, ckpt: dict, version: str, keep: int = 5, over_pin: bool = True) -> Path:
    return publish(root, build_artifact(ckpt, root, np.zeros(0), format="eager", version=version), keep=keep,
                   over_pin=over_pin)


def test_rollback_while_a_refresh_holds_the_lock_fails_naming_it_and_changes_nothing(tmp_path: Path,
                                                                                   ckpt: dict) -> None:
    put(tmp_path, ckpt, "v001")
    put(tmp_path, ckpt, "v002")
    with refresh_lock(tmp_path):
        with pytest.raises(ArtifactError, match=rf"cannot roll back now: another refresh \(pid {os.getpid()}\)"):
            rollback(tmp_path)
    assert V.current_version(tmp_path) == "v002" and V.read_pin(tmp_path) is None
    assert rollback(tmp_path) == "v001"  # released: the rollback goes through


def test_a_publish_racing_a_rollback_cannot_prune_its_target(tmp_path: Path, ckpt: dict,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit's race: a refresh finishes (publish, keep 2) while the rollback verifies its target."""
    put(tmp_path, ckpt, "v001", keep=2)
    put(tmp_path, ckpt, "v002", keep=2)
    staged = build_artifact(ckpt, tmp_path, np.zeros(0), format="eager", version="v003")
    real_verify = publishing.verify
    raced: list[BaseException | Path] = []

    def verify_while_a_refresh_publishes(path: Path, **kw):
        if path.name == "v001" and not raced:  # the rollback's verification of its target
            try:
                with refresh_lock(tmp_path):  # what job.run_once holds around its publish
                    raced.append(publish(tmp_path, staged, keep=2, over_pin=False))
            except ArtifactError as exc:
                raced.append(exc)
        return real_verify(path, **kw)

    monkeypatch.setattr(publishing, "verify", verify_while_a_refresh_publishes)
    assert rollback(tmp_path) == "v001"
    assert isinstance(raced[0], ArtifactError) and "another refresh" in str(raced[0])  # the refresh waited its turn
    current = V.current_version(tmp_path)
    assert current == "v001" and current in V.list_versions(tmp_path)  # CURRENT names a version that exists
    A.verify(V.versions_dir(tmp_path) / current)
    pin = V.read_pin(tmp_path)
    assert pin is not None and pin.holds("v001")
    # the refresh after it (scheduled: respects the pin) publishes nothing and leaves the pin in place
    with pytest.raises(publishing.PinHeld):
        publish(tmp_path, staged, keep=2, over_pin=False)
    assert V.current_version(tmp_path) == "v001" and V.read_pin(tmp_path) is not None


def test_prune_keeps_the_current_and_the_pinned_version(tmp_path: Path, ckpt: dict,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    for v in ("v001", "v002", "v003"):
        put(tmp_path, ckpt, v, keep=5)
    # a pin naming v001 while CURRENT names v003 (written, then CURRENT could not be; or one a publish could not
    # remove): the pinned version is never pruned
    (tmp_path / V.PIN).write_text(json.dumps({"version": "v001", "rolled_back_from": "v002", "at": 1.0}))
    assert publishing._prune(tmp_path, 1) == ["v002"]
    assert V.list_versions(tmp_path) == ["v001", "v003"]

    def cannot(*_a: object) -> None:
        raise OSError("read-only")

    monkeypatch.setattr(publishing, "_clear_pin", cannot)
    put(tmp_path, ckpt, "v004", keep=1, over_pin=False)  # the pin does not hold v003 (stale): published
    assert V.current_version(tmp_path) == "v004" and V.list_versions(tmp_path) == ["v001", "v004"]
    # CURRENT naming an old version (after a rollback) survives a prune with keep 1, as before
    monkeypatch.undo()
    (tmp_path / V.PIN).unlink()
    (tmp_path / V.CURRENT).write_text("v001\n")
    assert publishing._prune(tmp_path, 1) == []
    assert V.list_versions(tmp_path) == ["v001", "v004"]


def test_a_half_written_version_with_a_later_name_does_not_push_good_versions_out(tmp_path: Path,
                                                                                   ckpt: dict) -> None:
    for v in ("v001", "v002"):
        put(tmp_path, ckpt, v, keep=2)
    (V.versions_dir(tmp_path) / "v009").mkdir()  # a crashed writer's, or someone's: no manifest
    put(tmp_path, ckpt, "v003", keep=2)
    # the two newest complete versions stay (v002 is what a rollback falls back to); the directory is left alone
    assert V.list_versions(tmp_path) == ["v002", "v003", "v009"]
    assert rollback(tmp_path) == "v002"
