"""A refresh whose checkpoint_dir holds only the sharded learner's checkpoints (``dcp-*/``, written under torchrun)
says so and how to go on (``streamrec train --checkpoint-dir DIR --unshard NEW_DIR``, then point the refresh at
NEW_DIR), as the single-process learner does (``learner/daemon.py`` ``refuse_sharded``): it said "no checkpoint ...
is the learner running with the same checkpoint_dir?", which sent the operator looking for a learner that was
running, with that very checkpoint_dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cache_refresh import job
from cache_refresh.settings import RefreshSettings
from learner import sharded_checkpoint
from stream.config import KafkaSettings, RedisSettings


def test_a_checkpoint_dir_of_sharded_checkpoints_fails_saying_to_unshard(tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpt"
    for name in ("dcp-000000000000800-1", "dcp-000000000001600-2"):
        (ckpts / name).mkdir(parents=True)
        (ckpts / name / sharded_checkpoint.META).write_text(json.dumps({"world_size": 2}))
    rs = RefreshSettings(checkpoint_dir=ckpts, publish_root=tmp_path / "serving", alerts_topic="")
    with pytest.raises(job.RefreshError) as err:
        job.run_once(rs, KafkaSettings(), RedisSettings(), sleep=lambda _s: None)
    text = str(err.value)
    assert err.value.stage == "checkpoint"
    assert "sharded checkpoints (newest dcp-000000000001600-2" in text
    assert f"streamrec train --checkpoint-dir {ckpts} --unshard NEW_DIR" in text
    assert "is the learner" not in text
    assert not (tmp_path / "serving" / "CURRENT").exists()


def test_an_empty_checkpoint_dir_still_asks_whether_the_learner_runs_there(tmp_path: Path) -> None:
    (tmp_path / "ckpt" / "dcp-000000000000800-1").mkdir(parents=True)  # no meta.json: never complete
    rs = RefreshSettings(checkpoint_dir=tmp_path / "ckpt", publish_root=tmp_path / "serving", alerts_topic="")
    with pytest.raises(job.RefreshError, match="is the learner"):
        job.run_once(rs, KafkaSettings(), RedisSettings(), sleep=lambda _s: None)
