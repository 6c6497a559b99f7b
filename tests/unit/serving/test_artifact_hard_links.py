"""A file an artifact's manifest lists that is a hard link (``st_nlink > 1``) is refused (``learner.artifact``'s file
check: an ArtifactError saying why), also when its bytes match the manifest: whoever can write the other path can
change the file between the sha256 check and the load, so a hard link defeats the verification the same way a
symlink out of the version directory would. ``serving.model.ScoringModel.load`` loaded such a file.

Nothing streamrec writes is hard-linked (the refresh builds every file afresh in ``.staging/`` and renames it), so
only a publish root copied with hard links (``cp -al``, ``rsync --link-dest``) meets this: copy it instead."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from cache_refresh.publish import publish
from learner import artifact as A
from learner import artifact_manifest as M
from learner.artifact import build_artifact
from learner.artifact_versions import ArtifactError
from serving.metrics import ServingMetrics
from serving.model import ScoringModel
from serving.swap import ModelHolder, ModelUpdater
from tests.unit.learner.test_artifact import make_checkpoint


@pytest.fixture(scope="module")
def ckpt() -> dict:
    return make_checkpoint()


def hard_link_outside(version_dir: Path, name: str, outside: Path) -> None:
    """Replace ``version_dir/name`` by a hard link to an identical file at ``outside`` (the very bytes)."""
    shutil.copyfile(version_dir / name, outside)
    (version_dir / name).unlink()
    os.link(outside, version_dir / name)
    assert (version_dir / name).stat().st_nlink == 2


@pytest.mark.parametrize("fmt", ["torchscript", "safetensors"])
def test_every_listed_artifact_file_hard_linked_from_outside_is_refused_with_the_reason(
        tmp_path: Path, ckpt: dict, fmt: str) -> None:
    root = tmp_path / "serving"
    version = publish(root, build_artifact(ckpt, root, np.arange(10), format=fmt), keep=3)
    names = sorted(M.read_manifest(version)["files"])
    assert M.COLD_FILE in names and len(names) >= 2
    for name in names:
        hard_link_outside(version, name, tmp_path / f"outside-{name}")
        for load in (lambda: A.verify(version), lambda: ScoringModel.load(version),
                     lambda: ScoringModel.load(version, verify_files=False)):
            with pytest.raises(ArtifactError, match="hard link") as err:
                load()
            assert name in str(err.value) and "after its check" in str(err.value)
        (version / name).unlink()  # back to a file of its own: the artifact loads again
        shutil.copyfile(tmp_path / f"outside-{name}", version / name)
        ScoringModel.load(version)


def test_serving_keeps_the_live_model_when_the_next_version_has_a_hard_linked_scorer(tmp_path: Path,
                                                                                     ckpt: dict) -> None:
    first = publish(tmp_path, build_artifact(ckpt, tmp_path, np.arange(10)), keep=3)
    holder = ModelHolder()
    updater = ModelUpdater(holder, ServingMetrics(holder.model), tmp_path, None, device="cpu")
    updater.check_now()
    assert holder.live is not None and holder.live.model.version_dir == first
    second = publish(tmp_path, build_artifact(ckpt, tmp_path, np.arange(10)), keep=3)
    scorer = next(n for n in M.read_manifest(second)["files"] if n.startswith("scorer"))
    hard_link_outside(second, scorer, tmp_path / "elsewhere.pt")
    updater.check_now()
    assert holder.live is not None and holder.live.model.version_dir == first
    assert "hard link" in (updater.last_error or "")
