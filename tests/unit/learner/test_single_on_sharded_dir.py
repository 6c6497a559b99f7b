"""A single-process learner started on a checkpoint_dir of the sharded learner's checkpoints (``dcp-*/``, written
under torchrun) refuses, saying how to go on (the same world size, or ``--unshard``): it started a fresh model there
in silence, training every retained sample again over the sharded progress. The sharded learner already refuses a
directory of single-process checkpoints (``learner/sharded_daemon.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from learner import sharded_checkpoint
from learner.config import LearnerSettings
from learner.daemon import Learner, refuse_sharded
from stream.errors import ConfigError


def _sharded(directory: Path, name: str, world_size: int) -> None:
    (directory / name).mkdir(parents=True)
    meta = {"world_size": world_size, "samples_trained": 800}  # (both required: sharded_checkpoint._bad_field)
    (directory / name / sharded_checkpoint.META).write_text(json.dumps(meta))


def test_a_single_process_learner_refuses_a_directory_of_sharded_checkpoints_and_says_how_to_go_on(
        tmp_path: Path) -> None:
    _sharded(tmp_path, "dcp-000000000000800-1", 2)
    _sharded(tmp_path, "dcp-000000000001600-2", 2)
    (tmp_path / ".group").write_text("0123")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ConfigError) as refused:  # where the daemon's run() starts: before Kafka, before any model
        Learner._restore(SimpleNamespace(ls=LearnerSettings(checkpoint_dir=tmp_path)))  # type: ignore[arg-type]
    text = str(refused.value)
    assert text.startswith(f"[learner] checkpoint_dir {tmp_path} holds sharded checkpoints (newest "
                           "dcp-000000000001600-2, written by 2 ranks under torchrun)")
    assert "same world size" in text and f"--checkpoint-dir {tmp_path} --unshard NEW_DIR" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written there


def test_a_directory_without_a_complete_sharded_checkpoint_is_no_reason_to_refuse(tmp_path: Path) -> None:
    """A sharded start that never finished a checkpoint (its ``.group`` token, a ``.tmp-dcp-`` directory) left no
    progress to lose; a meta.json that cannot be read still refuses, without the rank count."""
    (tmp_path / ".group").write_text("0123")
    (tmp_path / ".tmp-dcp-000000000000800-1").mkdir()
    (tmp_path / "dcp-000000000000800-1").mkdir()  # no meta.json: never complete
    refuse_sharded(tmp_path)
    refuse_sharded(tmp_path / "missing")
    (tmp_path / "dcp-000000000000800-1" / sharded_checkpoint.META).write_text("{torn")
    with pytest.raises(ConfigError, match=r"newest dcp-000000000000800-1, written under torchrun\)"):
        refuse_sharded(tmp_path)
