"""The checkpoint at exit failing (a full disk): the learner stops with an error, commits no group offset past its
last durable checkpoint, and a restart trains exactly what that checkpoint had not (README "Runs": "the one at exit
must succeed (else exit 1 ...)"); ``streamrec train`` says so in one line naming the path and the errno."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from learner import checkpoint
from learner.config import LearnerSettings
from learner.daemon import Learner
from stream.config import KafkaSettings
from stream.kafka_topics import ensure_topics
from streamrec.cli import main
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
            with pytest.raises(checkpoint.ExitCheckpointFailed, match=r"\[errno ENOSPC\]") as failed:
                learner.run()  # the periodic failures survived, the one at exit raised (exit 1 at the CLI)
        committed = {tp.partition: tp.offset for tp in learner._group.committed(
            [TopicPartition(kafka.samples_topic, p) for p in range(4)], timeout=10)}
    finally:
        learner.close()
    assert str(ls.checkpoint_dir) in str(failed.value) and isinstance(failed.value.__cause__, OSError)
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


def _small_run_with_a_full_disk(kafka: KafkaSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                ) -> tuple[Path, Path]:
    """Samples to train, a small learner's config file, and every checkpoint save failing with ENOSPC: the
    checkpoint directory and the config file."""
    ensure_topics(kafka, [kafka.samples_topic], partitions=4)
    produce_samples(kafka, 4, 20, 0.0)
    ckpt = tmp_path / "ckpt"
    cfg = tmp_path / "train.toml"
    cfg.write_text(f'[kafka]\nbootstrap_servers = "{kafka.bootstrap_servers}"\n'
                   f'samples_topic = "{kafka.samples_topic}"\n'
                   f'[learner]\ncheckpoint_dir = "{ckpt}"\nmlp = "16"\nbuckets = 500\nctx_buckets = 50\n'
                   f'embedding_dim = 4\ngroup_id = "g-{kafka.samples_topic}"\nbatch_rows = 20\n')

    def full_disk(directory: Path, state: dict, meta: dict, keep: int = 3) -> Path:
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / "ckpt-x.pt"))

    monkeypatch.setattr(checkpoint, "save", full_disk)
    return ckpt, cfg


@pytest.mark.usefixtures("environ_restored")  # the command sets MALLOC_* for its children
def test_a_full_disk_at_the_exit_checkpoint_is_one_line_naming_the_path_and_errno_from_streamrec_train(
        kafka: KafkaSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> None:
    """The OSError of the exit checkpoint (ENOSPC) left ``streamrec train`` as a Python traceback; it is now one
    ``streamrec train: error:`` line naming the checkpoint directory and the errno, exit 1."""
    ckpt, cfg = _small_run_with_a_full_disk(kafka, tmp_path, monkeypatch)
    rc = main(["train", "--config", str(cfg), "--exit-when-idle", "2"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "Traceback" not in err, err
    line = next(ln for ln in err.splitlines() if ln.startswith("streamrec train: error:"))
    assert str(ckpt) in line and "[errno ENOSPC]" in line and "the file system is full" in line, line


@pytest.mark.usefixtures("environ_restored")  # the command sets MALLOC_* for its children
def test_a_learner_close_that_fails_after_the_exit_checkpoint_failed_does_not_hide_the_checkpoints_error(
        kafka: KafkaSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """``streamrec train`` closed the learner in a ``finally:``: a close that failed too (its consumer's) replaced the
    run's error, and the one line printed named the close, not the full disk. Now the close's failure is logged and
    the line names the cause."""
    ckpt, cfg = _small_run_with_a_full_disk(kafka, tmp_path, monkeypatch)
    close = Learner.close

    def close_fails(self: Learner) -> None:
        close(self)
        raise KafkaException(KafkaError(KafkaError._FAIL, "the close failed"))

    monkeypatch.setattr(Learner, "close", close_fails)
    rc = main(["train", "--config", str(cfg), "--exit-when-idle", "2"])
    err = capsys.readouterr().err
    assert rc == 1, err
    line = next(ln for ln in err.splitlines() if ln.startswith("streamrec train: error:"))
    assert str(ckpt) in line and "[errno ENOSPC]" in line and "the close failed" not in line, line
    assert "closing the learner after the error below failed too" in caplog.text
