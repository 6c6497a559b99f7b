"""Test-then-train with dropout: the predictions it records and returns (progressive and served metrics, the
calibration's fit) are the model's as serving scores it (eval mode, no dropout), not one dropout draw."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from learner.batch import to_tensors
from learner.calibration import OnlineCalibration
from learner.features import FeatureConfig, FieldSpec
from learner.model import DeepFM
from learner.optim import make_optimizers
from learner.trainer import Trainer
from stream.samples import OBSERVED, SampleBatch

CFG = FeatureConfig((FieldSpec("user_id", "single", 50), FieldSpec("item_id", "single", 40)), embedding_dim=4)


def _batch(n: int, seed: int) -> SampleBatch:
    rng = np.random.default_rng(seed)
    return SampleBatch.from_columns(
        impression_id=[f"i{seed}-{k}" for k in range(n)], ts=np.full(n, 1_700_000_000_000),
        label=rng.integers(0, 2, n), label_delay_ms=np.zeros(n), kind=np.full(n, OBSERVED),
        user_id=rng.integers(0, 50, n), item_id=rng.integers(0, 40, n), history=[[]] * n)


def _trainer(dropout: float, calibration: OnlineCalibration | None = None) -> Trainer:
    model = DeepFM(CFG, mlp=(32, 32), dropout=dropout, seed=0, autocast_dtype=None)
    sparse, dense = make_optimizers(model, 0.05, 0.01)
    return Trainer(model, sparse, dense, calibration=calibration)


def test_with_dropout_test_then_train_records_the_predictions_serving_makes_not_a_dropout_draw() -> None:
    t = _trainer(0.5)
    for seed in range(3):  # a fresh model and one that has trained
        tb = to_tensors(_batch(64, seed), CFG)
        served = t.predict(tb)  # eval mode: what the artifact scores
        got = t.test_then_train(tb)
        np.testing.assert_allclose(got, served, rtol=0, atol=1e-6)
        np.testing.assert_allclose(t.metrics._window_arrays()[0][-64:], served, rtol=0, atol=1e-6)
    # and training still draws its dropout
    assert all(m.training for m in t.model.modules() if isinstance(m, nn.Dropout))


def test_with_dropout_the_calibration_fits_the_logits_serving_computes() -> None:
    seen: list[np.ndarray] = []

    class Spy(OnlineCalibration):
        def observe(self, ids, kinds, labels, logits, ts_ms, label_delay_ms) -> None:  # type: ignore[no-untyped-def]
            seen.append(np.asarray(logits))

    t = _trainer(0.5, Spy())
    tb = to_tensors(_batch(64, 7), CFG)
    t.model.eval()  # the calibration buffer is still the identity (1, 0): eval mode's logits are the raw ones
    with torch.no_grad():
        expected = t.model(tb.values, tb.offsets, tb.dense).numpy()
    t.test_then_train(tb)
    np.testing.assert_allclose(seen[0], expected, rtol=0, atol=1e-5)


def test_with_dropout_the_sharded_trainer_records_the_predictions_of_its_model_without_dropout(
        one_rank_group: None) -> None:
    from learner.progressive import ProgressiveMetrics
    from learner.sharded_model import ShardedDeepFM, feature_names, padded_inputs, shard
    from learner.sharded_trainer import ShardedTrainer

    model = ShardedDeepFM(CFG, (32, 32), 0.5, 1, None, table_device=torch.device("meta"))
    dmp = shard(model, 1, torch.device("cpu"), 0.05, 1e-8, 0.0, seed=1)
    opt = torch.optim.Adam([p for n, p in model.named_parameters() if not n.startswith("sparse.")], lr=1e-2)
    trainer = ShardedTrainer(dmp, opt, feature_names(CFG), torch.device("cpu"), ProgressiveMetrics())
    for seed in range(2):
        tb = to_tensors(_batch(64, seed), CFG)
        kjt, dense, _, _ = padded_inputs(tb, len(tb), feature_names(CFG), torch.device("cpu"))
        dmp.eval()  # serving's mode: no dropout
        with torch.no_grad():
            served = torch.sigmoid(dmp(kjt, dense)).numpy()
        got = trainer.test_then_train(tb, len(tb))
        np.testing.assert_allclose(got, served, rtol=0, atol=1e-6)
        np.testing.assert_allclose(trainer.last_logits, np.log(served / (1 - served)), rtol=0, atol=1e-4)
    assert all(m.training for m in dmp.modules() if isinstance(m, nn.Dropout))
