"""The learner's lag, ``streamrec_learner_lag_samples{partition}``: samples-topic messages not trained yet, per
partition the process reads, from the next message it trains to the partition's end; in one process and on each
rank of the sharded learner (its own partitions, ``p % N``: two ranks' series never share a label)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaException
from prometheus_client import REGISTRY

from learner.config import LearnerSettings
from learner.lag import LAG, partition_lag, publish_lag
from stream.config import KafkaSettings


class Watermarks:
    """A consumer fake: the samples topic's partitions and their (first record held, end) offsets."""

    def __init__(self, topic: str, marks: dict[int, tuple[int, int]]) -> None:
        self.topic, self.marks, self.committed = topic, marks, []

    def list_topics(self, topic: str, timeout: float = -1) -> Any:
        return SimpleNamespace(topics={topic: SimpleNamespace(partitions={p: None for p in self.marks})})

    def get_watermark_offsets(self, tp: Any, timeout: float = -1, cached: bool = False) -> tuple[int, int]:
        return self.marks[tp.partition]

    def commit(self, offsets: Any = None, asynchronous: bool = True) -> None:
        self.committed.append(offsets)

    def close(self) -> None:
        pass


def lag_series() -> dict[str, float]:
    return {s.labels["partition"]: s.value for m in REGISTRY.collect() if m.name == "streamrec_learner_lag_samples"
            for s in m.samples}


@pytest.fixture(autouse=True)
def _no_lag_series_left() -> Iterator[None]:
    LAG.clear()
    yield
    LAG.clear()


def test_a_partition_counts_from_its_next_message_to_train_or_its_first_record_held_to_its_end() -> None:
    assert partition_lag(5, 0, 8) == 3
    assert partition_lag(None, 3, 10) == 7  # nothing trained, no saved offset: read from its first record held
    assert partition_lag(0, 3, 10) == 7  # records 0-2 taken by retention are never trained
    assert partition_lag(8, 0, 8) == 0 and partition_lag(None, 0, 0) == 0
    assert partition_lag(12, 0, 8) == 0  # a topic made again: the reader starts it over, never a negative lag


def test_each_rank_reports_only_its_own_partitions_so_two_ranks_series_never_share_a_label() -> None:
    consumer = Watermarks("samples", {p: (0, 10) for p in range(5)})
    publish_lag(consumer, "samples", {0: 4, 1: 6, 3: 9}, shard=(1, 2))
    assert lag_series() == {"1": 4.0, "3": 1.0}  # partitions 1 and 3 of 0-4 are rank 1's of 2
    publish_lag(consumer, "samples", {0: 4, 1: 6, 3: 9}, shard=(0, 2))
    assert lag_series() == {"0": 6.0, "1": 4.0, "2": 10.0, "3": 1.0, "4": 10.0}


def test_a_broker_that_does_not_list_the_topic_is_asked_nothing_more_and_a_learner_with_no_partitions_nothing() -> None:
    class Away(Watermarks):
        def list_topics(self, topic: str, timeout: float = -1) -> Any:
            raise KafkaException("broker away")

        def get_watermark_offsets(self, tp: Any, timeout: float = -1, cached: bool = False) -> tuple[int, int]:
            raise AssertionError("asked a broker that did not answer")

    publish_lag(Away("samples", {}), "samples", {p: 0 for p in range(64)})  # one timeout, not 64
    publish_lag(Away("samples", {}), "samples", {})  # save() outside run(): no partitions listed
    assert lag_series() == {}


def test_a_dataloader_workers_death_raised_during_a_watermark_request_is_not_taken_for_a_broker_error() -> None:
    """torch raises a DataLoader worker's death once, from its SIGCHLD handler, wherever the training process is:
    here returning from a watermark request. Skipped as "lag is best effort", it was never raised again and the dead
    worker's partitions stalled for good (its peers' idle batches kept the loader going)."""
    class WorkerDied(Watermarks):
        def get_watermark_offsets(self, tp: Any, timeout: float = -1, cached: bool = False) -> tuple[int, int]:
            raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. ")

    with pytest.raises(RuntimeError, match="DataLoader worker"):
        publish_lag(WorkerDied("samples", {0: (0, 5)}), "samples", {0: 1})


def test_a_partition_with_a_backlog_and_nothing_trained_reports_its_lag(tmp_path: Path) -> None:
    """Partition 1 was added to the samples topic while the learner reads (it reads it without a restart) and holds
    records 3-9, none trained yet: it had no lag series until its first batch trained, so a learner stuck on it showed
    no lag. Partition 0: 5 of its 8 trained."""
    from learner.daemon import Learner

    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9")
    learner = Learner(kafka, LearnerSettings(checkpoint_dir=tmp_path / "ckpt"))
    try:
        learner._group.close()
        learner._group = Watermarks(kafka.samples_topic, {0: (0, 8), 1: (3, 10)})  # type: ignore[assignment]
        learner.offsets = {0: 5}
        learner._update_lag()
    finally:
        learner.close()
    assert lag_series() == {"0": 3.0, "1": 7.0}



def test_the_sharded_learner_reports_the_lag_of_its_partitions_those_added_and_untrained_too(
        one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun no partition reported lag: the sharded daemon never set the gauge, so learner_lag and the
    dashboard's lag panel were blind. Through its run: partition 0's message at offset 5 trained (records 0-8), and
    partition 1 (records 2-6) added to the topic after the start, nothing of it trained."""
    import numpy as np
    import torch

    import learner.sharded_daemon as sd
    from learner.batch import to_tensors
    from learner.distributed import RankContext
    from learner.features import default_config
    from tests.integration.test_learner import sample_batch

    ls = LearnerSettings(checkpoint_dir=tmp_path / "ckpt", mlp="8", buckets=16, ctx_buckets=8, embedding_dim=4)
    cfg = default_config({"genres": "multi"}, buckets=16, ctx_buckets=8, embedding_dim=4)
    batch = to_tensors(sample_batch(np.random.default_rng(0), 4), cfg, [(0, 5, 4)])

    class Dataset(torch.utils.data.IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield batch

    monkeypatch.setattr(sd, "KafkaSampleDataset", lambda *a, **k: Dataset())
    monkeypatch.setattr(sd.ShardedLearner, "_partitions", lambda self: [0])  # the topic at the start
    monkeypatch.setattr(sd.ShardedLearner, "_fresh_config", lambda self: cfg)
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9")
    learner = sd.ShardedLearner(kafka, ls, RankContext())
    try:
        assert learner._group is not None
        learner._group.close()
        learner._group = Watermarks(kafka.samples_topic, {0: (0, 9), 1: (2, 7)})  # type: ignore[assignment]
        assert learner.run()["offsets"] == {"0": 6}
    finally:
        learner.close()
    assert lag_series() == {"0": 3.0, "1": 5.0}
