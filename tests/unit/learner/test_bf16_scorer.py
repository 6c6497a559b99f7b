"""The ``safetensors_bf16`` artifact format (learner/scorer.py ``Bf16Scorer``): the MLP run in bf16.

Not exact, so judged like INT8: its fp32 path equals the learner's eager fp32 scores (the refresh's probe, within
1e-6 here), its bf16 scores stay near them (observed ~1e-3 on this small model; bounded by 0.02), and its holdout
AUC cost is checked against ``max_int8_auc_drop`` (bench/serving.py ``--precision`` measures the cost on a trained
model). Also: the file is the ``safetensors`` format's (fp32 tensors, nothing unpickled), and the scorer refactor
(``Scorer.head``/``deep``) leaves the exact formats as they were (tests/unit/learner/test_artifact.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cache_refresh import validate
from cache_refresh.publish import publish
from learner import artifact_manifest as M
from learner.artifact import build_artifact
from learner.artifact_versions import read_current
from learner.features import default_config
from learner.model import DeepFM
from learner.scorer import PICKLE_FREE_FORMATS, REDUCED_PRECISION_FORMATS, Bf16Scorer
from serving.model import ScoringModel
from tests.unit.learner.test_artifact import CFG, make_checkpoint, probe, reference
from tests.unit.learner.test_onnx_scorer import _holdout_batch

TOL = 1e-6
BF16_BOUND = 0.02


@pytest.fixture(scope="module")
def ckpt() -> dict:
    return make_checkpoint(seed=3)


@pytest.fixture(scope="module")
def bf16_model(ckpt: dict, tmp_path_factory: pytest.TempPathFactory) -> ScoringModel:
    root = tmp_path_factory.mktemp("bf16")
    return ScoringModel.load(build_artifact(ckpt, root, np.arange(0, CFG.num_rows, 4), format="safetensors_bf16"))


@pytest.mark.parametrize("b", [1, 7, 100])
def test_bf16_scores_are_near_fp32_and_its_fp32_path_is_exact(bf16_model: ScoringModel, ckpt: dict, b: int) -> None:
    values, offsets, dense = probe(CFG, b=b, seed=40 + b)
    want = reference(ckpt, values, offsets, dense)
    assert torch.allclose(bf16_model.score(values, offsets, dense, fp32=True), want, atol=TOL, rtol=0)
    got = bf16_model.score(values, offsets, dense)
    assert got.shape == (b,) and got.dtype == torch.float32
    assert float((got - want).abs().max()) < BF16_BOUND


def test_the_mlp_runs_in_bf16_and_the_scores_differ_from_fp32(bf16_model: ScoringModel, ckpt: dict) -> None:
    scorer = bf16_model._live.scorer
    assert isinstance(scorer, Bf16Scorer)
    held = scorer._bf16.value
    assert held is not None and all(p.dtype == torch.bfloat16 for p in held.parameters())
    assert all(v.dtype != torch.bfloat16 for v in scorer.state_dict().values())  # what is stored stays fp32
    values, offsets, dense = probe(CFG, b=200, seed=9)
    assert float((bf16_model.score(values, offsets, dense) - reference(ckpt, values, offsets, dense)).abs().max()) > 0


def test_the_artifact_is_the_safetensors_file_and_unpickles_nothing(tmp_path: Path, ckpt: dict) -> None:
    assert "safetensors_bf16" in PICKLE_FREE_FORMATS and "safetensors_bf16" in REDUCED_PRECISION_FORMATS
    staged = build_artifact(ckpt, tmp_path, np.arange(10), format="safetensors_bf16")
    m = json.loads((staged / M.MANIFEST).read_text())
    assert m["format"] == "safetensors_bf16" and set(m["files"]) == {"scorer.safetensors", "cold_rows.npy"}


def test_a_dense_delta_remakes_the_bf16_copy(tmp_path: Path, ckpt: dict) -> None:
    model = ScoringModel.load(build_artifact(ckpt, tmp_path, np.arange(10), format="safetensors_bf16"))
    values, offsets, dense = probe(CFG, b=64, seed=30)
    other = make_checkpoint(seed=8)
    model.apply_delta(torch.zeros(0, dtype=torch.int64), torch.zeros(0, CFG.embedding_dim + 1),
                      {k: v for k, v in other["model"].items() if not k.startswith("sparse.")}, seq=1)
    patched = {**other, "model": {**other["model"], "sparse.bag.weight": ckpt["model"]["sparse.bag.weight"]}}
    want = reference(patched, values, offsets, dense)
    assert torch.allclose(model.score(values, offsets, dense, fp32=True), want, atol=TOL, rtol=0)
    assert float((model.score(values, offsets, dense) - want).abs().max()) < BF16_BOUND  # the new weights, in bf16


def test_bf16_is_validated_by_its_auc_cost_and_published(tmp_path: Path) -> None:
    cfg = default_config({"device": "single"}, buckets=500, ctx_buckets=5, embedding_dim=8, dense=("age",))
    model = DeepFM(cfg, mlp=(32, 16), seed=2, autocast_dtype=None)
    with torch.no_grad():
        model.sparse.bag.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    ck = {"meta": {"feature_config": cfg.to_dict(), "samples_trained": 10, "model": {"mlp": "32,16", "dropout": 0.0}},
          "model": model.state_dict(), "path": "/ckpt/y.pt"}
    hot = np.arange(0, cfg.num_rows, 3)
    staged = build_artifact(ck, tmp_path, hot, format="safetensors_bf16")
    new = ScoringModel.load(staged)
    result = validate.probe(new, ck, 512, 1e-5, hot_rows=hot)  # the fp32 path within the probe tolerance
    assert result["max_abs_diff"] <= TOL and 0 < result["int8_max_abs_diff"] < BF16_BOUND
    batch = _holdout_batch()
    out = validate.holdout(new, None, [batch], max_auc_drop=0.01, max_int8_auc_drop=0.01)
    assert abs(out["int8"]["auc_cost"]) < 0.01
    with pytest.raises(validate.ValidationFailed, match="max_int8_auc_drop"):
        validate.holdout(new, None, [batch], max_auc_drop=0.01, max_int8_auc_drop=-1.0)
    assert publish(tmp_path, staged, keep=3).name == new.version
    assert ScoringModel.load(read_current(tmp_path)).format == "safetensors_bf16"
