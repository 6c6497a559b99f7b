"""What ``serving.model.ScoringModel.load`` loads is what it verified: each file the manifest lists is opened once,
checked and hashed from that descriptor, and loaded from it (``learner.artifact.open_artifact``).

Before, every file was checked and hashed by path, then opened again by path to load it: whoever could write the
version directory (without the signing key) renamed another file over a listed one between the two, and serving
loaded bytes no manifest listed, with a signing key configured. The test does that rename right after the last listed
file is hashed (wrapping ``learner.artifact.sha256_file``, the digest step: every file passed its check), so the race
is hit every time: the load must then either refuse the artifact or load exactly the bytes the signed manifest
lists."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cache_refresh.publish import publish
from learner import artifact as A
from learner import artifact_manifest as M
from learner.artifact import build_artifact
from learner.artifact_versions import ArtifactError
from learner.tensorpack import SigningKey
from serving.model import ScoringModel
from tests.unit.learner.test_artifact import make_checkpoint

KEY = SigningKey(b"signing-key-of-this-deployment-0001")


def _state(model: ScoringModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model._live.scorer.state_dict().items()}


@pytest.mark.parametrize("fmt", ["torchscript", "safetensors"])
def test_files_renamed_over_listed_ones_after_their_check_are_never_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    root = tmp_path / "serving"
    version = publish(root, build_artifact(make_checkpoint(seed=0), root, np.arange(10), format=fmt,
                                           signing_key=KEY), keep=3, signing_key=KEY)
    reference = shutil.copytree(version, tmp_path / "untouched")
    want = ScoringModel.load(reference, signing_key=KEY)
    # Unverified files of the same names, sizes and formats (another checkpoint's, and a table of other values),
    # put beside the listed ones for the rename.
    other = build_artifact(make_checkpoint(seed=1), tmp_path / "other", np.arange(10), format=fmt)
    names = sorted(M.read_manifest(version)["files"])
    for name in names:
        shutil.copyfile(other / name, version / f".evil-{name}")
    np.save(version / f".evil-{M.COLD_FILE}", np.load(version / M.COLD_FILE) + 1.0)
    real_hash, hashed, swapped = A.sha256_file, [], []
    by_path = [n for n in names if n != M.COLD_FILE]  # the table's digest is taken as it is read (read_table)

    def hash_then_swap(source: Any) -> str:
        digest = real_hash(source)
        hashed.append(digest)
        if len(hashed) == len(by_path):  # every listed file checked: each is replaced by rename
            for name in names:
                os.replace(version / f".evil-{name}", version / name)
            swapped.append(True)
        return digest

    monkeypatch.setattr(A, "sha256_file", hash_then_swap)
    try:
        got = ScoringModel.load(version, signing_key=KEY)
    except ArtifactError:
        got = None  # refused: nothing unverified was loaded
    assert swapped == [True]
    if got is not None:  # loaded: exactly the verified bytes
        assert np.array_equal(np.asarray(got.table), np.asarray(want.table)), "a table no manifest lists was loaded"
        have, expected = _state(got), _state(want)
        assert have.keys() == expected.keys()
        assert all(torch.equal(have[k], expected[k]) for k in expected), "a scorer no manifest lists was loaded"
