"""The scorer's hot buffers are checked at load (``learner.scorer.hot_problem``): an artifact whose files match its
manifest (digests and all: a writer other than ``build_artifact``, or one of its bugs) but whose ``hot_ids`` are not
what every lookup searches (sorted distinct rows of the table, then the sentinel) or whose ``hot_vectors`` do not
hold one row per id is refused, the live model kept. The probe scores each field's first row only: such an artifact
passed it, went live, and every request holding a row past its last hot row was an IndexError (a 500)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from cache_refresh.publish import publish
from learner.artifact import build_artifact, check_checkpoint
from learner.artifact_manifest import MANIFEST
from learner.artifact_versions import ArtifactError
from learner.scorer import SCORER_FILES
from serving.model import ScoringModel
from tests.unit.learner.test_artifact import make_checkpoint


def _rewritten(root: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A published safetensors artifact, hot rows including the last field's first row (so the probe's rows are all
    at or below the last hot one), its scorer's tensors changed by ``change`` and the manifest's digest of it
    rewritten to match."""
    ckpt = make_checkpoint(seed=0)
    last_first = check_checkpoint(ckpt).blocks[-1][0]
    v = publish(root, build_artifact(ckpt, root, np.array([0, 1, last_first]), format="safetensors"), keep=5)
    name = SCORER_FILES["safetensors"]
    state = safetensors.torch.load((v / name).read_bytes())
    change(state)
    data = safetensors.torch.save({k: t.contiguous() for k, t in state.items()})
    (v / name).write_bytes(data)
    manifest = json.loads((v / MANIFEST).read_text())
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (v / MANIFEST).write_text(json.dumps(manifest))
    return v


def _no_sentinel(state: dict[str, torch.Tensor]) -> None:
    state["hot_ids"], state["hot_vectors"] = state["hot_ids"][:-1], state["hot_vectors"][:-1]


def _unsorted(state: dict[str, torch.Tensor]) -> None:
    ids = state["hot_ids"].clone()
    ids[0], ids[1] = state["hot_ids"][1], state["hot_ids"][0]
    state["hot_ids"] = ids


def _a_vector_short(state: dict[str, torch.Tensor]) -> None:
    state["hot_vectors"] = state["hot_vectors"][:-1]


@pytest.mark.parametrize("change", [_no_sentinel, _unsorted, _a_vector_short])
def test_an_artifact_whose_hot_buffers_are_not_searchable_is_refused_at_load_not_a_500_per_request(
        tmp_path: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    v = _rewritten(tmp_path / "serving", change)
    with pytest.raises(ArtifactError, match="hot_"):
        ScoringModel.load(v)


def test_an_artifact_as_build_artifact_writes_it_passes_the_hot_buffer_check(tmp_path: Path) -> None:
    v = _rewritten(tmp_path / "serving", lambda state: None)
    assert ScoringModel.load(v).hot_rows == 3
