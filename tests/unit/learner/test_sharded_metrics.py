"""The single-process daemon's metrics that the sharded learner exports too (README, "Running on N ranks"), through
the sharded daemon's run on one gloo rank with a dataset fake: each rank's own events on its own ``/metrics``
(summed over the ranks, the job's), and the job's decisions every rank makes alike on rank 0 only (counted once)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from confluent_kafka import KafkaException
from prometheus_client import REGISTRY

from learner.batch import TensorBatch, to_tensors
from learner.config import LearnerSettings
from learner.distributed import RankContext
from learner.features import default_config
from stream.config import KafkaSettings
from tests.integration.test_learner import sample_batch

CFG = default_config({"genres": "multi"}, buckets=16, ctx_buckets=8, embedding_dim=4)



def value(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


class NoBroker:
    """The rank's consumer (commits, lag: tests/unit/learner/test_lag.py) without a broker to wait for."""

    def commit(self, offsets: Any = None, asynchronous: bool = True) -> None:
        pass

    def list_topics(self, topic: str, timeout: float = -1) -> Any:
        raise KafkaException("no broker in this test")

    def close(self) -> None:
        pass


def run_sharded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batches: list[TensorBatch],
                **settings: Any) -> dict[str, Any]:
    """One rank's run of the sharded daemon over ``batches`` (partition 0 of the topic), its summary."""
    import learner.sharded_daemon as sd

    class Dataset(torch.utils.data.IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from batches

    monkeypatch.setattr(sd, "KafkaSampleDataset", lambda *a, **k: Dataset())
    monkeypatch.setattr(sd.ShardedLearner, "_partitions", lambda self: [0])
    monkeypatch.setattr(sd.ShardedLearner, "_fresh_config", lambda self: CFG)
    monkeypatch.setattr(sd, "new_consumer", lambda *a, **k: NoBroker())
    ls = LearnerSettings(checkpoint_dir=tmp_path / "ckpt", mlp="8", buckets=16, ctx_buckets=8, embedding_dim=4,
                         **settings)
    learner = sd.ShardedLearner(KafkaSettings(bootstrap_servers="127.0.0.1:9"), ls, RankContext())
    try:
        return learner.run()
    finally:
        learner.close()


def counted(names: list[str], run: Callable[[], Any]) -> list[float]:
    before = [value(n) for n in names]
    run()
    return [value(n) - b for n, b in zip(names, before, strict=True)]


def test_the_sharded_learner_counts_the_duplicate_samples_it_drops(
        one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same 4 samples in two messages (a joiner's retry): the second's 4 rows are dropped, and the duplicates
    alert rule and panel read streamrec_learner_duplicates_total, which the sharded daemon never counted."""
    sb = sample_batch(np.random.default_rng(0), 4)
    batches = [to_tensors(sb, CFG, [(0, 5, 4)]), to_tensors(sb, CFG, [(0, 6, 4)])]
    summaries: list[dict[str, Any]] = []
    got = counted(["streamrec_learner_duplicates_total"],
                  lambda: summaries.append(run_sharded(tmp_path, monkeypatch, batches)))
    assert got == [4.0] and summaries[0]["duplicates_dropped"] == 4


def test_the_sharded_learner_counts_its_skipped_and_clipped_steps_once_on_rank_0(
        one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank skips a step whose loss is not finite on some rank and clips the same all-reduced dense gradient
    (learner/sharded_trainer.py): the nan_losses and dense_clipped alert rules read the single process's counters,
    which the sharded daemon never incremented. Here every step is counted as one of each by the trainer."""
    from learner.sharded_trainer import ShardedTrainer

    step = ShardedTrainer.test_then_train

    def counting(self: ShardedTrainer, batch: TensorBatch, rows: int) -> np.ndarray:
        self.nan_losses += 1
        self.dense_clip.clipped += 1
        return step(self, batch, rows)

    monkeypatch.setattr(ShardedTrainer, "test_then_train", counting)
    batches = [to_tensors(sample_batch(np.random.default_rng(k), 4, start=4 * k), CFG, [(0, k, 4)]) for k in range(3)]
    got = counted(["streamrec_learner_nan_losses_total", "streamrec_learner_dense_clipped_steps_total"],
                  lambda: run_sharded(tmp_path, monkeypatch, batches, step_rows=2))
    assert got == [6.0, 6.0]  # 3 rounds of 2 steps of 2 rows


def test_the_sharded_learner_says_how_long_its_last_checkpoint_took(
        one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """streamrec_learner_checkpoint_seconds (the dashboard's checkpoint panel) was set by one process only."""
    from learner.daemon import CHECKPOINT_S

    CHECKPOINT_S.set(-1.0)  # no value of this run
    run_sharded(tmp_path, monkeypatch, [to_tensors(sample_batch(np.random.default_rng(0), 4), CFG, [(0, 0, 4)])])
    assert value("streamrec_learner_checkpoint_seconds") > 0


def test_the_sharded_learner_publishes_the_event_time_and_positive_rate_of_every_ranks_samples_on_rank_0(
        one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """streamrec_learner_event_time_seconds and streamrec_learner_window_positive_rate (panels; the positive-rate
    alert rules) were the single process's only. Rank 0 gathers every rank's rows each round (quality metrics): the
    newest event time (as its event clock takes it) and the share of positives among the last metrics_window."""
    from learner.daemon import EVENT_TIME, POSITIVE_RATE

    EVENT_TIME.set(-1.0)
    POSITIVE_RATE.set(-1.0)
    t0 = 1_700_000_000_000  # ms
    sbs = [sample_batch(np.random.default_rng(k), 4, start=t0 + 4 * k) for k in range(3)]
    run_sharded(tmp_path, monkeypatch, [to_tensors(sb, CFG, [(0, k, 4)]) for k, sb in enumerate(sbs)],
                metrics_window=8)
    assert abs(value("streamrec_learner_event_time_seconds") - (t0 + 11) / 1000) < 0.01
    last_8 = np.concatenate([sb.column("label") for sb in sbs[1:]])
    assert value("streamrec_learner_window_positive_rate") == pytest.approx(float((last_8 > 0.5).mean()))


def test_each_rank_of_the_sharded_learner_publishes_its_memory(
        one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """streamrec_learner_rss_bytes and ..._memory_growth_bytes_per_hour (panels; the memory_growth alert rule) were
    the single process's only: every rank holds its own share of the table, and its own memory may grow."""
    from learner.daemon import MEMORY_GROWTH, RSS

    RSS.set(-1.0)
    MEMORY_GROWTH.clear()
    run_sharded(tmp_path, monkeypatch, [to_tensors(sample_batch(np.random.default_rng(0), 4), CFG, [(0, 0, 4)])])
    assert value("streamrec_learner_rss_bytes") > 0
    growth = REGISTRY.get_sample_value("streamrec_learner_memory_growth_bytes_per_hour", {"memory": "rss"})
    assert growth is not None and np.isnan(growth)  # NaN for the first 5 minutes, as in one process


def test_a_sharded_periodic_checkpoint_on_a_full_disk_is_counted_and_retried_while_training_goes_on(
        one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One process survives a periodic checkpoint that cannot be written (``Learner._try_save``): logged, counted in
    streamrec_learner_checkpoint_failures_total, retried at the next interval. The sharded learner stopped: DCP's
    write on a full disk raised torch's CheckpointException (a BaseException, wrapping the zip writer's RuntimeError,
    not the write's OSError) out of run(). Here the disk is full for the first checkpoint's first DCP write only."""
    import errno
    from contextlib import contextmanager

    from torch.distributed.checkpoint.filesystem import FileSystem

    from learner import sharded_checkpoint

    real = FileSystem.create_stream
    full = {"writes": 1}

    class FullDisk:
        def __init__(self, fh: Any) -> None:
            self.fh = fh

        def write(self, data: Any) -> int:
            if full["writes"] > 0:
                full["writes"] -= 1
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.fh.write(data)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.fh, name)

    @contextmanager
    def create_stream(self: FileSystem, path: Any, mode: str) -> Iterator[Any]:
        with real(self, path, mode) as fh:
            yield FullDisk(fh) if "w" in mode else fh

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    batches = [to_tensors(sample_batch(np.random.default_rng(k), 4, start=4 * k), CFG, [(0, k, 4)]) for k in range(3)]
    summaries: list[dict[str, Any]] = []
    got = counted(["streamrec_learner_checkpoint_failures_total"],
                  lambda: summaries.append(run_sharded(tmp_path, monkeypatch, batches, checkpoint_every_samples=4)))
    assert got == [1.0] and summaries[0]["samples_trained"] == 12
    found = sharded_checkpoint.latest(tmp_path / "ckpt")
    assert found is not None and found[1]["samples_trained"] == 12 and found[1]["offsets"] == {"0": 3}
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))  # the failed one's part is not left behind


def test_a_sharded_rank_other_than_0_exports_no_positive_rate_or_event_time_that_fires_an_alert(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 alone sets streamrec_learner_window_positive_rate and ..._event_time_seconds, but every rank serves
    its /metrics and the README says to scrape every rank: rank 1 exported both gauges' initial 0, a positive rate of
    0 on which the critical one_class_labels rule (abs(rate - 0.5) >= 0.5) fires, and an event time of 1970. The other
    ranks now export NaN (no value: a rule never fires on it, a panel shows a gap)."""
    import math

    import learner.sharded_daemon as sd
    from learner.daemon import EVENT_TIME, POSITIVE_RATE

    EVENT_TIME.set(0.0)  # a fresh process's values
    POSITIVE_RATE.set(0.0)
    monkeypatch.setattr(sd, "new_consumer", lambda *a, **k: NoBroker())
    ls = LearnerSettings(checkpoint_dir=tmp_path / "ckpt", mlp="8", buckets=16, ctx_buckets=8, embedding_dim=4)
    learner = sd.ShardedLearner(KafkaSettings(bootstrap_servers="127.0.0.1:9"), ls, RankContext(rank=1, world_size=2))
    learner.close()
    assert math.isnan(value("streamrec_learner_window_positive_rate"))
    assert math.isnan(value("streamrec_learner_event_time_seconds"))
