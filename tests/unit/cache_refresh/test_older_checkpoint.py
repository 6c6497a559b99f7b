"""A refresh refuses to publish a checkpoint that has trained fewer samples than the live version
(cache_refresh/job.py): a torn newest checkpoint makes ``load_latest`` fall back to an older one.

No Redis here: the check comes before the hot set, so a run that passes it fails at stage ``hot_set``
(Redis at a closed port, one attempt), which shows that the checkpoint was accepted.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from cache_refresh import job
from cache_refresh.publish import publish
from cache_refresh.settings import RefreshSettings
from learner import artifact_versions as V
from learner import checkpoint
from learner.artifact import build_artifact
from stream.config import KafkaSettings, RedisSettings
from streamrec.cli import main
from streamrec.stack import free_port
from tests.unit.learner.test_artifact import make_checkpoint

LINEAGE = "a" * 32


def save(directory: Path, samples: int, lineage: str = LINEAGE) -> Path:
    ck = make_checkpoint()
    path = checkpoint.save(directory, {"model": ck["model"]}, {**ck["meta"], "samples_trained": samples,
                                                                "lineage": lineage}, keep=10)
    time.sleep(0.002)  # names carry ms
    return path


@pytest.fixture
def setup(tmp_path: Path) -> tuple[RefreshSettings, KafkaSettings, RedisSettings]:
    root, ckpts = tmp_path / "serving", tmp_path / "ckpt"
    live = make_checkpoint()
    live["meta"] = {**live["meta"], "samples_trained": 512, "lineage": LINEAGE}
    publish(root, build_artifact(live, root, np.zeros(0), format="eager", version="v001"), keep=3)
    rs = RefreshSettings(checkpoint_dir=ckpts, publish_root=root, holdout_messages=0, alerts_topic="",
                         redis_attempts=1, redis_backoff_s=0.01, redis_timeout_s=0.5, format="eager")
    return rs, KafkaSettings(), RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0")


def stage_of(rs: RefreshSettings, kafka: KafkaSettings, rds: RedisSettings, **kw: bool) -> job.RefreshError:
    with pytest.raises(job.RefreshError) as err:
        job.run_once(rs, kafka, rds, sleep=lambda _s: None, **kw)
    return err.value


def test_a_torn_newest_checkpoint_does_not_publish_an_older_model(setup) -> None:
    rs, kafka, rds = setup
    save(rs.checkpoint_dir, 256)
    newest = save(rs.checkpoint_dir, 1024)
    newest.write_bytes(newest.read_bytes()[:1000])  # torn: load_latest falls back to the 256-sample one
    err = stage_of(rs, kafka, rds)
    assert err.stage == "checkpoint"
    assert "has trained 256 samples, fewer than the live version v001 (512 samples" in str(err)
    assert newest.name in str(err) and "--allow-older" in str(err)
    assert V.current_version(rs.publish_root) == "v001" and V.list_versions(rs.publish_root) == ["v001"]
    # the operator may publish it anyway: the check is passed (the run then fails here at the hot set: no Redis)
    assert stage_of(rs, kafka, rds, allow_older=True).stage == "hot_set"


def test_same_or_more_samples_or_another_lineage_pass_the_check(setup) -> None:
    rs, kafka, rds = setup
    behind = save(rs.checkpoint_dir, 511)  # one sample behind: refused
    assert stage_of(rs, kafka, rds).stage == "checkpoint"
    behind.unlink()
    behind.with_suffix(".json").unlink()
    p = save(rs.checkpoint_dir, 512)  # the same training point (no new samples since): still refreshed
    assert stage_of(rs, kafka, rds).stage == "hot_set"
    p.unlink()
    p.with_suffix(".json").unlink()
    save(rs.checkpoint_dir, 100, lineage="b" * 32)  # a learner started afresh: its count starts again
    assert stage_of(rs, kafka, rds).stage == "hot_set"


def test_the_cli_exits_1_with_the_reason_and_allow_older_needs_now(setup, capsys: pytest.CaptureFixture[str]) -> None:
    rs, _kafka, rds = setup
    save(rs.checkpoint_dir, 256)
    cfg = rs.publish_root.parent / "c.toml"
    cfg.write_text(f'[redis]\nurl = "{rds.url}"\n[refresh]\nholdout_messages = 0\nalerts_topic = ""\n'
                   f'redis_attempts = 1\ncheckpoint_dir = "{rs.checkpoint_dir}"\npublish_root = "{rs.publish_root}"\n')
    assert main(["refresh", "--now", "--config", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "refresh failed at checkpoint: the checkpoint" in err and "fewer than the live version v001" in err
    assert main(["refresh", "--status", "--allow-older", "--config", str(cfg)]) == 2
    assert "--allow-older goes with --now" in capsys.readouterr().err
    assert V.current_version(rs.publish_root) == "v001"
