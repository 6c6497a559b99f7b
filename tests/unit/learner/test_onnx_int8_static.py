"""The ``onnx_int8_static`` artifact format (learner/onnx_scorer.py ``quantize_int8_static``): the pooling graph
statically quantized (QGemm with fixed activation scales), calibrated at build time on samples scored as serving
scores them, validated like ``onnx_int8`` (cache_refresh/validate.py: its fp32 path by the probe, its AUC cost
against that path by ``max_int8_auc_drop``; the holdout's older messages calibrate it, the newer ones measure it).
"""

from __future__ import annotations

import logging
import re
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pyarrow as pa
import pytest
import torch

from cache_refresh import validate
from cache_refresh.publish import publish
from learner import onnx_scorer
from learner.artifact import build_artifact
from learner.artifact_versions import ArtifactError, read_current
from learner.features import default_config
from learner.model import DeepFM
from serving.model import ScoringModel
from stream.errors import ConfigError
from stream.samples import SampleBatch
from tests.unit.learner.test_artifact import CFG, make_checkpoint, probe, reference

TOL = 1e-6


def calibration_samples(n: int = 400, seed: int = 0, ts: int = 1_750_000_000_000) -> SampleBatch:
    """Samples of test_artifact's CFG and of the small config below (the same field names)."""
    rng = np.random.default_rng(seed)
    return SampleBatch.from_columns(
        impression_id=[uuid.uuid4().hex for _ in range(n)], ts=np.full(n, ts),
        label=(rng.random(n) < 0.3).astype(np.int8), label_delay_ms=np.zeros(n, np.int64),
        user_id=rng.integers(0, 1 << 40, n), item_id=rng.integers(0, 1 << 40, n),
        history=[rng.integers(0, 1 << 40, rng.integers(0, 4)).tolist() for _ in range(n)],
        context={"device": rng.integers(0, 3, n), "genres": [rng.integers(0, 50, rng.integers(0, 3)).tolist()
                                                            for _ in range(n)]},
        dense={"age": rng.random(n).astype(np.float32)})


@pytest.fixture(scope="module")
def ckpt() -> dict:
    return make_checkpoint(seed=3)


@pytest.fixture(scope="module")
def static_model(ckpt: dict, tmp_path_factory: pytest.TempPathFactory) -> ScoringModel:
    root = tmp_path_factory.mktemp("int8_static")
    return ScoringModel.load(build_artifact(ckpt, root, np.arange(0, CFG.num_rows, 4), format="onnx_int8_static",
                                            calibration=[calibration_samples(300, seed=1)]))


def test_static_int8_saves_a_qgemm_graph_and_scores_within_the_int8_probe_bound_of_fp32(
        static_model: ScoringModel, ckpt: dict, tmp_path: Path) -> None:
    assert static_model.format == "onnx_int8_static"
    assert set(static_model.manifest["files"]) == {"scorer_int8_static.onnx", "scorer.safetensors", "cold_rows.npy"}
    graph = onnx.load(str(static_model.version_dir / "scorer_int8_static.onnx"))
    ops = {n.op_type for n in graph.graph.node}
    assert "QGemm" in ops and "DynamicQuantizeLinear" not in ops and "MatMulInteger" not in ops  # fixed scales
    values, offsets, dense = probe(CFG, b=100, seed=40)
    want = reference(ckpt, values, offsets, dense)
    assert torch.allclose(static_model.score(values, offsets, dense, fp32=True), want, atol=TOL, rtol=0)
    got = static_model.score(values, offsets, dense)
    assert got.shape == (100,) and float((got - want).abs().max()) < validate.INT8_PROBE_BOUND
    dynamic = ScoringModel.load(build_artifact(ckpt, tmp_path, np.arange(0, CFG.num_rows, 4), format="onnx_int8"))
    assert not torch.equal(got, dynamic.score(values, offsets, dense))  # another graph: not onnx_int8 renamed


def test_the_calibration_feeds_are_what_serving_feeds_the_graph_for_the_same_samples(
        static_model: ScoringModel, ckpt: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibrated on real request-shaped inputs: the build's feeds for a batch of samples (cold rows from the table,
    the hot rows' positions, each sample a candidate after an empty user row) equal serving's for that batch."""
    from learner import artifact

    batch = calibration_samples(200, seed=9)
    scorer = static_model._live.scorer
    table = ckpt["model"]["sparse.bag.weight"].float()
    [built] = artifact._calibration_feeds(ckpt, CFG, scorer, table, [batch])
    served: list[dict[str, Any]] = []
    real = onnx_scorer.request_feeds
    monkeypatch.setattr(onnx_scorer, "request_feeds", lambda *a: served.append(real(*a)) or served[-1])
    validate.quality(static_model, [batch])
    assert len(served) == 1 and set(built) == set(served[0]) == set(onnx_scorer.REQUEST_INPUTS)
    for name in onnx_scorer.REQUEST_INPUTS:
        assert np.array_equal(built[name], served[0][name]), name


def test_static_int8_without_calibration_samples_is_refused_naming_the_fix(ckpt: dict, tmp_path: Path) -> None:
    for none in (None, [], [calibration_samples(0)]):
        with pytest.raises(ArtifactError, match=r"onnx_int8_static .* calibrat.*holdout_messages > 0.*onnx_int8"):
            build_artifact(ckpt, tmp_path, np.arange(10), format="onnx_int8_static", calibration=none)
    assert not list(tmp_path.rglob("*.onnx"))  # nothing staged is left behind


def test_the_refresh_refuses_static_int8_with_no_holdout_at_load() -> None:
    from cache_refresh.settings import RefreshSettings

    with pytest.raises(ConfigError, match=r"onnx_int8_static .* holdout_messages = 0 .* set holdout_messages"):
        RefreshSettings(format="onnx_int8_static", holdout_messages=0)
    assert RefreshSettings(format="onnx_int8_static").format == "onnx_int8_static"


def test_the_holdout_is_split_by_time_older_messages_calibrate_newer_ones_measure() -> None:
    t = 1_750_000_000_000
    newest, older, oldest, middle = (calibration_samples(150, seed=s, ts=t + dt)
                                     for s, dt in ((1, 30), (2, 10), (3, 0), (4, 20)))
    calib, measured = validate.calibration_split([newest, older, oldest, middle], "onnx_int8_static", 4)
    assert calib == [oldest] and measured == [older, middle, newest]
    eight = [calibration_samples(60, seed=s, ts=t + s) for s in range(8)]
    calib, measured = validate.calibration_split(eight[::-1], "onnx_int8_static", 8)
    assert calib == eight[:2] and measured == eight[2:]  # the oldest quarter; 120 samples
    two_small = [calibration_samples(50), calibration_samples(50)]
    for few, messages in (([calibration_samples(400)], 1), (two_small, 2), ([], 4), ([], 0)):
        with pytest.raises(validate.ValidationFailed, match=r"onnx_int8_static is calibrated on the holdout's "
                                                            r"older samples.*holdout_messages.*onnx_int8"):
            validate.calibration_split(few, "onnx_int8_static", messages)


def test_static_int8_is_gated_by_its_auc_cost_and_refused_beyond_the_bound(tmp_path: Path) -> None:
    cfg = default_config({"device": "single"}, buckets=500, ctx_buckets=5, embedding_dim=8, dense=("age",))
    model = DeepFM(cfg, mlp=(32, 16), seed=2, autocast_dtype=None)
    with torch.no_grad():
        model.sparse.bag.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    ck = {"meta": {"feature_config": cfg.to_dict(), "samples_trained": 10, "model": {"mlp": "32,16", "dropout": 0.0}},
          "model": model.state_dict(), "path": "/ckpt/y.pt"}
    hot = np.arange(0, cfg.num_rows, 3)
    staged = build_artifact(ck, tmp_path, hot, format="onnx_int8_static",
                            calibration=[calibration_samples(300, seed=5)])
    new = ScoringModel.load(staged)
    result = validate.probe(new, ck, 512, 1e-5, hot_rows=hot)
    assert result["max_abs_diff"] <= TOL and 0 < result["int8_max_abs_diff"] < validate.INT8_PROBE_BOUND
    batch = calibration_samples(400, seed=6)
    on = validate.probe(new, ck, 512, 1e-5, hot_rows=hot, on=[batch])  # its INT8 bounded on samples: recorded
    assert 0 < on["int8_max_abs_diff_on_samples"] < validate.INT8_PROBE_BOUND
    out = validate.holdout(new, None, [batch], max_auc_drop=0.01, max_int8_auc_drop=0.01)
    assert abs(out["int8"]["auc_cost"]) < 0.01 and out["int8"]["fp32"]["samples"] == 400
    with pytest.raises(validate.ValidationFailed, match="onnx_int8_static AUC.*max_int8_auc_drop"):
        validate.holdout(new, None, [batch], max_auc_drop=0.01, max_int8_auc_drop=-1.0)
    assert publish(tmp_path, staged, keep=3).name == new.version
    assert ScoringModel.load(read_current(tmp_path)).format == "onnx_int8_static"


def test_a_dense_delta_on_static_int8_requantizes_dynamically_and_says_so(
        ckpt: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = ScoringModel.load(build_artifact(ckpt, tmp_path, np.arange(10), format="onnx_int8_static",
                                             calibration=[calibration_samples(300)]))
    values, offsets, dense = probe(CFG, b=64, seed=30)
    other = make_checkpoint(seed=8)
    with caplog.at_level(logging.WARNING, logger="streamrec.onnx"):
        model.apply_delta(torch.zeros(0, dtype=torch.int64), torch.zeros(0, CFG.embedding_dim + 1),
                          {k: v for k, v in other["model"].items() if not k.startswith("sparse.")}, seq=1)
    assert "re-exported dynamically quantized" in caplog.text
    patched = {**other, "model": {**other["model"], "sparse.bag.weight": ckpt["model"]["sparse.bag.weight"]}}
    want = reference(patched, values, offsets, dense)
    assert torch.allclose(model.score(values, offsets, dense, fp32=True), want, atol=TOL, rtol=0)
    assert float((model.score(values, offsets, dense) - want).abs().max()) < validate.INT8_PROBE_BOUND


def test_static_int8_calibrated_on_an_extreme_dense_value_is_refused_naming_the_calibration_not_the_graph(
        tmp_path: Path) -> None:
    """One extreme (valid: finite, below MAX_ABS_DENSE) dense value among the calibration samples widens the MLP
    input's activation range until ordinary inputs round to zero: refused by the probe on the newer samples, and
    the error names the calibration and the fix, not "not the checkpoint's model" (its fp32 path is exact)."""
    cfg = default_config({"device": "single"}, buckets=500, ctx_buckets=5, embedding_dim=8, dense=("age",))
    model = DeepFM(cfg, mlp=(32, 16), seed=2, autocast_dtype=None)
    with torch.no_grad():
        model.sparse.bag.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
        for layer in model.dense_arch.modules():
            if isinstance(layer, torch.nn.Linear):
                layer.weight.mul_(3)  # an MLP that decides the scores
    ck = {"meta": {"feature_config": cfg.to_dict(), "samples_trained": 10, "model": {"mlp": "32,16", "dropout": 0.0}},
          "model": model.state_dict(), "path": "/ckpt/y.pt"}
    hot = np.arange(0, cfg.num_rows, 3)
    calib = calibration_samples(300, seed=5)
    age = calib.column("dense.age").copy()
    age[0] = 1e6
    calib = SampleBatch(calib.batch.set_column(calib.batch.schema.get_field_index("dense.age"), "dense.age",
                                               pa.array(age)))
    new = ScoringModel.load(build_artifact(ck, tmp_path, hot, format="onnx_int8_static", calibration=[calib]))
    with pytest.raises(validate.ValidationFailed) as err:
        validate.probe(new, ck, 256, 1e-5, hot_rows=hot, on=[calibration_samples(300, seed=6)])
    message = str(err.value)
    assert "not the checkpoint's model" not in message
    assert re.search(r"INT8 scores differ from its own fp32 path .* 300 newer holdout samples: the activation "
                     r"ranges it was calibrated on .* extreme dense feature value .* --format onnx_int8", message)
