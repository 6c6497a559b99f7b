"""Trainer.test_then_train on the batches a fine-tuning step can be handed at the edges: empty, one class."""

from __future__ import annotations

import numpy as np
import torch

from learner.batch import to_tensors
from learner.features import FeatureConfig, FieldSpec
from learner.model import DeepFM
from learner.optim import make_optimizers
from learner.trainer import Trainer
from stream.samples import SampleBatch

CFG = FeatureConfig((FieldSpec("user_id", "single", 50), FieldSpec("item_id", "single", 40)), embedding_dim=4)


def _batch(n: int, label: int | None = None) -> SampleBatch:
    rng = np.random.default_rng(n)
    return SampleBatch.from_columns(
        impression_id=[f"i{k}" for k in range(n)], ts=np.full(n, 1_700_000_000_000),
        label=rng.integers(0, 2, n) if label is None else np.full(n, label), label_delay_ms=np.zeros(n),
        user_id=rng.integers(0, 50, n), item_id=rng.integers(0, 40, n), history=[[]] * n)


def _trainer() -> Trainer:
    model = DeepFM(CFG, mlp=(8,), seed=0, autocast_dtype=None)
    sparse, dense = make_optimizers(model, 0.05, 0.01, boost=2.0, boost_half_life=4.0)
    return Trainer(model, sparse, dense)


def test_an_empty_batch_is_no_step_and_no_nan_loss() -> None:
    # the mean loss of no sample is NaN: an empty batch was counted as a poison batch (nan_losses, which the monitor
    # alerts on) though nothing was wrong with it
    t = _trainer()
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    probs = t.test_then_train(to_tensors(_batch(0), CFG))
    assert probs.shape == (0,) and t.nan_losses == 0 and t.samples == 0
    assert all(torch.equal(v, before[k]) for k, v in t.model.state_dict().items())
    t.test_then_train(to_tensors(_batch(32), CFG))  # and the next real batch trains as ever
    assert t.samples == 32 and t.nan_losses == 0 and np.isfinite(t.last_loss)


def test_a_batch_of_one_class_trains_with_a_finite_loss() -> None:
    t = _trainer()
    for label in (1, 0):
        t.test_then_train(to_tensors(_batch(16, label), CFG))
        assert t.nan_losses == 0 and np.isfinite(t.last_loss)
    assert all(bool(torch.isfinite(v).all()) for v in t.model.state_dict().values() if v.is_floating_point())
