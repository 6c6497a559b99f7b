"""A samples partition whose offsets start over (the topic deleted and created again under a running or restarted
learner: the reader goes on from the new partition's first record, ``learner/kafka_dataset.py``): the offsets a
checkpoint records are those of what the model holds, so they follow the new partition down."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from learner.batch import to_tensors
from learner.config import Device, LearnerSettings
from learner.daemon import Learner
from stream.config import KafkaSettings
from tests.unit.learner.test_safe_loads import CFG, B, samples


def test_the_checkpoint_records_the_new_partitions_offsets_after_its_offsets_started_over(tmp_path: Path) -> None:
    """Five messages trained, the topic made again, its first two messages trained: the checkpoint said offset 5,
    so a restart read on from the new topic's offset 5, and its messages 2-4 were never trained (or, where the
    broker reset the read to the start, messages 0-1 were trained again after every restart)."""
    ls = LearnerSettings(checkpoint_dir=tmp_path / "ck", mlp=(8,), buckets=B, ctx_buckets=5, embedding_dim=4,
                         id_capacity=40, admit_after=1, device=Device.CPU, amp=False, deltas_every_s=0.0)
    learner = Learner(KafkaSettings(bootstrap_servers="127.0.0.1:9"), ls)  # never contacted
    try:
        learner._build(CFG, learner._model_settings())
        rng = np.random.default_rng(5)
        for k in range(5):
            learner._train(to_tensors(samples(rng, 4, start=4 * k), CFG, [(0, k, 4)]))
        assert learner.offsets == {0: 5}
        learner._train(to_tensors(samples(rng, 8, start=100), CFG, [(0, 0, 4), (0, 1, 4)]))  # the new topic's
        assert learner.offsets == {0: 2}  # what the next checkpoint records (meta "offsets")
    finally:
        learner.close()
