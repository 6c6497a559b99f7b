"""The serving artifact (learner/artifact.py): scores equal the learner's, deltas, checksums, publishing.

Tolerance: the artifact computes exactly the learner's fp32 eager DeepFM (same pooling, same order of
operations), so probabilities agree to 1e-6 absolute (observed: bit-identical on CPU).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from cache_refresh import publish as publishing
from cache_refresh.publish import publish, rollback
from learner import artifact as A
from learner import artifact_manifest as M
from learner import artifact_versions as V
from learner.artifact import build_artifact
from learner.artifact_versions import ArtifactError, read_current
from learner.features import FeatureConfig, FieldSpec
from learner.model import DeepFM
from learner.scorer import (
    FORMATS,
    REDUCED_PRECISION_FORMATS,
)
from serving.model import ScoringModel

TOL = 1e-6
# INT8 and bf16: tests/unit/learner/test_onnx_scorer.py, test_bf16_scorer.py
EXACT_FORMATS = [f for f in FORMATS if f not in REDUCED_PRECISION_FORMATS]

CFG = FeatureConfig(
    fields=(FieldSpec("user_id", "single", 300), FieldSpec("item_id", "single", 200),
            FieldSpec("history", "sequence", 200, shares="item_id"), FieldSpec("ctx.device", "single", 7),
            FieldSpec("ctx.genres", "multi", 20)),
    dense=("age", "hour"), embedding_dim=8)


def make_checkpoint(seed: int = 0, dropout: float = 0.0) -> dict:
    model = DeepFM(CFG, mlp=(32, 16), dropout=dropout, seed=seed, autocast_dtype=None)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights large enough that every term moves the score
        model.sparse.bag.weight.copy_(torch.randn(model.sparse.bag.weight.shape, generator=g) * 0.3)
        model.bias.fill_(-0.5)
        model.calibration.copy_(torch.tensor([0.7, 0.2]))  # served logits a * z + b: every format must apply it
    meta = {"feature_config": CFG.to_dict(), "samples_trained": 1234, "offsets": {"0": 7, "1": 9},
            "model": {"mlp": "32,16", "dropout": dropout, "amp": True, "seed": seed}, "topic": "samples-x"}
    return {"meta": meta, "model": model.state_dict(), "path": f"/ckpt/ckpt-{seed}.pt"}


def probe(cfg: FeatureConfig, b: int = 64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random field-major bags: singles have 1 value, lists 0..5 (empty bags included)."""
    rng = np.random.default_rng(seed)
    values, lengths = [], []
    for spec, (first, rows) in zip(cfg.fields, cfg.blocks, strict=True):
        n = np.ones(b, np.int64) if spec.kind == "single" else rng.integers(0, 6, b)
        lengths.append(n)
        values.append(first + rng.integers(0, rows, int(n.sum())))
    lengths_all = np.concatenate(lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths_all)]).astype(np.int64)
    dense = rng.normal(size=(b, len(cfg.dense))).astype(np.float32)
    return torch.from_numpy(np.concatenate(values)), torch.from_numpy(offsets), torch.from_numpy(dense)


def reference(ckpt: dict, values, offsets, dense) -> torch.Tensor:
    with torch.no_grad():
        return torch.sigmoid(A.eager_model(ckpt)(values, offsets, dense))


@pytest.fixture(scope="module")
def ckpt() -> dict:
    return make_checkpoint()


HOT_SETS = {
    "empty": lambda: np.zeros(0, np.int64),
    "partial": lambda: np.random.default_rng(3).integers(0, CFG.num_rows, 150),
    "full": lambda: np.arange(CFG.num_rows),
}


@pytest.mark.parametrize("fmt", EXACT_FORMATS)
@pytest.mark.parametrize("hot", sorted(HOT_SETS))
def test_scores_equal_the_learners_eager_scores(tmp_path: Path, ckpt: dict, fmt: str, hot: str) -> None:
    staged = build_artifact(ckpt, tmp_path, HOT_SETS[hot](), format=fmt)
    model = ScoringModel.load(staged)
    values, offsets, dense = probe(CFG)
    got = model.score(values, offsets, dense)
    want = reference(ckpt, values, offsets, dense)
    assert got.shape == want.shape == (64,)
    assert torch.allclose(got, want, atol=TOL, rtol=0), (got - want).abs().max()
    assert model.format == fmt and model.feature_config == CFG
    n = len(values)
    assert model.hot_lookups + model.cold_lookups == n
    assert (model.cold_lookups == n) if hot == "empty" else True
    assert (model.hot_lookups == n) if hot == "full" else True


def test_the_served_logit_is_calibrated_and_a_checkpoint_from_before_calibration_serves_raw(tmp_path: Path,
                                                                                            ckpt: dict) -> None:
    values, offsets, dense = probe(CFG, seed=4)
    model = A.eager_model(ckpt)
    with torch.no_grad():
        served = model(values, offsets, dense)  # eval mode: calibrated
        model.train()
        raw = model(values, offsets, dense)  # train mode: what the loss sees
    assert torch.allclose(served, 0.7 * raw + 0.2, atol=1e-5)
    old = {**ckpt, "model": {k: v for k, v in ckpt["model"].items() if k != "calibration"}}
    staged = build_artifact(old, tmp_path, np.arange(50), format="safetensors")
    got = ScoringModel.load(staged).score(values, offsets, dense)
    assert torch.allclose(got, torch.sigmoid(raw), atol=TOL)  # the identity: exactly what it served before


def test_dropout_model_scores_in_eval_mode(tmp_path: Path) -> None:
    ckpt = make_checkpoint(seed=2, dropout=0.3)
    model = ScoringModel.load(build_artifact(ckpt, tmp_path, np.arange(50), format="torchscript"))
    values, offsets, dense = probe(CFG, seed=5)
    assert torch.allclose(model.score(values, offsets, dense), reference(ckpt, values, offsets, dense), atol=TOL)


def test_manifest_describes_the_artifact(tmp_path: Path, ckpt: dict) -> None:
    staged = build_artifact(ckpt, tmp_path, np.array([5, 5, 9, 400]), hot_stats={"items": 2, "users": 1})
    m = json.loads((staged / M.MANIFEST).read_text())
    assert m["source"]["checkpoint"] == ckpt["path"] and m["source"]["samples_trained"] == 1234
    assert m["source"]["offsets"] == {"0": 7, "1": 9}
    assert FeatureConfig.from_dict(m["feature_config"]) == CFG
    assert m["hot_set"]["rows"] == 3 and m["hot_set"]["items"] == 2
    assert set(m["files"]) == {"scorer.pt", "cold_rows.npy"} and m["format"] == "torchscript"
    cold = np.load(staged / M.COLD_FILE, mmap_mode="r")
    assert cold.shape == (CFG.num_rows, CFG.embedding_dim + 1) and cold.dtype == np.float32


def test_map_rows_matches_the_learners_mapping(tmp_path: Path, ckpt: dict) -> None:
    model = ScoringModel.load(build_artifact(ckpt, tmp_path, np.zeros(0), format="eager"))
    hashed = np.array([0, 1, 299, 300, 2**62 + 17], np.int64)
    for f, (first, rows) in enumerate(CFG.blocks):
        assert np.array_equal(model.map_rows(f, hashed), first + hashed % rows)


def _samples_using(rows: np.ndarray, values: torch.Tensor, offsets: torch.Tensor, b: int) -> np.ndarray:
    bag = np.searchsorted(offsets.numpy(), np.arange(len(values)), side="right") - 1  # bag of every value
    hit = np.isin(values.numpy(), rows)
    return np.isin(np.arange(b), bag[hit] % b)


@pytest.mark.parametrize("fmt", EXACT_FORMATS)
def test_apply_delta_changes_exactly_the_scores_that_use_those_rows(tmp_path: Path, ckpt: dict, fmt: str) -> None:
    values, offsets, dense = probe(CFG, b=64, seed=7)
    used = np.unique(values.numpy())
    hot = used[::2]  # half the used rows hot: the delta overrides hot and cold rows alike
    model = ScoringModel.load(build_artifact(ckpt, tmp_path, hot, format=fmt))
    before = model.score(values, offsets, dense)
    rows = torch.from_numpy(used[[0, 1, 5, 6]])
    vectors = torch.randn(4, CFG.embedding_dim + 1, generator=torch.Generator().manual_seed(9))
    model.apply_delta(rows, vectors, None, seq=11)
    after = model.score(values, offsets, dense)
    assert model.delta_seq == 11
    expected = _samples_using(rows.numpy(), values, offsets, 64)
    assert 0 < expected.sum() < 64
    assert np.array_equal((after != before).numpy(), expected)
    # ... and to the learner's scores with those rows replaced
    patched = {**ckpt, "model": {**ckpt["model"]}}
    table = patched["model"]["sparse.bag.weight"].clone()
    table[rows] = vectors
    patched["model"]["sparse.bag.weight"] = table
    assert torch.allclose(after, reference(patched, values, offsets, dense), atol=TOL)
    # a later delta of the same row wins; dense weights replaced as a whole
    other = make_checkpoint(seed=4)
    model.apply_delta(rows[:1], vectors[:1] * 2, {k: v for k, v in other["model"].items()}, seq=12)
    table[rows[:1]] = vectors[:1] * 2
    patched2 = {**patched, "model": {**other["model"], "sparse.bag.weight": table}}
    assert torch.allclose(model.score(values, offsets, dense), reference(patched2, values, offsets, dense), atol=TOL)
    assert model.delta_seq == 12


def test_apply_delta_rejects_bad_shapes(tmp_path: Path, ckpt: dict) -> None:
    model = ScoringModel.load(build_artifact(ckpt, tmp_path, np.zeros(0), format="eager"))
    with pytest.raises(ValueError, match="shape"):
        model.apply_delta(torch.tensor([1]), torch.zeros(1, 3), None, seq=1)
    with pytest.raises(ValueError, match="rows must lie"):
        model.apply_delta(torch.tensor([CFG.num_rows]), torch.zeros(1, CFG.embedding_dim + 1), None, seq=1)
    with pytest.raises(ValueError, match="missing"):
        model.apply_delta(torch.tensor([1]), torch.zeros(1, CFG.embedding_dim + 1), {"bias": torch.zeros(1)}, seq=1)
    assert model.delta_seq == 0


def test_a_scorer_from_before_calibration_takes_a_calibrated_learners_dense_weights(tmp_path: Path,
                                                                                    ckpt: dict) -> None:
    """A rolling upgrade: the learner now sends ``calibration`` with its dense weights; a live artifact built
    before calibration existed has no such buffer, takes the rest and keeps serving raw logits."""
    model = ScoringModel.load(build_artifact(ckpt, tmp_path, np.zeros(0), format="eager"))
    del model._live.scorer._buffers["calibration"]  # what an artifact from before calibration holds
    dense = {k: v.clone() for k, v in ckpt["model"].items() if not k.startswith("sparse.")}
    dense["bias"] = torch.full((1,), 1.5)
    model.apply_delta(torch.zeros(0, dtype=torch.int64), torch.zeros(0, CFG.embedding_dim + 1), dense, seq=1)
    assert model.delta_seq == 1
    state = model._live.scorer.state_dict()
    assert float(state["bias"]) == 1.5 and "calibration" not in state


def test_apply_delta_while_scoring_in_another_thread(tmp_path: Path, ckpt: dict) -> None:
    model = ScoringModel.load(build_artifact(ckpt, tmp_path, np.arange(0, CFG.num_rows, 3)))
    values, offsets, dense = probe(CFG, b=32, seed=8)
    errors: list[BaseException] = []
    stop = threading.Event()

    def score_loop() -> None:
        try:
            while not stop.is_set():
                p = model.score(values, offsets, dense)
                assert p.shape == (32,) and torch.isfinite(p).all()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=score_loop)
    t.start()
    try:
        dense_state = {k: v for k, v in ckpt["model"].items() if not k.startswith("sparse.")}
        for seq in range(1, 30):
            rows = torch.randint(0, CFG.num_rows, (20,))
            model.apply_delta(rows, torch.randn(20, CFG.embedding_dim + 1), dense_state if seq % 5 == 0 else None, seq)
    finally:
        stop.set()
        t.join(10)
    assert not errors and model.delta_seq == 29


# -- corruption -------------------------------------------------------------------------------------
@pytest.fixture
def published(tmp_path: Path, ckpt: dict) -> Path:
    return publish(tmp_path, build_artifact(ckpt, tmp_path, np.arange(10)), keep=3)


def test_flipped_byte_is_a_checksum_error(published: Path) -> None:
    path = published / M.COLD_FILE
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256.*does not match"):
        ScoringModel.load(published)


def test_truncated_cold_rows_is_rejected(published: Path) -> None:
    path = published / M.COLD_FILE
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ArtifactError, match="truncated"):
        ScoringModel.load(published)
    # without the manifest check, numpy itself refuses the short file: still an ArtifactError
    with pytest.raises(ArtifactError, match="cannot load"):
        ScoringModel.load(published, verify_files=False)


@pytest.mark.parametrize("name", ["scorer.pt", "cold_rows.npy", "manifest.json"])
def test_missing_file_is_rejected(published: Path, name: str) -> None:
    (published / name).unlink()
    with pytest.raises(ArtifactError, match="missing"):
        ScoringModel.load(published)


# -- publish / rollback ---------------------------------------------------------------------------
def test_publish_rollback_and_keep_n(tmp_path: Path, ckpt: dict) -> None:
    assert read_current(tmp_path) is None
    names = []
    for i in range(4):
        v = publish(tmp_path, build_artifact(ckpt, tmp_path, np.zeros(0), version=f"2026010{i}T000000000Z"), keep=3)
        names.append(v.name)
        assert read_current(tmp_path) == v
    assert V.list_versions(tmp_path) == names[1:]  # keep 3
    assert not any((tmp_path / V.STAGING).iterdir())
    assert rollback(tmp_path) == names[2] and read_current(tmp_path).name == names[2]
    assert rollback(tmp_path) == names[1]
    with pytest.raises(ArtifactError, match="no version older"):
        rollback(tmp_path)
    # a new publish after rollbacks: the current version survives pruning even though it is old
    v = publish(tmp_path, build_artifact(ckpt, tmp_path, np.zeros(0), version="20260105T000000000Z"), keep=1)
    assert read_current(tmp_path) == v and V.list_versions(tmp_path) == [v.name]


def test_crash_mid_publish_leaves_the_old_version_current(tmp_path: Path, ckpt: dict,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    old = publish(tmp_path, build_artifact(ckpt, tmp_path, np.zeros(0), version="20260101T000000000Z"), keep=3)
    staged = build_artifact(make_checkpoint(seed=5), tmp_path, np.zeros(0), version="20260102T000000000Z")

    def crash(*_a, **_k):
        raise OSError("simulated crash before CURRENT is replaced")

    monkeypatch.setattr(publishing, "_set_current", crash)
    with pytest.raises(V.ArtifactError, match="simulated.*nothing was published"):  # the OSError, explained
        publish(tmp_path, staged, keep=3)
    assert read_current(tmp_path) == old
    ScoringModel.load(read_current(tmp_path))  # still complete and valid

    # a crash while writing the CURRENT temp file (before os.replace) also leaves the old pointer
    monkeypatch.undo()
    staged = build_artifact(make_checkpoint(seed=6), tmp_path, np.zeros(0), version="20260103T000000000Z")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises((OSError, V.ArtifactError)):
        publish(tmp_path, staged, keep=3)
    monkeypatch.undo()
    assert read_current(tmp_path) == old and (tmp_path / V.CURRENT).read_text().strip() == old.name


def test_failed_build_leaves_nothing_behind(tmp_path: Path, ckpt: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a, **_k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(A, "sha256_file", boom)
    with pytest.raises(RuntimeError):
        build_artifact(ckpt, tmp_path, np.zeros(0))
    assert not any((tmp_path / V.STAGING).iterdir()) and read_current(tmp_path) is None


def test_unknown_format_and_bad_hot_rows(tmp_path: Path, ckpt: dict) -> None:
    with pytest.raises(ArtifactError, match="unknown artifact format"):
        build_artifact(ckpt, tmp_path, np.zeros(0), format="tflite")
    with pytest.raises(ArtifactError, match="hot rows must lie"):
        build_artifact(ckpt, tmp_path, np.array([CFG.num_rows]))


@pytest.mark.parametrize("damage", ["missing", "extra", "reshaped"])
def test_a_checkpoint_whose_dense_weights_do_not_match_its_model_settings_is_refused_by_name(
        ckpt: dict, damage: str) -> None:
    """A dense weight missing, unexpected or of another shape is refused before anything is built, naming the weight
    (not a page of torch's load_state_dict text at build time)."""
    state = dict(ckpt["model"])
    if damage == "missing":
        del state["bias"]
    elif damage == "extra":
        state["dense_arch.extra.weight"] = torch.zeros(2)
    else:
        state["bias"] = torch.zeros(2)
    bad = {**ckpt, "model": state}
    want = {"missing": "missing bias", "extra": "unexpected dense_arch.extra.weight",
            "reshaped": r"bias is \(2,\), expected \(1,\)"}[damage]
    with pytest.raises(ArtifactError, match=f"dense weights do not match.*{want}"):
        M.check_checkpoint(bad)
    M.check_checkpoint(ckpt)  # the intact one passes


def test_a_calibrated_scorer_takes_the_dense_weights_of_a_learner_from_before_calibration(tmp_path: Path,
                                                                                          ckpt: dict) -> None:
    """A rolling upgrade, serving first: the learner from before calibration sends no ``calibration`` (it serves raw
    logits); the scorer takes its dense weights and serves them raw (the identity), not refusing every delta."""
    model = ScoringModel.load(build_artifact(ckpt, tmp_path, np.zeros(0), format="eager"))
    with torch.no_grad():
        model._live.scorer.get_buffer("calibration").copy_(torch.tensor([0.5, 1.0]))  # what a newer learner had set
    dense = {k: v.clone() for k, v in ckpt["model"].items() if not k.startswith(("sparse.", "calibration"))}
    dense["bias"] = torch.full((1,), 1.5)
    model.apply_delta(torch.zeros(0, dtype=torch.int64), torch.zeros(0, CFG.embedding_dim + 1), dense, seq=1)
    assert model.delta_seq == 1
    state = model._live.scorer.state_dict()
    assert float(state["bias"]) == 1.5 and state["calibration"].tolist() == [1.0, 0.0]
