"""The checkpoint at exit failing (a full disk): the learner stops with an error, commits no group offset past its
last durable checkpoint, and a restart trains exactly what that checkpoint had not (README "Runs": "the one at exit
must succeed (else exit 1 ...)")."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition

from learner import checkpoint
from learner.config import LearnerSettings
from learner.daemon import Learner
from stream.config import KafkaSettings
from stream.kafka import ensure_topics
from tests.integration.test_learner import produce_samples


def test_a_full_disk_at_the_exit_checkpoint_stops_with_its_error_commits_nothing_past_the_last_durable_one(
        kafka: KafkaSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ensure_topics(kafka, [kafka.samples_topic], partitions=4)
    produced = produce_samples(kafka, 16, 50, 0.0)  # 800 rows, 4 partitions
    ls = LearnerSettings(checkpoint_dir=tmp_path / "ckpt", mlp="16", buckets=500, ctx_buckets=50, embedding_dim=4,
                         group_id=f"g-{kafka.samples_topic}", batch_rows=50, checkpoint_every_samples=300,
                         exit_when_idle_s=2.0)
    real_save, saves = checkpoint.save, []

    def first_only(directory: Path, state: dict, meta: dict, keep: int = 3) -> Path:
        saves.append(meta["samples_trained"])
        if len(saves) > 1:  # the disk fills after the first periodic checkpoint
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(directory, state, meta, keep=keep)

    learner = Learner(kafka, ls)
    try:
        with monkeypatch.context() as m:
            m.setattr(checkpoint, "save", first_only)
            with pytest.raises(OSError, match="No space"):
                learner.run()  # the periodic failures survived, the one at exit raised (exit 1 at the CLI)
        committed = {tp.partition: tp.offset for tp in learner._group.committed(
            [TopicPartition(kafka.samples_topic, p) for p in range(4)], timeout=10)}
    finally:
        learner.close()
    assert len(saves) >= 2 and learner.trainer is not None and learner.trainer.samples == sum(produced.values())
    durable = checkpoint.load_latest(ls.checkpoint_dir)
    assert durable is not None and durable.samples_trained == saves[0] < sum(produced.values())
    assert {p: o for p, o in committed.items() if o >= 0} == durable.offsets  # nothing past it
    again = Learner(kafka, ls)
    try:
        summary = again.run()
    finally:
        again.close()
    # the restart trains what the durable checkpoint had not, once: every row trained once in all
    assert summary["samples_trained"] == sum(produced.values())
    assert {int(p): n for p, n in summary["partition_rows"].items()} == produced
