"""The rows ``DeltaWriter.hold`` keeps back (given to another id; they wait for the delta with the id maps) are not
checkpointed: a restart knows them only as rows of the pending list. That is safe only because the first delta after
any restart carries the maps: checked here on the single-process daemon's restart paths (the newest checkpoint, and
a fallback past a damaged newest one). The sharded writer's restart is checked in test_distributed.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from learner import checkpoint as ck
from learner.batch import to_tensors
from learner.config import Device, LearnerSettings
from learner.daemon import Learner
from learner.deltas import list_deltas, load_delta
from stream.config import KafkaSettings
from tests.unit.learner.test_safe_loads import CFG, B, samples


@pytest.mark.parametrize("path", ["newest", "fallback"])
def test_the_first_delta_after_a_restart_carries_the_id_maps_and_the_rows_held_before_it(
        tmp_path: Path, path: str) -> None:
    ls = LearnerSettings(checkpoint_dir=tmp_path / "ck", mlp=(8,), buckets=B, ctx_buckets=5, embedding_dim=4,
                         id_capacity=40, admit_after=1, device=Device.CPU, amp=False, deltas_every_s=3600.0,
                         deltas_dir=tmp_path / "deltas")  # (no delta falls due while it trains)
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9")  # never contacted
    first = Learner(kafka, ls)
    try:
        first._build(CFG, first._model_settings())
        rng = np.random.default_rng(3)
        first._train(to_tensors(samples(rng, 32), CFG))
        first.save()
        first._train(to_tensors(samples(rng, 32, start=32), CFG))
        first.save()  # (the pending list made durable)
        assert first.deltas is not None
        held = first.deltas.held.nonzero().squeeze(1).tolist()
        assert held  # ids were admitted: their rows wait for the maps; the process stops before that delta
    finally:
        first.close()
    assert list_deltas(tmp_path / "deltas") == []
    if path == "fallback":
        older, newest = ck.list_checkpoints(tmp_path / "ck")
        raw = ck.load(newest)
        raw["model"][next(iter(raw["model"]))] = torch.zeros(3, 3)  # CRCs match, the content does not fit
        newest.unlink()
        torch.save(raw, newest)

    second = Learner(kafka, ls)
    try:
        assert second._restore() and second.trainer is not None and second.deltas is not None
        assert second.trainer.samples == (32 if path == "fallback" else 64)
        assert second.deltas.write(second.trainer.model, second.trainer.samples) is not None
        [(_, _, written)] = list_deltas(tmp_path / "deltas")
        delta = load_delta(written)
        assert delta.id_maps is not None  # the maps say whose the held rows are now
        assert set(held) <= set(delta.rows.tolist())
    finally:
        second.close()
