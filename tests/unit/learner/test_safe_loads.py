"""Loads that run no code unless it is ours (the "secured deployment" issue): checkpoints are only ever read
weights-only (the learner's resume too), a pickled payload is refused without running, everything the learner
saves still loads that way, the signing key is read once and never printed, signed tensor packs and deltas,
deltas symlinked out of their directory, and the safetensors artifact, which unpickles nothing at all."""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cache_refresh.settings import RefreshSettings
from learner import artifact as A
from learner import artifact_manifest as M
from learner import artifact_versions as V
from learner import checkpoint as ck
from learner import tensorpack
from learner.batch import to_tensors
from learner.config import ArtifactFormat, Device, LearnerSettings
from learner.daemon import Learner
from learner.delta_reader import DeltaReader
from learner.delta_writer import DeltaWriter
from learner.deltas import DeltaError, delta_path, load_delta
from learner.features import FeatureConfig, FieldSpec
from learner.model import DeepFM
from learner.optim import make_optimizers
from learner.row_mapper import RowMapper
from learner.scorer import FORMATS, SCORER_FILES
from learner.tensorpack import SignatureError, SigningKey, load_signing_key
from learner.trainer import Trainer
from serving.model import ScoringModel
from serving.settings import ServeSettings
from stream.config import KafkaSettings
from stream.errors import ConfigError
from stream.samples import SampleBatch
from stream.secrets import redact

B = 8
CFG = FeatureConfig((FieldSpec("user_id", "single", B, capacity=40, admit_after=1),
                     FieldSpec("item_id", "single", 30),
                     FieldSpec("history", "sequence", 1, shares="item_id"),
                     FieldSpec("ctx.device", "single", 5)), dense=("price",), embedding_dim=4)


def samples(rng: np.random.Generator, n: int, start: int = 0) -> SampleBatch:
    return SampleBatch.from_columns(
        impression_id=[f"s{start + k}" for k in range(n)], ts=np.arange(start, start + n) * 1000,
        label=rng.integers(0, 2, n), label_delay_ms=np.zeros(n), user_id=rng.integers(0, 60, n),
        item_id=rng.integers(0, 30, n), history=[rng.integers(0, 30, 2).tolist() for _ in range(n)],
        context={"device": rng.integers(0, 5, n)}, dense={"price": rng.random(n).astype(np.float32)})


def trained(seed: int = 0) -> tuple[DeepFM, RowMapper, Trainer]:
    """A DeepFM with dynamic user ids, trained a little (own rows admitted, optimizer state non-empty)."""
    model = DeepFM(CFG, mlp=(8,), seed=seed, autocast_dtype=None)
    sparse, dense = make_optimizers(model, 0.1, 0.01)
    mapper, trainer = RowMapper(CFG), Trainer(model, sparse, dense)
    rng = np.random.default_rng(seed)
    for k in range(6):
        tb = to_tensors(samples(rng, 32, start=32 * k), CFG)
        mapper.apply(tb, now=float(k), model=model, sparse_opt=sparse)
        trainer.test_then_train(tb)
    return model, mapper, trainer


def artifact_checkpoint(model: DeepFM, mapper: RowMapper, samples_trained: int = 192) -> dict[str, Any]:
    return {"meta": {"feature_config": CFG.to_dict(), "samples_trained": samples_trained, "offsets": {},
                     "model": {"mlp": "8", "dropout": 0.0}},
            "model": {k: v.clone() for k, v in model.state_dict().items()}, "id_maps": mapper.state_dict(),
            "path": "/ckpt/x.pt"}


def ckpt_meta(samples: int = 10) -> dict[str, Any]:
    return {"samples_trained": samples, "steps": 1, "offsets": {}, "partition_rows": {}, "duplicates": 0,
            "feature_config": CFG.to_dict(),
            "model": {"mlp": "8", "dropout": 0.0, "sparse_optimizer": "rowwise_adagrad"}}


class _Touch:
    """What a hostile pickle does: on unpickling, call ``Path.touch(marker)`` (any callable would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def hostile_checkpoint(path: Path, marker: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"meta": {**ckpt_meta(), "format_version": ck.FORMAT_VERSION}, "model": _Touch(marker)}, path)
    return path


# -- checkpoints ------------------------------------------------------------------------------------------
def test_the_payload_is_live_so_the_tests_below_mean_something(tmp_path: Path) -> None:
    bad = hostile_checkpoint(tmp_path / "ckpt-000000000000001-1.pt", tmp_path / "control-marker")
    torch.load(bad, weights_only=False)  # the unrestricted load this issue removes: it runs the payload
    assert (tmp_path / "control-marker").exists()


@pytest.mark.parametrize("safe", [True, False], ids=["safe", "safe=False-is-safe-too"])
def test_a_checkpoint_carrying_a_pickled_payload_is_refused_without_running_it(tmp_path: Path, safe: bool) -> None:
    marker = tmp_path / "ran-marker"
    good = ck.save(tmp_path / "ck", {"model": {"w": torch.ones(2)}}, ckpt_meta(5))
    bad = hostile_checkpoint(tmp_path / "ck" / "ckpt-000000000000099-9999999999999.pt", marker)  # the newest
    problems: list[tuple[Path, str]] = []
    got = ck.load_latest(tmp_path / "ck", safe=safe, problems=problems)  # what the refresh calls
    assert not marker.exists()
    assert got is not None and got.path == good  # fell back to the previous, good checkpoint
    assert [p for p, _ in problems] == [bad] and "UnpicklingError" in problems[0][1]
    assert "Unsupported global" in problems[0][1]  # the reason names the global the file wanted
    with pytest.raises(Exception) as info:
        ck.load(bad, safe=safe)
    assert not marker.exists() and "Unsupported global" in str(info.value)


def test_the_learner_refuses_to_resume_from_or_start_over_checkpoints_that_do_not_load(tmp_path: Path) -> None:
    assert ck.restore_latest(tmp_path / "empty") is None  # no checkpoints: a new model
    marker = tmp_path / "ran-marker"
    bad = hostile_checkpoint(tmp_path / "ck" / "ckpt-000000000000001-1.pt", marker)
    with pytest.raises(ck.CheckpointError) as info:
        ck.restore_latest(tmp_path / "ck")
    assert not marker.exists()
    assert str(bad) in str(info.value) and "UnpicklingError" in str(info.value)
    good = ck.save(tmp_path / "ck", {"model": {"w": torch.ones(2)}}, ckpt_meta(0))  # sorts before the bad one
    assert good.name < bad.name
    got = ck.restore_latest(tmp_path / "ck")  # the newest is refused, the one before it is used
    assert got is not None and got.path == good and not marker.exists()


def test_everything_the_learner_saves_loads_weights_only_and_the_learner_resumes_from_it(tmp_path: Path) -> None:
    ls = LearnerSettings(checkpoint_dir=tmp_path / "ck", mlp=(8,), buckets=B, ctx_buckets=5, embedding_dim=4,
                         id_capacity=40, admit_after=1, device=Device.CPU, amp=False,
                         deltas_every_s=3600.0, deltas_dir=tmp_path / "deltas")
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9")  # never contacted: no offsets to commit
    first = Learner(kafka, ls)
    try:
        first._build(CFG, first._model_settings())
        rng = np.random.default_rng(1)
        for k in range(4):
            first._train(to_tensors(samples(rng, 32, start=32 * k), CFG))
        first.save()
        path = ck.list_checkpoints(tmp_path / "ck")[-1]
        raw = ck.load(path)  # weights-only, nothing but the minimal numpy allowlist
        assert {"model", "sparse_opt", "dense_opt", "metrics", "recent_ids", "id_maps", "cold_users",
                "cold_metrics", "warm_metrics"} <= set(raw)
        assert raw["id_maps"] and raw["meta"]["format_version"] == ck.FORMAT_VERSION
        second = Learner(kafka, ls)
        try:
            assert second._restore()  # the learner's own resume path: restore_latest, weights-only
            assert second.trainer is not None and first.trainer is not None
            for name, v in first.trainer.model.state_dict().items():
                assert torch.equal(v, second.trainer.model.state_dict()[name]), name
            assert second.trainer.samples == first.trainer.samples == 128
            assert second.mapper is not None and first.mapper is not None
            probe = np.arange(60)
            assert second.mapper.rows(0, probe).tolist() == first.mapper.rows(0, probe).tolist()
        finally:
            second.close()
    finally:
        first.close()


# -- the signing key ----------------------------------------------------------------------------------------
def test_the_signing_key_is_read_from_its_file_masked_and_never_pickled(tmp_path: Path) -> None:
    assert load_signing_key(None) is None
    f = tmp_path / "key"
    f.write_text("k3y-material-for-tests-0123456789\n")
    key = load_signing_key(f)
    assert key is not None and key.source == str(f)
    assert "k3y" not in repr(key) and "k3y" not in str(key) and "k3y" not in f"{key}"
    assert key.sign(b"x") == SigningKey(b"k3y-material-for-tests-0123456789").sign(b"x")  # newline dropped
    assert redact("leaked k3y-material-for-tests-0123456789 here") == "leaked *** here"
    with pytest.raises(TypeError, match="not pickled"):
        pickle.dumps(key)
    f.write_text("short\n")
    with pytest.raises(ConfigError, match=str(f)):
        load_signing_key(f)
    with pytest.raises(ConfigError, match="cannot read"):
        load_signing_key(tmp_path / "missing")


def test_settings_have_an_optional_signing_key_file_and_the_safetensors_format() -> None:
    assert LearnerSettings().signing_key_file is None
    assert RefreshSettings().signing_key_file is None and ServeSettings().signing_key_file is None
    assert ArtifactFormat.of("safetensors", "format") is ArtifactFormat.SAFETENSORS
    assert SCORER_FILES["safetensors"] == "scorer.safetensors" and "safetensors" in FORMATS


# -- signed packs and deltas -------------------------------------------------------------------------------
KEY = SigningKey(b"0123456789abcdef0123456789abcdef")
OTHER = SigningKey(b"fedcba9876543210fedcba9876543210")


def test_a_signed_pack_is_read_with_its_key_and_a_keyed_reader_refuses_any_other() -> None:
    tree: dict[str, Any] = {"a": torch.arange(4), "b": [1.5, float("-inf")], "c": None}
    plain, signed = tensorpack.pack(tree), tensorpack.pack(tree, KEY)
    assert plain[:8] == tensorpack.MAGIC and plain[8:40] == hashlib.sha256(plain[40:]).digest()  # format 1 as before
    assert signed[:8] == tensorpack.MAGIC_SIGNED and tensorpack.is_signed(signed)
    assert signed[40:72] == KEY.digest(signed[72:]) and signed[8:40] == hashlib.sha256(signed[40:]).digest()
    for raw in (plain, signed):  # a reader without a key reads both
        assert torch.equal(tensorpack.unpack(raw)["a"], tree["a"])
    assert torch.equal(tensorpack.unpack(signed, KEY)["a"], tree["a"])
    with pytest.raises(SignatureError, match="unsigned"):
        tensorpack.unpack(plain, KEY)
    with pytest.raises(SignatureError, match="does not match"):
        tensorpack.unpack(signed, OTHER)
    # altered after signing, with a valid checksum (someone who can write files but has no key)
    forged_body = bytearray(signed[40:])
    forged_body[-1] ^= 1
    forged = tensorpack.MAGIC_SIGNED + hashlib.sha256(forged_body).digest() + bytes(forged_body)
    tensorpack.unpack(forged)  # intact as far as the checksum goes
    with pytest.raises(SignatureError, match="does not match"):
        tensorpack.unpack(forged, KEY)
    with pytest.raises(tensorpack.PackError, match="sha256"):  # a torn signed pack is still just corrupt
        tensorpack.unpack(signed[:-1] + bytes([signed[-1] ^ 1]), KEY)


def _write_delta(directory: Path, key: SigningKey | None, model: DeepFM, samples_trained: int = 500) -> Path:
    writer = DeltaWriter(directory, CFG.num_rows, every_s=3600, key=key)
    writer.mark(torch.arange(CFG.num_rows))
    path = writer.write(model, samples_trained)
    assert path is not None
    return path


def test_a_learner_with_a_key_signs_its_deltas_and_a_reader_with_the_key_takes_only_those(tmp_path: Path) -> None:
    model, _, _ = trained()
    signed = _write_delta(tmp_path / "d", KEY, model)
    d = load_delta(signed, KEY)
    assert d.signed and d.seq == 1 and torch.equal(d.vectors, model.sparse.bag.weight.detach())
    assert load_delta(signed).signed  # a reader without a key reads it (checksum checked)
    with pytest.raises(DeltaError, match="does not match"):
        load_delta(signed, OTHER)
    unsigned = _write_delta(tmp_path / "d", None, model, samples_trained=600)
    assert not load_delta(unsigned).signed
    with pytest.raises(DeltaError, match="unsigned"):
        load_delta(unsigned, KEY)
    rejected: list[tuple[Path, str]] = []
    reader = DeltaReader(tmp_path / "d", on_reject=lambda p, why: rejected.append((p, why)), key=KEY)
    assert [x.path for x in reader.newer(0, 0)] == [signed]
    assert [p for p, _ in rejected] == [unsigned] and "unsigned" in rejected[0][1]


def test_a_learner_builds_its_delta_writer_with_the_key_of_its_settings(tmp_path: Path) -> None:
    f = tmp_path / "key"
    f.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    ls = LearnerSettings(checkpoint_dir=tmp_path / "ck", deltas_dir=tmp_path / "d", deltas_every_s=1.0,
                         signing_key_file=f)
    writer = DeltaWriter.from_settings(ls, CFG.num_rows)
    assert writer.key is not None and writer.key.sign(b"x") == KEY.sign(b"x")
    model, _, _ = trained()
    writer.mark(torch.arange(3))
    path = writer.write(model, 7)
    assert path is not None and load_delta(path, KEY).signed


def test_a_delta_symlinked_outside_the_deltas_directory_is_refused_unread(tmp_path: Path) -> None:
    model, _, _ = trained()
    outside = _write_delta(tmp_path / "elsewhere", None, model)
    deltas = tmp_path / "deltas"
    deltas.mkdir()
    link = delta_path(deltas, 1, 500)
    link.symlink_to(outside)  # named as a delta of this directory, bytes from elsewhere
    with pytest.raises(DeltaError, match="outside the deltas directory"):
        load_delta(link)
    rejected: list[tuple[Path, str]] = []
    reader = DeltaReader(deltas, on_reject=lambda p, why: rejected.append((p, why)))
    assert list(reader.newer(0, 0)) == [] and [p for p, _ in rejected] == [link] and reader.bad == 1
    inside = deltas / "spare"
    inside.write_bytes(outside.read_bytes())
    link.unlink()
    link.symlink_to(inside)  # a symlink to a file of the same directory is fine
    assert load_delta(link).seq == 1


def test_a_delta_swapped_for_a_symlink_outside_after_its_check_is_refused_unread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The inside-the-directory check was by path and the open after it followed symlinks: a delta replaced by a
    symlink to a file outside the directory between the two was read (serving applied bytes from elsewhere). The file
    is now opened once without following a symlink, and what a symlink there resolves to is checked again."""
    import learner.deltas as deltas_mod

    model, _, _ = trained()
    outside = _write_delta(tmp_path / "elsewhere", None, trained(seed=1)[0])  # (named alike: it would pass)
    deltas = tmp_path / "deltas"
    path = _write_delta(deltas, None, model)
    check = deltas_mod._check_inside
    swapped: list[Path] = []

    def check_then_swap(p: Path) -> Any:
        result = check(p)
        if not swapped:  # right after the check: the delta becomes a symlink out of the directory
            p.unlink()
            p.symlink_to(outside)
            swapped.append(p)
        return result

    monkeypatch.setattr(deltas_mod, "_check_inside", check_then_swap)
    read: list[int] = []
    decode = deltas_mod.decode_delta
    monkeypatch.setattr(deltas_mod, "decode_delta", lambda data, *a: read.append(len(data)) or decode(data, *a))
    with pytest.raises(DeltaError, match="outside the deltas directory"):
        load_delta(path)
    assert swapped == [path] and read == []


# -- the safetensors artifact --------------------------------------------------------------------------
def test_a_safetensors_artifact_loads_and_scores_without_unpickling_anything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, mapper, _ = trained()
    ckpt = artifact_checkpoint(model, mapper)
    hot = np.arange(0, CFG.num_rows, 3)
    staged = A.build_artifact(ckpt, tmp_path, hot, format="safetensors", version="v001")
    manifest = json.loads((staged / M.MANIFEST).read_text())
    assert set(manifest["files"]) == {"scorer.safetensors", M.COLD_FILE, M.ID_MAPS_PACK}
    assert (staged / "scorer.safetensors").read_bytes()[8:9] == b"{"  # a JSON header, then raw tensor bytes
    reference = ScoringModel.load(A.build_artifact(ckpt, tmp_path, hot, format="torchscript", version="v002"))

    def no(name: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"{name} called while loading a safetensors artifact")
        return refuse

    for target, name in ((torch, "load"), (torch.jit, "load"), (torch.export, "load"), (pickle, "load"),
                         (pickle, "loads"), (pickle, "Unpickler")):
        monkeypatch.setattr(target, name, no(f"{target.__name__}.{name}"))
    served = ScoringModel.load(staged)
    probe = np.arange(60)
    assert served.map_rows(0, probe).tolist() == mapper.rows(0, probe).tolist()  # the id maps came along
    monkeypatch.undo()
    tb, tb2 = (to_tensors(samples(np.random.default_rng(5), 16, start=999), CFG) for _ in range(2))
    served.map_batch(tb)
    reference.map_batch(tb2)
    assert torch.equal(tb.values, tb2.values)
    got = served.score(tb.values, tb.offsets, tb.dense)
    want = reference.score(tb2.values, tb2.offsets, tb2.dense)
    assert torch.allclose(got, want, atol=1e-6, rtol=0)


def test_a_safetensors_manifest_listing_a_pickled_id_maps_file_is_refused(tmp_path: Path) -> None:
    model, mapper, _ = trained()
    staged = A.build_artifact(artifact_checkpoint(model, mapper), tmp_path, np.arange(5), format="safetensors")
    m = json.loads((staged / M.MANIFEST).read_text())
    m["files"][M.ID_MAPS_FILE] = m["files"].pop(M.ID_MAPS_PACK)
    with pytest.raises(V.ArtifactError, match="a pickle, in a safetensors artifact"):
        M.decode_manifest(json.dumps(m).encode())


@pytest.mark.parametrize("mode, warned", [(0o600, False), (0o400, False), (0o640, False), (0o440, False),
                                          (0o644, True), (0o604, True), (0o620, True), (0o602, True)])
def test_a_signing_key_file_other_users_can_read_or_a_group_can_write_is_loaded_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int, warned: bool) -> None:
    # Any local user who reads the key can sign deltas and manifests serving accepts; one who writes it chooses the
    # key a restarted process trusts. Refusing would break secret volumes mounted 0644 (Kubernetes' default mode),
    # so it is loaded, with a warning naming the file, its mode and the fix; a group that only reads it is silent.
    f = tmp_path / "key"
    f.write_text("k3y-material-for-tests-0123456789\n")
    f.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="learner.tensorpack"):
        assert load_signing_key(f) is not None
    lines = [r.getMessage() for r in caplog.records if r.name == "learner.tensorpack"]
    assert bool(lines) is warned, lines
    if warned:
        assert str(f) in lines[0] and oct(mode)[2:] in lines[0] and "chmod 600" in lines[0]
        assert "k3y-material" not in lines[0] and redact(lines[0]) == lines[0]  # the log filter leaves it whole
        assert ("every local user can read it" in lines[0]) is bool(mode & 0o004)
