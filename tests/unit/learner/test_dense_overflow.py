"""No optimizer state of the learner can become non-finite from one batch of huge dense values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.batch import to_tensors
from learner.features import FeatureConfig, FieldSpec
from learner.model import DeepFM
from learner.optim import make_optimizers
from learner.trainer import Trainer
from stream.errors import BadMessage
from stream.samples import SampleBatch

CFG = FeatureConfig((FieldSpec("user_id", "single", 50), FieldSpec("item_id", "single", 40)), dense=("price",),
                    embedding_dim=4)


def _batch(price: float) -> SampleBatch:
    n = 8
    return SampleBatch.from_columns(
        impression_id=[f"i{k}" for k in range(n)], ts=np.full(n, 1_700_000_000_000), label=np.arange(n) % 2,
        label_delay_ms=np.zeros(n), user_id=np.arange(n), item_id=np.arange(n), history=[[]] * n,
        dense={"price": np.r_[np.float32(price), -np.float32(price), np.ones(n - 2, np.float32)]})


def test_a_huge_dense_value_never_makes_adams_second_moment_infinite() -> None:
    """One batch with dense 3e38 (finite as float32, so the event decoder passes it) made Adam's exp_avg_sq inf for
    good: those weights never moved again. Here the batch bypasses SampleBatch.decode, which refuses it."""
    model = DeepFM(CFG, mlp=(8,), seed=0, autocast_dtype=None)
    sparse, dense = make_optimizers(model, 0.05, 0.01)
    trainer = Trainer(model, sparse, dense)
    trainer.test_then_train(to_tensors(_batch(3e38), CFG))
    for _ in range(3):
        trainer.test_then_train(to_tensors(_batch(1.0), CFG))
    states = [s["exp_avg_sq"] for s in dense.state.values() if "exp_avg_sq" in s]
    assert states and all(bool(torch.isfinite(s).all()) for s in states)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert trainer.overflow_steps == 1 and trainer.steps == 4  # the huge batch's dense update skipped, counted


@pytest.mark.parametrize("price", [1.9e19, 3e38, -1e30])
def test_decode_refuses_a_dense_value_whose_square_overflows_float32(price: float) -> None:
    with pytest.raises(BadMessage, match=r"column 'dense.price': \|value\| >= 2\*\*64") as e:
        SampleBatch.decode(_batch(price).encode())
    assert e.value.kind == "bad_value"
