"""The last-success gauge without ``last_run.json`` (cache_refresh/job.py ``restore_last_success``): a fresh state dir,
a deleted or unreadable file, a new container with the publish root mounted. With a version live the gauge starts from
that version's publish time (its manifest's ``created``, else ``CURRENT``'s modification time); it said 0 (the
dashboard's "time since the last success": ~56 years, and a staleness alert on it fired at once). Only a root where
nothing is live leaves it at 0."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from cache_refresh import metrics, run_records
from cache_refresh.publish import publish
from learner import artifact_manifest as M
from learner import artifact_versions as V
from learner.artifact import build_artifact
from tests.unit.learner.test_artifact import make_checkpoint

GAUGE = "streamrec_refresh_last_success_timestamp_seconds"


def gauge() -> float | None:
    return REGISTRY.get_sample_value(GAUGE)


@pytest.fixture(autouse=True)
def fresh_gauge(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's gauge as a restarted scheduler's: 0 (it only moves forward; other tests published)."""
    was = gauge() or 0.0
    monkeypatch.setattr(metrics, "_last_success", 0.0)
    metrics.LAST_SUCCESS.set(0.0)
    yield
    metrics.LAST_SUCCESS.set(was)


def published(root: Path) -> Path:
    """``root`` with one version live, published as a refresh does, and no last_run.json."""
    version = publish(root, build_artifact(make_checkpoint(), root, np.zeros(0), format="eager", version="v001"),
                      keep=3)
    assert not (root / run_records.LAST_RUN).exists()
    return version


@pytest.mark.parametrize("record", [None, b"[" * 100_000, b'{"last_success": null}'],
                         ids=["missing", "not-json", "no-time"])
def test_without_a_usable_last_run_json_the_gauge_is_the_live_versions_publish_time(
        tmp_path: Path, record: bytes | None) -> None:
    version = published(tmp_path)
    if record is not None:
        (tmp_path / run_records.LAST_RUN).write_bytes(record)
    created = json.loads((version / M.MANIFEST).read_text())["created"]
    assert run_records.restore_last_success(tmp_path) is None  # no record: the scheduler's catch-up is unchanged
    assert gauge() == pytest.approx(created)


def test_a_live_version_whose_manifest_cannot_be_read_gives_currents_modification_time(tmp_path: Path) -> None:
    version = published(tmp_path)
    (version / M.MANIFEST).write_bytes(b"{not json")
    os.utime(tmp_path / V.CURRENT, (1_750_000_000.0, 1_750_000_000.0))
    run_records.restore_last_success(tmp_path)
    assert gauge() == pytest.approx(1_750_000_000.0)


def test_a_record_in_last_run_json_is_the_last_success(tmp_path: Path) -> None:
    published(tmp_path)
    run_records.write_last_success(tmp_path, 1_700_000_000.5, "v001")
    assert run_records.restore_last_success(tmp_path) is not None
    assert gauge() == pytest.approx(1_700_000_000.5)


@pytest.mark.parametrize("root", ["empty", "missing", "dangling", "malformed"])
def test_with_nothing_live_the_gauge_stays_0(tmp_path: Path, root: str) -> None:
    if root == "empty":
        (tmp_path / V.VERSIONS).mkdir()
    elif root == "dangling":  # CURRENT names a version that is gone
        published(tmp_path)
        (tmp_path / V.CURRENT).write_text("v999\n")
    elif root == "malformed":
        (tmp_path / V.CURRENT).write_text("../elsewhere\n")
    path = tmp_path / "nothing" if root == "missing" else tmp_path
    assert run_records.restore_last_success(path) is None
    assert gauge() == 0.0
