"""A serving artifact written by a newer streamrec, read by this one (a rolling upgrade that ran the refresh first, a
rollback of serving): refused when its manifest is read, with an error that says to upgrade serving, not to rebuild
it (a `refresh --now` of the newer refresh job builds the same again)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from learner import artifact_manifest as M
from learner.artifact import build_artifact
from learner.artifact_manifest import decode_manifest
from learner.artifact_versions import ArtifactError
from learner.scorer import SCORER_LAYOUTS
from serving.model import ScoringModel
from tests.unit.learner.test_artifact import make_checkpoint


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    staged = build_artifact(make_checkpoint(), tmp_path_factory.mktemp("a"), np.arange(10), format="safetensors")
    return json.loads((Path(staged) / M.MANIFEST).read_text())


def test_this_streamrecs_manifest_reads(manifest: dict[str, Any]) -> None:
    assert decode_manifest(json.dumps(manifest).encode())["version"] == manifest["version"]


@pytest.mark.parametrize("change", [
    {"artifact_format_version": M.ARTIFACT_FORMAT_VERSION + 1},
    {"scorer": {"input_layout": max(SCORER_LAYOUTS) + 1}},
])
def test_a_newer_streamrecs_manifest_is_refused_saying_to_upgrade_serving(
        manifest: dict[str, Any], change: dict[str, Any]) -> None:
    newer = {**manifest, **{k: {**manifest[k], **v} if isinstance(v, dict) else v for k, v in change.items()}}
    said = r"newer streamrec built it: upgrade the streamrec reading it \(serving, or a refresh job"
    with pytest.raises(ArtifactError, match=said) as err:
        decode_manifest(json.dumps(newer).encode())
    assert "rebuild it" not in str(err.value)


@pytest.mark.parametrize("change", [{"artifact_format_version": 0}, {"scorer": {"input_layout": 0}}])
def test_a_manifest_version_no_streamrec_writes_is_still_refused_as_one_to_rebuild(
        manifest: dict[str, Any], change: dict[str, Any]) -> None:
    older = {**manifest, **{k: {**manifest[k], **v} if isinstance(v, dict) else v for k, v in change.items()}}
    with pytest.raises(ArtifactError, match=r"refresh --now"):
        decode_manifest(json.dumps(older).encode())


def test_a_scorer_format_added_by_a_newer_streamrec_is_refused_at_load_saying_to_upgrade_not_corrupt(
        tmp_path: Path) -> None:
    """A format name this version does not know read as "corrupt or not this streamrec's; republish": the newer
    refresh job republishes the same format, so the message must point at the reader."""
    staged = Path(build_artifact(make_checkpoint(), tmp_path, np.arange(10), format="safetensors"))
    m = json.loads((staged / M.MANIFEST).read_text())
    (staged / M.MANIFEST).write_text(json.dumps({**m, "format": "safetensors_fp8"}))
    with pytest.raises(ArtifactError, match=r"format 'safetensors_fp8' is not one this streamrec reads \(.*\); a "
                                            r"newer streamrec built it: upgrade the streamrec reading it") as err:
        ScoringModel.load(staged)
    assert "corrupt" not in str(err.value)


@pytest.mark.parametrize("fmt", [3, "", "../scorer", "x" * 200])
def test_a_format_that_is_no_format_name_still_reads_as_corrupt(manifest: dict[str, Any], fmt: Any) -> None:
    with pytest.raises(ArtifactError, match=r"format is .*, expected one of .*corrupt"):
        decode_manifest(json.dumps({**manifest, "format": fmt}).encode())
