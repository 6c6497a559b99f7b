"""Version names are time stamps, and pruning (the newest ``keep_versions`` names stay) and rollback (the newest name
before ``CURRENT``) go by their order. After the clock went back (set ahead, then corrected; a VM restored from a
snapshot), a new version is named after the newest one (``learner.artifact_versions.new_version_name(root=...)``), so
name order stays publish order. Before, it sorted before the versions published while the clock was ahead: pruning
deleted the version it had just replaced and kept those for ever, and a rollback found no version to go back to."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from cache_refresh.publish import publish, rollback
from learner import artifact_versions as V
from learner.artifact import build_artifact
from tests.unit.learner.test_artifact import make_checkpoint

AHEAD = time.time() + 400 * 86400  # a clock a year ahead, corrected since


def test_versions_published_after_the_clock_went_back_keep_publish_order_for_pruning_and_rollback(
        tmp_path: Path) -> None:
    root, ck = tmp_path / "serving", make_checkpoint()
    publish(root, build_artifact(ck, root, np.zeros(0), format="eager", version=V.new_version_name(AHEAD)), keep=2)
    ahead = str(V.current_version(root))
    published = [ahead]
    for _ in range(3):  # the clock is right again
        publish(root, build_artifact(ck, root, np.zeros(0), format="eager"), keep=2)
        published.append(str(V.current_version(root)))
    assert published == sorted(published) and len(set(published)) == 4
    assert V.list_versions(root) == published[-2:]  # the newest two published; the one from ahead pruned in turn
    assert rollback(root) == published[-2]  # back to the version live before


def test_a_new_name_follows_the_newest_and_names_of_another_form_are_no_bound(tmp_path: Path) -> None:
    versions = V.versions_dir(tmp_path)
    versions.mkdir(parents=True)
    now = time.time()
    assert V.new_version_name(now, root=tmp_path) == V.new_version_name(now)  # nothing there
    (versions / "v999").mkdir()
    (versions / "99991231T235959999Z").mkdir()  # no later time: no bound
    (versions / "20261399T000000000Z").mkdir()  # month 13: no time
    assert V.new_version_name(now, root=tmp_path) == V.new_version_name(now)
    (versions / "20991231T235959999Z").mkdir()
    later = V.new_version_name(now, root=tmp_path)
    assert later == "21000101T000000000Z" and V.is_version_name(later)


def test_a_clock_after_the_newest_name_is_used_as_it_is(tmp_path: Path) -> None:
    (V.versions_dir(tmp_path) / "20260101T000000000Z").mkdir(parents=True)
    now = time.time()
    assert V.new_version_name(now, root=tmp_path) == V.new_version_name(now)


def test_a_new_name_is_never_one_that_versions_already_holds(tmp_path: Path) -> None:
    """After ``99991231T235959998Z`` (a stray, or a version of a clock set wildly ahead) the next name was
    ``...999Z``, the last one of the form; from then on every name was that one again, and every refresh built and
    validated an artifact its publish refused ("already exists"), each night for ever. A name no later one can follow
    is no bound: the name is the clock's."""
    versions = V.versions_dir(tmp_path)
    versions.mkdir(parents=True)
    now = time.time()
    (versions / "99991231T235959998Z").mkdir()
    first = V.new_version_name(now, root=tmp_path)
    assert first == "99991231T235959999Z"
    (versions / first).mkdir()  # published
    second = V.new_version_name(now, root=tmp_path)
    assert second == V.new_version_name(now) and not (versions / second).exists()
