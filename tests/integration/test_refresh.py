"""The cache refresh job (cache_refresh/) against the real broker and Redis of the session stack.

A small checkpoint is trained here (a tiny DeepFM, a few test-then-train steps through learner.trainer
on sample batches with a planted signal) and saved with learner.checkpoint, as the daemon saves it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
import pytest
import redis
import torch
from prometheus_client import REGISTRY

from cache_refresh import job, run_records, validate
from cache_refresh import redis_client as refresh_redis
from cache_refresh import status as refresh_status
from cache_refresh.publish import PUBLISHING
from cache_refresh.scheduler import build_scheduler, make_trigger, missed_run
from cache_refresh.settings import RefreshSettings
from learner import artifact_manifest, artifact_versions, checkpoint
from learner.batch import to_tensors
from learner.features import default_config
from learner.model import DeepFM
from learner.optim import make_optimizers
from learner.trainer import Trainer
from serving.model import ScoringModel
from serving.settings import EmbeddingStore
from serving.stored_versions import read_meta
from stream.config import KafkaSettings, RedisSettings
from stream.counts import DailyCounts
from stream.ids import stable_hash
from stream.kafka_producer import AckedProducer
from stream.kafka_topics import ensure_topics
from stream.samples import SampleBatch
from streamrec.cli import main
from streamrec.stack import free_port
from tests.kafka_io import read_topic
from tests.trickle_proxy import TrickleProxy
from tests.unit.cache_refresh.test_publish_after_switch import close_fails_for

CFG = default_config({"device": "single"}, buckets=2000, ctx_buckets=5, embedding_dim=8, dense=("age",))
USERS = [stable_hash(f"u{i}") for i in range(40)]
ITEMS = [stable_hash(f"i{i}") for i in range(30)]
DAY_MS = 1_750_000_000_000  # 2025-06-15 UTC


def sample_batch(rng: np.random.Generator, n: int = 256, clicked: int = 0) -> SampleBatch:
    """Clicks planted on the even items (odd with ``clicked=1``): a model learns it in a few steps."""
    item_idx = rng.integers(0, len(ITEMS), n)
    label = ((item_idx % 2 == clicked) & (rng.random(n) < 0.9)) | (rng.random(n) < 0.05)
    return SampleBatch.from_columns(
        impression_id=[uuid.uuid4().hex for _ in range(n)], ts=np.full(n, DAY_MS), label=label.astype(np.int8),
        label_delay_ms=np.zeros(n, np.int64), user_id=np.array(USERS)[rng.integers(0, len(USERS), n)],
        item_id=np.array(ITEMS)[item_idx],
        history=[list(np.array(ITEMS)[rng.integers(0, len(ITEMS), rng.integers(0, 4))]) for _ in range(n)],
        context={"device": rng.integers(0, 3, n)}, dense={"age": rng.random(n).astype(np.float32)})


def save_checkpoint(directory: Path, steps: int, seed: int = 0, clicked: int = 0) -> dict:
    """Train a tiny DeepFM ``steps`` steps and save it the way the daemon does; returns the meta."""
    rng = np.random.default_rng(seed)
    model = DeepFM(CFG, mlp=(16,), seed=seed)  # bf16 autocast as in the learner
    sparse, dense = make_optimizers(model, lr_sparse=0.2, lr_dense=0.01)
    trainer = Trainer(model, sparse, dense)
    for _ in range(steps):
        trainer.test_then_train(to_tensors(sample_batch(rng, clicked=clicked), CFG))
    meta = {"samples_trained": trainer.samples, "steps": trainer.steps, "offsets": {"0": steps},
            "partition_rows": {}, "duplicates": 0, "feature_config": CFG.to_dict(),
            "model": {"mlp": "16", "dropout": 0.0, "lr_sparse": 0.2, "lr_dense": 0.01,
                      "sparse_optimizer": "rowwise_adagrad", "amp": True, "seed": seed},
            "metrics": trainer.metrics.summary(), "topic": "samples"}
    state = {"model": model.state_dict(), "sparse_opt": sparse.state_dict(), "dense_opt": dense.state_dict(),
             "metrics": trainer.metrics.state_dict(), "recent_ids": []}
    checkpoint.save(directory, state, meta)
    time.sleep(0.002)  # checkpoint names carry ms: keep them ordered
    return meta


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(d, steps=30)
    return d


@pytest.fixture
def env(stack, kafka: KafkaSettings, tmp_path: Path, trained: Path, redis_client: redis.Redis):
    """Settings for one test: its own Redis prefix, samples and alerts topics, publish root, checkpoints."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    rds = RedisSettings(url=stack.redis_url, prefix=prefix)
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    for p in checkpoint.list_checkpoints(trained):
        for suffix in (".pt", ".json"):
            (ckpt_dir / p.with_suffix(suffix).name).write_bytes(p.with_suffix(suffix).read_bytes())
    # the directory's lineage too: a checkpoint a test saves here continues the training, as a resumed learner's does
    # (without it, it started a new lineage, and its publish switched lineage: a refresh_lineage_switched alert)
    (ckpt_dir / checkpoint.LINEAGE).write_bytes((trained / checkpoint.LINEAGE).read_bytes())
    rs = RefreshSettings(checkpoint_dir=ckpt_dir, publish_root=tmp_path / "serving", days=7, hot_items=10,
                         hot_users=5, small_field_rows=0, holdout_messages=4, holdout_timeout_s=10,
                         redis_attempts=3, redis_backoff_s=0.01, alerts_topic=f"alerts-{prefix}")
    # counts: item i{k} seen 100 - k times, user u{k} 50 - k times, on one day
    counts = DailyCounts(redis_client, prefix=prefix)
    items = [ITEMS[k] for k in range(len(ITEMS)) for _ in range(100 - k)]
    users = [USERS[k] for k in range(len(USERS)) for _ in range(50 - k)]
    counts.record("item", "impression", items, np.full(len(items), DAY_MS))
    counts.record("user", "impression", users, np.full(len(users), DAY_MS))
    # recent samples for the holdout
    ensure_topics(kafka, [kafka.samples_topic], partitions=1)
    producer = AckedProducer(kafka)
    rng = np.random.default_rng(99)
    for _ in range(4):
        producer.send(kafka.samples_topic, sample_batch(rng, 200).encode(), partition=0)
    producer.flush()
    return rs, kafka, rds


def expected_hot_rows() -> np.ndarray:
    (_, _), (item_first, item_rows) = CFG.blocks[0], CFG.blocks[1]
    user_first, user_rows = CFG.blocks[0]
    items = item_first + np.array(ITEMS[:10]) % item_rows
    users = user_first + np.array(USERS[:5]) % user_rows
    return np.unique(np.concatenate([items, users]))


def read_alerts(kafka: KafkaSettings, topic: str) -> list[dict]:
    return [json.loads(r.value) for r in read_topic(kafka, topic)]


def config_file(path: Path, rs: RefreshSettings, kafka: KafkaSettings, rds: RedisSettings) -> Path:
    lines = [f'[kafka]\nbootstrap_servers = "{kafka.bootstrap_servers}"\nsamples_topic = "{kafka.samples_topic}"',
             f'[redis]\nurl = "{rds.url}"\nprefix = "{rds.prefix}"', "[refresh]"]
    for f in dataclasses.fields(rs):
        v = getattr(rs, f.name)
        if v is None:  # TOML has no null: an unset optional setting is left out
            continue
        lines.append(f"{f.name} = {json.dumps(str(v) if isinstance(v, Path) else v)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_refresh_now_publishes_notifies_and_rolls_back_via_the_cli(env, tmp_path: Path, redis_client,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rs, kafka, rds = env
    cfg = config_file(tmp_path / "c.toml", rs, kafka, rds)
    pubsub = redis_client.pubsub()
    pubsub.subscribe(f"{rds.prefix}:model-updates")
    # the subscribe confirmation, read here whenever it comes: a 1 s wait that ran out on a loaded machine left it to
    # the read of the first notification below (reproduced with CLIENT PAUSE 1500 before the SUBSCRIBE)
    confirmed = pubsub.get_message(timeout=60)
    assert confirmed is not None and confirmed["type"] == "subscribe", confirmed

    assert main(["refresh", "--now", "--json", "--config", str(cfg)]) == 0
    first = json.loads(capsys.readouterr().out)
    root = rs.publish_root
    assert artifact_versions.read_current(root) == Path(first["path"])
    manifest = json.loads((Path(first["path"]) / artifact_manifest.MANIFEST).read_text())
    newest = checkpoint.list_checkpoints(rs.checkpoint_dir)[-1]
    assert manifest["source"]["checkpoint"] == str(newest) == first["checkpoint"]
    assert manifest["source"]["samples_trained"] == 30 * 256 and manifest["source"]["offsets"] == {"0": 30}
    assert manifest["hot_set"]["items"] == 10 and manifest["hot_set"]["users"] == 5
    assert manifest["hot_set"]["rows"] == len(expected_hot_rows())
    model = ScoringModel.load(Path(first["path"]))
    assert np.array_equal(model._hot_ids[:-1], expected_hot_rows())
    assert first["probe"]["max_abs_diff"] <= rs.validate_tolerance
    assert first["holdout"]["new"]["samples"] == 800 and first["holdout"]["new"]["auc"] > 0.8
    assert first["holdout"]["skipped"] == "no live artifact to compare with"
    msg = pubsub.get_message(timeout=5)
    assert msg is not None and json.loads(msg["data"])["version"] == first["version"]

    # a second refresh compares with the live one, then the CLI rolls back to the first
    save_checkpoint(rs.checkpoint_dir, steps=35, seed=1)
    assert main(["refresh", "--now", "--json", "--config", str(cfg)]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["holdout"]["live"]["version"] == first["version"] and "auc_drop" in second["holdout"]
    assert artifact_versions.read_current(root).name == second["version"]
    assert json.loads(pubsub.get_message(timeout=5)["data"])["version"] == second["version"]
    assert main(["refresh", "--status", "--json", "--config", str(cfg)]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["current"] == second["version"] and status["versions"] == [first["version"], second["version"]]
    assert status["manifest"]["source"]["samples_trained"] == 35 * 256

    assert main(["refresh", "--rollback", "--json", "--config", str(cfg)]) == 0
    assert json.loads(capsys.readouterr().out)["current"] == first["version"]
    assert artifact_versions.read_current(root).name == first["version"]
    msg = pubsub.get_message(timeout=5)
    assert msg is not None and json.loads(msg["data"])["version"] == first["version"]
    assert main(["refresh", "--rollback", "--config", str(cfg)]) == 1  # nothing older
    assert "no version older" in capsys.readouterr().err
    pubsub.close()


def _assert_nothing_published(rs: RefreshSettings, before: Path | None, versions: list[str]) -> None:
    assert artifact_versions.read_current(rs.publish_root) == before
    assert artifact_versions.list_versions(rs.publish_root) == versions
    staging = rs.publish_root / artifact_versions.STAGING
    assert not staging.exists() or not any(staging.iterdir())


def test_probe_mismatch_publishes_nothing_and_alerts(env, monkeypatch: pytest.MonkeyPatch) -> None:
    rs, kafka, rds = env
    real = validate.eager_model

    def drifted(ckpt):  # as if the export had dropped a term: the artifact no longer equals the learner
        model = real(ckpt)
        with torch.no_grad():
            model.bias.add_(0.01)
        return model

    monkeypatch.setattr(validate, "eager_model", drifted)
    with pytest.raises(job.RefreshError, match="at validate: probe: artifact scores differ"):
        job.run_once(rs, kafka, rds)
    _assert_nothing_published(rs, None, [])
    alerts = read_alerts(kafka, rs.alerts_topic)
    assert len(alerts) == 1
    a = alerts[0]
    assert a["source"] == "refresh" and a["state"] == "firing" and a["severity"] == "critical"
    assert a["labels"] == {"stage": "validate"} and "probe" in a["message"] and a["ts"] > 0


def test_holdout_worse_than_the_live_artifact_publishes_nothing(env) -> None:
    rs, kafka, rds = env
    live = job.run_once(rs, kafka, rds)
    # the newest checkpoint learned the opposite of what the recent samples show
    save_checkpoint(rs.checkpoint_dir, steps=40, seed=3, clicked=1)
    with pytest.raises(job.RefreshError, match="holdout: AUC .* below the live artifact"):
        job.run_once(rs, kafka, rds)
    _assert_nothing_published(rs, Path(live["path"]), [live["version"]])
    alerts = read_alerts(kafka, rs.alerts_topic)
    assert [a["labels"]["stage"] for a in alerts] == ["validate"] and "holdout" in alerts[0]["message"]


def test_the_int8_bound_comes_from_the_settings_and_refuses_an_int8_artifact_past_it(env) -> None:
    rs, kafka, rds = env
    published = job.run_once(dataclasses.replace(rs, format="onnx_int8"), kafka, rds)  # default bound 0.002
    assert published["holdout"]["int8"]["max_int8_auc_drop"] == 0.002
    strict = dataclasses.replace(rs, format="onnx_int8", max_int8_auc_drop=-1.0)  # INT8 would have to gain 1 AUC
    with pytest.raises(job.RefreshError, match="at validate: holdout: onnx_int8 AUC .* max_int8_auc_drop -1"):
        job.run_once(strict, kafka, rds)
    _assert_nothing_published(rs, Path(published["path"]), [published["version"]])


def test_a_static_int8_artifact_is_calibrated_on_the_older_holdout_gated_on_the_newer_and_served(env) -> None:
    """onnx_int8_static through the refresh job: the oldest of the 4 holdout messages calibrates it, the 3 newer
    (600 samples) measure its AUC cost against its fp32 path; published, serving loads it and scores within the INT8
    probe bound of fp32; refused past max_int8_auc_drop; too small a holdout to calibrate on: the error names the
    setting, nothing is published."""
    rs, kafka, rds = env
    published = job.run_once(dataclasses.replace(rs, format="onnx_int8_static"), kafka, rds)
    assert published["format"] == "onnx_int8_static"
    assert published["holdout"]["int8"]["fp32"]["samples"] == published["holdout"]["new"]["samples"] == 600
    # bounded on the measured holdout samples; on the random probe (off-distribution) only recorded
    assert 0 < published["probe"]["int8_max_abs_diff_on_samples"] < validate.INT8_PROBE_BOUND
    assert published["probe"]["int8_max_abs_diff"] > 0
    served = ScoringModel.load(Path(published["path"]))
    assert served.format == "onnx_int8_static"
    tb = to_tensors(sample_batch(np.random.default_rng(5), 200), CFG)  # requests as the traffic makes them
    served.map_batch(tb)
    diff = (served.score(tb.values, tb.offsets, tb.dense) - served.score(tb.values, tb.offsets, tb.dense, fp32=True))
    assert 0 < float(diff.abs().max()) < validate.INT8_PROBE_BOUND
    strict = dataclasses.replace(rs, format="onnx_int8_static", max_int8_auc_drop=-1.0)
    with pytest.raises(job.RefreshError, match="at validate: holdout: onnx_int8_static AUC .* max_int8_auc_drop -1"):
        job.run_once(strict, kafka, rds)
    few = dataclasses.replace(rs, format="onnx_int8_static", holdout_messages=1)
    with pytest.raises(job.RefreshError, match=r"at build: format onnx_int8_static is calibrated on the holdout's "
                                               r"older samples.*raise \[refresh\] holdout_messages \(now 1\)"):
        job.run_once(few, kafka, rds)
    _assert_nothing_published(rs, Path(published["path"]), [published["version"]])


def test_a_publish_that_could_not_check_what_it_should_sends_a_refresh_degraded_warning(env, tmp_path: Path) -> None:
    """Published, but an operator must look: the live version exists yet does not load with this run's key (a key
    rotation), so the holdout comparison was skipped; the newest checkpoint was refused (diverged) and an older one
    used; no counted id in the hot set (a wrong prefix). Each is a ``refresh_degraded`` warning with its stage, and
    the summary lists them; a clean run sends none."""
    rs, kafka, rds = env
    first = job.run_once(rs, kafka, rds)  # unsigned, nothing live: a clean run
    assert first["warnings"] == [] and read_alerts(kafka, rs.alerts_topic) == []
    key = tmp_path / "key"
    key.write_text("k" * 32)
    save_checkpoint(rs.checkpoint_dir, steps=32, seed=1)  # a good newer one ...
    meta = save_checkpoint(rs.checkpoint_dir, steps=34, seed=2)  # ... behind a diverged newest one
    newest = checkpoint.list_checkpoints(rs.checkpoint_dir)[-1]
    state = checkpoint.load(newest)
    state["model"]["bias"].fill_(float("nan"))
    newest.unlink()
    diverged = checkpoint.save(rs.checkpoint_dir, {k: v for k, v in state.items() if k != "meta"}, meta)
    rotated = dataclasses.replace(rs, signing_key_file=key)
    second = job.run_once(rotated, kafka, dataclasses.replace(rds, prefix=f"{rds.prefix}-empty"))
    assert second["samples_trained"] == 32 * 256 and len(second["skipped_checkpoints"]) == 1
    assert "non-finite" in second["skipped_checkpoints"][0]["reason"]
    assert second["holdout"]["unchecked"].startswith("the live artifact does not load")
    alerts = read_alerts(kafka, rs.alerts_topic)
    assert [(a["rule"], a["severity"], a["labels"]["stage"]) for a in alerts] == [
        ("refresh_degraded", "warning", "validate"), ("refresh_degraded", "warning", "checkpoint"),
        ("refresh_degraded", "warning", "hot_set")]
    assert [a["message"] for a in alerts] == second["warnings"]
    assert "does not load" in alerts[0]["message"] and diverged.name in alerts[1]["message"]
    assert artifact_versions.read_current(rs.publish_root).name == second["version"]


def test_a_layered_run_whose_publish_lock_close_reports_eio_after_the_switch_is_published_and_keeps_its_rows(
        env, monkeypatch: pytest.MonkeyPatch, redis_client: redis.Redis) -> None:
    """The close of the publish's lock file (after CURRENT named the version) reports EIO, as on NFS. Before, the
    OSError escaped publish(): the run failed ("nothing was published") and deleted the rows of the version it had
    made live, so every ranker that loaded it served hash-bucket fallbacks for its cold rows."""
    rs, kafka, rds = env
    rs = dataclasses.replace(rs, embedding_store=EmbeddingStore.LAYERED)
    failed = close_fails_for(monkeypatch, PUBLISHING)
    summary = job.run_once(rs, kafka, rds)
    monkeypatch.undo()
    assert failed and summary["published"] and artifact_versions.current_version(rs.publish_root) == summary["version"]
    assert read_meta(redis_client, rds.prefix, summary["version"]) is not None  # the live version's rows stay
    assert any(PUBLISHING in w and "closing" in w for w in summary["warnings"])  # published, with a warning
    assert run_records.read_last_run(Path(rs.publish_root))["warnings"] == summary["warnings"]  # recorded, and shown
    assert refresh_status.status(Path(rs.publish_root))["last_run_warnings"] == summary["warnings"]
    assert ("refresh_degraded", "publish") in [(a["rule"], a["labels"]["stage"])
                                               for a in read_alerts(kafka, rs.alerts_topic)]


def test_a_failed_run_keeps_the_rows_of_a_version_current_names(env, monkeypatch: pytest.MonkeyPatch,
                                                                 redis_client: redis.Redis) -> None:
    """A failure the publish did not contain, raised after CURRENT named the run's version: the run fails, but its
    failure path asks CURRENT before it deletes the version's rows (before: deleted, the live version's)."""
    rs, kafka, rds = env
    rs = dataclasses.replace(rs, embedding_store=EmbeddingStore.LAYERED)
    real = job.publish

    def publish_then_eio(*args: Any, **kw: Any) -> Path:
        real(*args, **kw)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(job, "publish", publish_then_eio)
    with pytest.raises(job.RefreshError) as err:
        job.run_once(rs, kafka, rds)
    assert err.value.stage == "publish"
    live = artifact_versions.current_version(rs.publish_root)
    assert live is not None and read_meta(redis_client, rds.prefix, live) is not None


def test_rows_a_failed_run_kept_because_current_could_not_be_read_are_deleted_by_the_next_publish(
        env, monkeypatch: pytest.MonkeyPatch, redis_client: redis.Redis) -> None:
    """A publish that failed before the switch, with CURRENT unreadable after it (EIO): the run keeps the version's
    rows (live or not is not known); the next publish, which finds the version in no publish root, deletes them."""
    rs, kafka, rds = env
    rs = dataclasses.replace(rs, embedding_store=EmbeddingStore.LAYERED)
    first = job.run_once(rs, kafka, rds)
    failed: list[str] = []
    real_current = artifact_versions.current_version

    def publish_fails(root: Path, staged: Path, *args: Any, **kw: Any) -> Path:
        failed.append(artifact_manifest.read_manifest(staged)["version"])
        raise artifact_versions.ArtifactError(f"could not make {failed[0]} current in {root}: EIO")

    def current_version(root: Path) -> str | None:
        if failed:
            raise artifact_versions.ArtifactError(f"{Path(root) / artifact_versions.CURRENT} cannot be read (EIO)")
        return real_current(root)

    monkeypatch.setattr(job, "publish", publish_fails)
    monkeypatch.setattr(artifact_versions, "current_version", current_version)
    with pytest.raises(job.RefreshError):
        job.run_once(rs, kafka, rds)
    monkeypatch.undo()
    assert failed and read_meta(redis_client, rds.prefix, failed[0]) is not None  # kept: not known not live
    third = job.run_once(rs, kafka, rds)
    assert read_meta(redis_client, rds.prefix, failed[0]) is None  # in no publish root: deleted by the publish
    assert read_meta(redis_client, rds.prefix, third["version"]) is not None
    assert read_meta(redis_client, rds.prefix, first["version"]) is not None  # live until rankers swap


def serving_process_serves(client: redis.Redis, prefix: str, version: str, host: str = "host-a",
                           pid: int = 4242) -> None:
    """What a scoring process writes (serving/served_versions.py): the version it serves, under its instance's key."""
    client.set(f"{prefix}:serving:{host}:{pid}:0a1b2c3d", json.dumps({"version": version, "host": host, "pid": pid,
                                                             "since": 0.0}), ex=30)


def test_a_version_a_scoring_process_still_serves_is_kept_past_keep_versions_with_its_rows(
        env, redis_client: redis.Redis) -> None:
    """Serving rejected every publish after its version (a signing key mismatch, an artifact failing its probe) and
    still scores with it. Before, the prune knew nothing of it: two publishes later (keep_versions 1) its directory
    was deleted and then its embedding-store rows (every layered miss fell back to bucket rows, and a restarted
    serving found no model it accepts). Now it is kept, files and rows, and the summary says why."""
    rs, kafka, rds = env
    rs = dataclasses.replace(rs, embedding_store=EmbeddingStore.LAYERED, keep_versions=1)
    served = job.run_once(rs, kafka, rds)["version"]
    serving_process_serves(redis_client, rds.prefix, served)
    job.run_once(rs, kafka, rds)
    last = job.run_once(rs, kafka, rds)
    assert served in artifact_versions.list_versions(rs.publish_root)
    assert read_meta(redis_client, rds.prefix, served) is not None
    assert last["kept_served"] == [f"kept {served}: served by host-a:4242"]
    assert len(artifact_versions.list_versions(rs.publish_root)) == 2  # the one in between pruned as before


def test_redis_failing_when_the_refresh_reads_what_serving_serves_prunes_as_before_with_a_warning(
        env, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    rs, kafka, rds = env
    rs = dataclasses.replace(rs, keep_versions=1)
    first = job.run_once(rs, kafka, rds)["version"]
    serving_process_serves(redis_client, rds.prefix, first)

    def unreachable(*_a: object, **_kw: object) -> dict[str, list[str]]:
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(job, "served_versions", unreachable)
    second = job.run_once(rs, kafka, rds)
    assert second["published"] and second["kept_served"] == []
    assert artifact_versions.list_versions(rs.publish_root) == [second["version"]]  # pruned as before the fix
    assert any(r.levelname == "WARNING" and "could not read which versions serving serves" in r.getMessage()
               for r in caplog.records)


def test_the_refresh_reads_which_version_a_dead_redis_serves_as_none_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    rs = RefreshSettings(redis_attempts=1, redis_timeout_s=1.0)
    assert job._served(rs, RedisSettings(url=f"redis://127.0.0.1:{free_port()}")) == {}
    assert [r.levelname for r in caplog.records if "which versions serving serves" in r.getMessage()] == ["WARNING"]


def test_an_operators_run_over_an_unreadable_pin_says_the_pin_was_unreadable(
        env, caplog: pytest.LogCaptureFixture) -> None:
    rs, kafka, rds = env
    job.run_once(rs, kafka, rds)
    (rs.publish_root / artifact_versions.PIN).write_bytes(b"\xff not json")
    with caplog.at_level("WARNING", logger="streamrec.refresh"):
        second = job.run_once(dataclasses.replace(rs, holdout_messages=0), kafka, rds)  # --now: over the pin
    assert second["unpinned"]["version"] is None
    assert any("over an unreadable rollback pin (" in r.getMessage() for r in caplog.records)
    assert not any("pin of None" in r.getMessage() for r in caplog.records)


def test_redis_unreachable_retries_with_backoff_then_fails(env, tmp_path: Path) -> None:
    rs, kafka, rds = env
    live = job.run_once(rs, kafka, rds)
    dead = dataclasses.replace(rds, url=f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    waits: list[float] = []
    failed = REGISTRY.get_sample_value("streamrec_refresh_runs_total", {"outcome": "failed", "stage": "hot_set"}) or 0
    with pytest.raises(job.RefreshError, match="at hot_set: .*unreachable after 3 attempt"):
        job.run_once(rs, kafka, dead, sleep=waits.append)
    assert waits == [0.01, 0.02]  # exponential backoff between the 3 attempts
    assert REGISTRY.get_sample_value("streamrec_refresh_runs_total", {"outcome": "failed", "stage": "hot_set"}) \
        == failed + 1  # counted by stage (cache_refresh/metrics.py)
    _assert_nothing_published(rs, Path(live["path"]), [live["version"]])
    assert [a["labels"]["stage"] for a in read_alerts(kafka, rs.alerts_topic)] == ["hot_set"]
    # the CLI says so and exits 1
    cfg = config_file(tmp_path / "dead.toml", rs, kafka, dead)
    assert main(["refresh", "--now", "--config", str(cfg)]) == 1


def test_a_trickling_redis_fails_the_refresh_within_its_timeout_releases_the_lock_and_a_rerun_publishes(
        env, stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Redis trickles its replies a byte per 20 ms (``tests/trickle_proxy.py``), which a per-read socket timeout never
    trips: the refresh fails at its hot set within its attempts of its whole-reply timeout
    (``cache_refresh/redis_client.py`` ``redis_timeout_s``), with one line naming Redis and the timeout, and releases
    its lock, so a rerun once Redis is healthy publishes.
    Before whole-reply timeouts the run waited out the trickle holding the lock: that night's run and the next."""
    rs, kafka, rds = env
    rs = dataclasses.replace(rs, redis_timeout_s=1.0, redis_attempts=2)
    timeout_s = refresh_redis.redis_timeout_s(rs)
    bound = 3 * (rs.redis_attempts * timeout_s + rs.redis_backoff_s)  # the failure is due by 1/3 of this
    with TrickleProxy(stack.s.redis_port) as proxy:
        slow = dataclasses.replace(rds, url=proxy.url)
        proxy.trickling = True
        outcome: list[BaseException | dict] = []

        def run() -> None:
            try:
                outcome.append(job.run_once(rs, kafka, slow))
            except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
                outcome.append(exc)

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        try:
            runner.join(bound)
            done = not runner.is_alive()
        finally:
            proxy.trickling = False  # a run still held ends now: the test fails instead of hanging
            runner.join()
        assert done, f"the refresh was still running {bound:.1f} s into a trickling Redis: {outcome}"
        assert isinstance(outcome[0], job.RefreshError), outcome
        assert "at hot_set" in str(outcome[0]) and f"{timeout_s:g} s" in str(outcome[0]), outcome[0]
        assert artifact_versions.read_current(rs.publish_root) is None  # nothing published

        proxy.trickling = True  # the CLI: exit 1, one line naming Redis and the timeout
        cfg = config_file(tmp_path / "slow.toml", rs, kafka, slow)
        try:
            assert main(["refresh", "--now", "--config", str(cfg)]) == 1
        finally:
            proxy.trickling = False
        said = [x for x in capsys.readouterr().err.splitlines() if "refresh failed at hot_set" in x]
        assert len(said) == 1 and "Redis" in said[0] and f"{timeout_s:g} s" in said[0], said

        summary = job.run_once(rs, kafka, slow)  # Redis healthy again: the lock was released, the rerun publishes
    assert artifact_versions.read_current(rs.publish_root) == Path(summary["path"])
    print(f"\ntrickling redis: {said[0]}")


def test_no_checkpoint_is_a_clear_failure(env, tmp_path: Path) -> None:
    rs, kafka, rds = env
    rs = dataclasses.replace(rs, checkpoint_dir=tmp_path / "empty", alerts_topic="")
    with pytest.raises(job.RefreshError, match="at checkpoint: no checkpoint in"):
        job.run_once(rs, kafka, rds)


# -- schedule ------------------------------------------------------------------------------------
UTC = dt.timezone.utc


def at(*args: int, tz: dt.tzinfo = UTC) -> dt.datetime:
    return dt.datetime(*args, tzinfo=tz)


def test_missed_run_within_grace_runs_on_start() -> None:
    trig = make_trigger("0 3 * * *", "UTC")
    grace = 3600
    # down from 02:00 to 03:30: the 03:00 run was missed, 30 min ago
    assert missed_run(trig, at(2026, 1, 10, 3, 30), at(2026, 1, 9, 3, 5), grace) == at(2026, 1, 10, 3)
    # never ran at all: same
    assert missed_run(trig, at(2026, 1, 10, 3, 30), None, grace) == at(2026, 1, 10, 3)
    # it ran (succeeded at 03:02) before going down: nothing to catch up
    assert missed_run(trig, at(2026, 1, 10, 3, 30), at(2026, 1, 10, 3, 2), grace) is None
    # started beyond the grace period: wait for tomorrow's run
    assert missed_run(trig, at(2026, 1, 10, 4, 30), at(2026, 1, 9, 3, 5), grace) is None
    # before today's fire time: nothing due
    assert missed_run(trig, at(2026, 1, 10, 2, 59), at(2026, 1, 9, 3, 5), grace) is None
    # exactly at the fire time
    assert missed_run(trig, at(2026, 1, 10, 3), at(2026, 1, 9, 3, 5), grace) == at(2026, 1, 10, 3)


def test_missed_run_respects_the_time_zone_and_frequent_schedules() -> None:
    berlin = ZoneInfo("Europe/Berlin")
    trig = make_trigger("0 3 * * *", "Europe/Berlin")  # 03:00 Berlin = 02:00 UTC in winter
    assert missed_run(trig, at(2026, 1, 10, 2, 30), None, 3600) == at(2026, 1, 10, 3, tz=berlin)
    assert missed_run(trig, at(2026, 1, 10, 3, 30), None, 3600) is None  # 04:30 Berlin: beyond grace
    every_10 = make_trigger("*/10 * * * *", "UTC")
    assert missed_run(every_10, at(2026, 1, 10, 12, 25), at(2026, 1, 10, 12, 11), 3600) == at(2026, 1, 10, 12, 20)


def test_scheduler_runs_a_missed_run_on_start_and_not_otherwise() -> None:
    ran = threading.Event()

    def job_fn() -> None:
        ran.set()

    # every minute, 2 min grace, never succeeded: the run of the current minute is due at once
    sched = build_scheduler(job_fn, "* * * * *", "UTC", 120, None)
    assert {j.id for j in sched.get_jobs()} == {"refresh", "refresh-missed"}
    t = threading.Thread(target=sched.start)
    t.start()
    try:
        assert ran.wait(10)
        deadline = time.monotonic() + 10  # the one-shot job is removed after it ran: shut down after that
        while "refresh-missed" in {j.id for j in sched.get_jobs()} and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        sched.shutdown(wait=False)
        t.join(10)
    # succeeded just now: only the schedule
    just_now = dt.datetime.now(UTC)
    assert {j.id for j in build_scheduler(job_fn, "* * * * *", "UTC", 120, just_now).get_jobs()} == {"refresh"}
    job_opts = build_scheduler(job_fn, "0 3 * * *", "Europe/Berlin", 900, just_now).get_jobs()[0]
    assert job_opts.misfire_grace_time == 900 and job_opts.coalesce and job_opts.max_instances == 2


def test_scheduler_process_catches_up_on_start_and_stops_on_sigterm(env, tmp_path: Path) -> None:
    rs, kafka, rds = env
    cfg = config_file(tmp_path / "c.toml", dataclasses.replace(rs, schedule="* * * * *", misfire_grace_s=120),
                      kafka, rds)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "refresh", "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, STREAMREC_REFRESH_METRICS_PORT=str(port)))
    try:
        # CURRENT appears mid-run (the run then records its success, notifies and is counted), so wait for the
        # run to be counted: the last thing a run does
        published = 'streamrec_refresh_runs_total{outcome="published",stage=""}'
        values: dict[str, float] = {}
        deadline = time.monotonic() + 45
        while values.get(published, 0) < 1 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                continue  # the metrics server is not up yet
            values = {line.split(" ")[0]: float(line.split(" ")[-1]) for line in text.splitlines()
                      if line.startswith("streamrec_refresh_")}
        # the scheduler serves its metrics while it runs: the published run is counted, with its time and hot set
        assert values.get(published, 0) >= 1, values
        assert artifact_versions.read_current(rs.publish_root) is not None
        assert run_records.read_last_success(rs.publish_root) is not None
        assert values["streamrec_refresh_last_success_timestamp_seconds"] > time.time() - 120
        assert values["streamrec_refresh_hot_rows"] > 0 and values["streamrec_refresh_duration_seconds"] > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "was missed" in err and "published" in err


def test_bad_schedule_or_time_zone_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMREC_REFRESH_ALERTS_TOPIC", "")  # --now below alerts to the log only
    # the scheduler refuses to start (before anything runs) ...
    assert main(["refresh", "--schedule", "0 3 * *", "--publish-root", str(tmp_path)]) == 2
    assert "crontab" in capsys.readouterr().err
    assert main(["refresh", "--timezone", "Mars/Olympus", "--publish-root", str(tmp_path)]) == 2
    assert "Mars/Olympus" in capsys.readouterr().err
    # ... but the modes that do not use the schedule are not blocked by it (an emergency rollback, the status)
    assert main(["refresh", "--status", "--schedule", "0 3 * *", "--timezone", "Mars/Olympus", "--json",
                 "--publish-root", str(tmp_path)]) == 1  # runs: nothing published
    assert json.loads(capsys.readouterr().out)["current"] is None
    assert main(["refresh", "--rollback", "--schedule", "0 3 * *", "--publish-root", str(tmp_path)]) == 1
    assert "nothing to roll back to" in capsys.readouterr().err
    assert main(["refresh", "--now", "--timezone", "Mars/Olympus", "--publish-root", str(tmp_path / "p"),
                 "--checkpoint-dir", str(tmp_path / "none")]) == 1  # runs: fails at its checkpoint stage
    assert "refresh failed at checkpoint: no checkpoint" in capsys.readouterr().err
    assert main(["refresh", "--status", "--json", "--publish-root", str(tmp_path)]) == 1  # nothing published
    assert json.loads(capsys.readouterr().out)["current"] is None


def test_last_success_round_trip(tmp_path: Path) -> None:
    assert run_records.read_last_success(tmp_path) is None
    run_records.write_last_success(tmp_path, 1_750_000_000.5, "v1")
    assert run_records.read_last_success(tmp_path) == dt.datetime.fromtimestamp(1_750_000_000.5, tz=UTC)
