"""The sharded learner's hold on ``<checkpoint_dir>/LOCK``, the single-process learner's lock
(``learner/checkpoint_directory.py: hold_directory``): two torchrun jobs, or a job and a single-process learner, on one
directory numbered their serving deltas from their own counters and pruned each other's checkpoints. Rank 0 takes
the lock before any checkpoint is read and every rank learns whether it did (one gloo rank here; the two-rank
refusal is in ``test_distributed.py``)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

import pytest

from learner import checkpoint
from learner.config import LearnerSettings
from learner.distributed import RankContext
from stream.config import KafkaSettings
from stream.errors import ConfigError
from stream.limits import DEFAULT_LIMITS
from stream.stop_signals import StopsTaken
from tests.unit.learner.test_sharded_metrics import NoBroker


def train(monkeypatch: pytest.MonkeyPatch, ckpt: Path, run: Any) -> dict[str, Any]:
    """Rank 0's ``_train`` of a one-rank job whose ``ShardedLearner.run`` is ``run``; reading a checkpoint fails."""
    import learner.sharded_daemon as sd

    def no_read(*a: Any, **k: Any) -> None:
        raise AssertionError("a checkpoint was read")

    monkeypatch.setattr(sd.sharded_checkpoint, "latest", no_read)
    monkeypatch.setattr(sd, "new_consumer", lambda *a, **k: NoBroker())
    monkeypatch.setattr(sd.ShardedLearner, "run", run)
    with StopsTaken(None) as stops:  # as streamrec train's: the signals the learner took are put back at its end
        return sd._train(KafkaSettings(bootstrap_servers="127.0.0.1:9"), LearnerSettings(checkpoint_dir=ckpt),
                         RankContext(), None, DEFAULT_LIMITS, stops)


@pytest.mark.usefixtures("one_rank_group")
def test_a_sharded_job_on_a_directory_a_learner_holds_stops_naming_the_holder_before_reading_a_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import learner.sharded_daemon as sd

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    fd = os.open(ckpt / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)  # what the running learner (or job's rank 0) holds
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, b"4242\n")
    try:
        with pytest.raises(ConfigError, match=rf"{ckpt}.*in use by another learner \(pid 4242,"):
            train(monkeypatch, ckpt, sd.ShardedLearner._restore)  # the run's first checkpoint read
    finally:
        os.close(fd)


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("ends", ["returns", "raises"])
def test_a_sharded_jobs_rank_0_holds_the_directory_while_it_trains_and_gives_it_back_however_it_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ends: str) -> None:
    ckpt = tmp_path / "ckpt"
    seen: list[str] = []

    def run(self: Any) -> dict[str, Any]:
        with pytest.raises(ConfigError, match=rf"in use by another learner \(pid {os.getpid()},") as refused:
            checkpoint.hold_directory(ckpt)  # a single-process learner started meanwhile
        seen.append(str(refused.value))
        if ends == "raises":
            raise RuntimeError("a rank failed")
        return {"reason": "done"}

    if ends == "raises":
        with pytest.raises(RuntimeError, match="a rank failed"):
            train(monkeypatch, ckpt, run)
    else:
        assert train(monkeypatch, ckpt, run) == {"reason": "done"}
    assert len(seen) == 1  # held while it ran
    checkpoint.release_directory(checkpoint.hold_directory(ckpt))  # and free once it ended


@pytest.mark.usefixtures("one_rank_group")
def test_a_lock_file_rank_0_cannot_open_stops_every_rank_with_a_config_error_naming_it(tmp_path: Path) -> None:
    """Not rank 0 alone raising past the broadcast, the other ranks left waiting in it."""
    from learner.rank_checks import hold_checkpoint_dir

    (tmp_path / "LOCK").mkdir()
    with pytest.raises(ConfigError, match=rf"{tmp_path}: cannot open its LOCK \(.*directory"):
        hold_checkpoint_dir(LearnerSettings(checkpoint_dir=tmp_path), 0)
