"""Signed artifacts and the paths of a publish root (the "secured deployment" issue), through the real
writers (build_artifact, publish, DeltaWriter, the refresh job) and readers (ScoringModel.load, ModelUpdater).

With a signing key, the manifest carries an HMAC of its canonical JSON and every delta an HMAC of its bytes;
serving with the key refuses an unsigned or mis-signed artifact before any file but the manifest is opened,
and such deltas, counted as rejected like every bad artifact or delta. Names read from the root must be
version names, and nothing may be read through a symlink that leaves the publish root, a version directory
or the deltas directory.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cache_refresh import job
from cache_refresh.publish import publish, rollback
from cache_refresh.settings import RefreshSettings
from learner import artifact as A
from learner import artifact_manifest as M
from learner import artifact_versions as V
from learner.artifact import build_artifact
from learner.artifact_versions import ArtifactError
from learner.config import ArtifactFormat
from learner.delta_writer import DeltaWriter
from learner.deltas import delta_path
from learner.tensorpack import SigningKey, load_signing_key
from serving import model as serving_model
from serving.metrics import ServingMetrics
from serving.model import ScoringModel
from serving.swap import ModelHolder, ModelUpdater
from stream.config import KafkaSettings, RedisSettings
from stream.secrets import redact
from tests.integration.test_serving import CFG, TinyLearner

KEY = SigningKey(b"signing-key-of-this-deployment-0001")
OTHER = SigningKey(b"signing-key-of-another-deployment-2")


@pytest.fixture(scope="module")
def learner() -> TinyLearner:
    return TinyLearner()


def staged(learner: TinyLearner, root: Path, version: str, key: SigningKey | None = KEY,
           fmt: str = "torchscript") -> Path:
    return build_artifact(learner.checkpoint(), root, np.arange(0, CFG.num_rows, 3), format=fmt, version=version,
                          signing_key=key)


def published(learner: TinyLearner, root: Path, version: str, key: SigningKey | None = KEY,
              fmt: str = "torchscript") -> Path:
    return publish(root, staged(learner, root, version, key, fmt), keep=10, signing_key=key)


def manifest_of(version_dir: Path) -> dict[str, Any]:
    return json.loads((version_dir / M.MANIFEST).read_text())


def rewrite_manifest(version_dir: Path, change: Any) -> None:
    m = manifest_of(version_dir)
    change(m)
    (version_dir / M.MANIFEST).write_text(json.dumps(m, indent=2, sort_keys=True))


def updater(root: Path, deltas: Path | None = None, key: SigningKey | None = KEY) -> tuple[ModelUpdater, ModelHolder]:
    holder = ModelHolder()
    return ModelUpdater(holder, ServingMetrics(holder.model), root, deltas, signing_key=key), holder


def rejected(u: ModelUpdater, kind: str) -> float:
    return u.metrics.registry.get_sample_value("streamrec_serving_rejected_total", {"kind": kind}) or 0.0


def write_all_rows(directory: Path, learner: TinyLearner, key: SigningKey | None) -> Path:
    writer = DeltaWriter(directory, CFG.num_rows, every_s=3600, key=key)
    writer.mark(torch.arange(CFG.num_rows))
    path = writer.write(learner.model, learner.trainer.samples + 1)
    assert path is not None
    return path


# -- manifests -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["torchscript", "safetensors"])
def test_a_signed_manifest_carries_the_hmac_of_its_canonical_json_and_loads_with_the_key(
        tmp_path: Path, learner: TinyLearner, fmt: str) -> None:
    v = published(learner, tmp_path, "v001", fmt=fmt)
    m = manifest_of(v)
    body = {k: x for k, x in m.items() if k != "signature"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    assert m["signature"] == KEY.sign(canonical) == KEY.sign(M.canonical_manifest(m))
    assert ScoringModel.load(v, signing_key=KEY).version == "v001"
    assert ScoringModel.load(v).version == "v001"  # a reader without a key ignores the signature
    assert "signature" not in manifest_of(published(learner, tmp_path, "v002", key=None, fmt=fmt))


def _forbid_other_files(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every attempt to open an artifact file other than the manifest while loading."""
    opened: list[str] = []

    def recording(owner: Any, name: str) -> None:
        real = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            opened.append(f"{name} {args[:1]}")
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    recording(A, "sha256_file")  # verify's digests
    recording(serving_model.np, "load")  # the cold rows
    recording(serving_model, "load_scorer")
    recording(serving_model, "read_id_maps")
    return opened


@pytest.mark.parametrize("case", ["unsigned", "altered", "other_key", "not_hex"])
def test_serving_with_a_key_refuses_a_bad_signature_before_opening_any_other_file(
        tmp_path: Path, learner: TinyLearner, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    if case == "unsigned":
        v = published(learner, tmp_path, "v001", key=None)
    elif case == "other_key":
        v = published(learner, tmp_path, "v001", key=OTHER)
    else:
        v = published(learner, tmp_path, "v001")
        rewrite_manifest(v, {"altered": lambda m: m["hot_set"].update(rows=1),
                             "not_hex": lambda m: m.update(signature="zz" * 32)}[case])
    opened = _forbid_other_files(monkeypatch)
    want = {"unsigned": "unsigned", "altered": "does not match", "other_key": "does not match",
            "not_hex": "not 64 hex"}[case]
    with pytest.raises(ArtifactError, match=want) as info:
        ScoringModel.load(v, signing_key=KEY)
    assert str(v / M.MANIFEST) in str(info.value) and opened == []
    with pytest.raises(ArtifactError, match=want):
        ScoringModel.load(v, signing_key=KEY, verify_files=False)  # a key always verifies
    assert opened == []


def test_a_signed_manifest_whose_files_changed_is_refused_by_their_digests(tmp_path: Path,
                                                                         learner: TinyLearner) -> None:
    v = published(learner, tmp_path, "v001")
    cold = np.load(v / M.COLD_FILE)
    cold[0, 0] += 1.0
    np.save(v / M.COLD_FILE, cold)  # same size, other bytes
    with pytest.raises(ArtifactError, match="sha256"):
        ScoringModel.load(v, signing_key=KEY)


def test_publish_and_rollback_with_a_key_take_only_signed_versions(tmp_path: Path, learner: TinyLearner) -> None:
    with pytest.raises(ArtifactError, match="unsigned"):
        publish(tmp_path, staged(learner, tmp_path, "v000", key=None), keep=5, signing_key=KEY)
    assert V.read_current(tmp_path) is None
    publish(tmp_path, staged(learner, tmp_path, "v001", key=None), keep=5)  # an old, unsigned version
    published(learner, tmp_path, "v002")
    with pytest.raises(ArtifactError, match=r"no version older than v002 verifies \(v001: .*unsigned"):
        rollback(tmp_path, signing_key=KEY)
    assert V.current_version(tmp_path) == "v002" and V.read_pin(tmp_path) is None
    published(learner, tmp_path, "v003")
    assert rollback(tmp_path, signing_key=KEY) == "v002"


# -- serving: artifacts and deltas ---------------------------------------------------------------------
def test_serving_with_a_key_rejects_unsigned_artifacts_and_deltas_once_and_uses_signed_ones(
        tmp_path: Path, learner: TinyLearner) -> None:
    root, deltas = tmp_path / "serving", tmp_path / "deltas"
    published(learner, root, "v001", key=None)
    u, holder = updater(root, deltas)
    for _ in range(5):
        u.check_now()
    assert holder.live is None and rejected(u, "artifact") == 1 and "unsigned" in (holder.problem or "")
    published(learner, root, "v002")
    u.check_now()
    assert holder.live is not None and holder.live.model.version == "v002" and holder.problem is None
    unsigned = write_all_rows(deltas, learner, key=None)
    for _ in range(3):
        u.check_now()
    assert rejected(u, "delta") == 1 and holder.live.model.delta_seq == 0 and "unsigned" in (u.last_error or "")
    learner.train(1)
    signed = write_all_rows(deltas, learner, key=KEY)
    u.check_now()
    assert holder.live.model.delta_seq == 2 and rejected(u, "delta") == 1
    assert unsigned.exists() and signed.exists()
    keyless, holder2 = updater(root, deltas, key=None)  # serving without a key takes both
    keyless.check_now()
    assert holder2.live is not None and holder2.live.model.delta_seq == 2 and rejected(keyless, "delta") == 0


def test_serving_reads_its_key_from_the_settings_file_once(tmp_path: Path, learner: TinyLearner) -> None:
    f = tmp_path / "key"
    f.write_bytes(b"signing-key-of-this-deployment-0001\n")
    key = load_signing_key(f)
    root = tmp_path / "serving"
    published(learner, root, "v001")
    f.unlink()  # read once: the file may go (a rotated mount) without breaking loads
    u, holder = updater(root, key=key)
    u.check_now()
    assert holder.live is not None and holder.live.model.version == "v001"


# -- paths ---------------------------------------------------------------------------------------------
def test_a_version_directory_symlinked_outside_the_root_is_refused(tmp_path: Path, learner: TinyLearner) -> None:
    root = tmp_path / "serving"
    published(learner, root, "v001", key=None)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copytree(V.versions_dir(root) / "v001", elsewhere / "v002")
    rewrite_manifest(elsewhere / "v002", lambda m: m.update(version="v002"))
    (V.versions_dir(root) / "v002").symlink_to(elsewhere / "v002", target_is_directory=True)
    (root / V.CURRENT).write_text("v002\n")
    assert V.list_versions(root) == ["v001"]
    with pytest.raises(ArtifactError, match="outside"):
        V.read_current(root)
    with pytest.raises(ArtifactError, match="outside"):
        ScoringModel.load(V.versions_dir(root) / "v002")
    u, holder = updater(root, key=None)
    u.check_now()
    u.check_now()
    assert holder.live is None and rejected(u, "artifact") == 1 and "outside" in (holder.problem or "")
    (root / V.CURRENT).write_text("v001\n")
    u.check_now()
    assert holder.live is not None and holder.live.model.version == "v001"


@pytest.mark.parametrize("pointer", ["../elsewhere/v001", "..", "versions/../../x", "v001/..", ".hidden"])
def test_a_current_with_a_path_in_it_is_refused(tmp_path: Path, learner: TinyLearner, pointer: str) -> None:
    root = tmp_path / "serving"
    published(learner, root, "v001", key=None)
    (root / V.CURRENT).write_text(pointer + "\n")
    with pytest.raises(ArtifactError, match="not a version name"):
        V.read_current(root)
    u, holder = updater(root, key=None)
    u.check_now()
    assert holder.live is None and rejected(u, "artifact") == 1


def test_a_pin_naming_a_path_is_unreadable_and_pins_whatever_is_live(tmp_path: Path, learner: TinyLearner) -> None:
    root = tmp_path / "serving"
    published(learner, root, "v001", key=None)
    (root / V.PIN).write_text(json.dumps({"version": "v001", "rolled_back_from": "../../etc", "at": 1.0}))
    pin = V.read_pin(root)
    assert pin is not None and pin.problem is not None and pin.holds("v001")


def test_an_artifact_file_symlinked_outside_its_version_is_refused_even_with_matching_bytes(
        tmp_path: Path, learner: TinyLearner) -> None:
    root = tmp_path / "serving"
    v = published(learner, root, "v001")
    outside = tmp_path / "cold_rows.npy"
    shutil.copyfile(v / M.COLD_FILE, outside)  # the very bytes: size and sha256 match the manifest
    (v / M.COLD_FILE).unlink()
    (v / M.COLD_FILE).symlink_to(outside)
    for load in (lambda: A.verify(v), lambda: ScoringModel.load(v), lambda: ScoringModel.load(v, signing_key=KEY),
                 lambda: ScoringModel.load(v, verify_files=False)):
        with pytest.raises(ArtifactError, match="outside"):
            load()
    u, holder = updater(root)
    u.check_now()
    assert holder.live is None and rejected(u, "artifact") == 1


def test_a_manifest_symlinked_outside_its_version_is_refused(tmp_path: Path, learner: TinyLearner) -> None:
    v = published(learner, tmp_path, "v001", key=None)
    outside = tmp_path / "manifest.json"
    shutil.copyfile(v / M.MANIFEST, outside)
    (v / M.MANIFEST).unlink()
    (v / M.MANIFEST).symlink_to(outside)
    with pytest.raises(ArtifactError, match="outside"):
        ScoringModel.load(v)


def test_a_delta_symlinked_outside_the_deltas_directory_is_rejected_by_serving(tmp_path: Path,
                                                                             learner: TinyLearner) -> None:
    root, deltas = tmp_path / "serving", tmp_path / "deltas"
    published(learner, root, "v001", key=None)
    outside = write_all_rows(tmp_path / "elsewhere", learner, key=None)
    deltas.mkdir()
    delta_path(deltas, 1, learner.trainer.samples + 1).symlink_to(outside)
    u, holder = updater(root, deltas, key=None)
    u.check_now()
    u.check_now()
    assert holder.live is not None and holder.live.model.delta_seq == 0
    assert rejected(u, "delta") == 1 and "outside the deltas directory" in (u.last_error or "")


# -- the refresh job -------------------------------------------------------------------------------------
def test_the_refresh_signs_what_it_publishes_and_fails_on_an_unreadable_key(stack, tmp_path: Path) -> None:
    from tests.integration.test_refresh import save_checkpoint

    save_checkpoint(tmp_path / "ckpt", steps=3)
    key_file = tmp_path / "key"
    key_file.write_bytes(b"signing-key-of-this-deployment-0001\n")
    rs = RefreshSettings(checkpoint_dir=tmp_path / "ckpt", publish_root=tmp_path / "serving", holdout_messages=0,
                         alerts_topic="", redis_attempts=2, redis_backoff_s=0.01, signing_key_file=key_file,
                         format=ArtifactFormat.SAFETENSORS)
    rds = RedisSettings(url=stack.redis_url, prefix=f"t{uuid.uuid4().hex[:8]}")
    kafka = KafkaSettings(bootstrap_servers=stack.bootstrap_servers)
    summary = job.run_once(rs, kafka, rds)
    assert summary["published"] and summary["signed"]
    v = Path(summary["path"])
    M.check_signature(M.read_manifest(v), KEY)  # raises unless signed with KEY
    assert ScoringModel.load(v, signing_key=KEY).format == "safetensors"
    second = job.run_once(rs, kafka, rds)  # the live artifact (signed) is loaded with the key for comparison
    assert second["published"] and second["signed"]
    bad = RefreshSettings(checkpoint_dir=rs.checkpoint_dir, publish_root=rs.publish_root, holdout_messages=0,
                          alerts_topic="", signing_key_file=tmp_path / "missing-key")
    with pytest.raises(job.RefreshError, match=r"at signing: \[refresh\] signing_key_file .*missing-key") as info:
        job.run_once(bad, kafka, rds)
    assert info.value.stage == "signing" and V.current_version(rs.publish_root) == second["version"]
    assert redact(str(info.value)) == str(info.value)  # no part of the line reads as a secret to the log redactor
