"""One batch with an out-of-scale dense value must not freeze the dense part's learning (learner/grad_clip.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.batch import to_tensors
from learner.config import LearnerSettings
from learner.features import FeatureConfig, FieldSpec
from learner.grad_clip import AdaptiveClip
from learner.model import DeepFM
from learner.optim import make_optimizers
from learner.trainer import Trainer
from stream.config import ConfigError
from stream.samples import SampleBatch

CFG = FeatureConfig((FieldSpec("user_id", "single", 50), FieldSpec("item_id", "single", 40)), dense=("price",),
                    embedding_dim=4)


def _batch(seed: int, outlier: float | None = None) -> SampleBatch:
    rng = np.random.default_rng(seed)
    n = 64
    price = rng.normal(0.0, 1.0, n).astype(np.float32)
    users = rng.integers(0, 50, n)
    label = (price > 0).astype(np.int64) ^ (users % 3 == 0)
    if outlier is not None:  # twice, a click and not: one of them is on the wrong side of its huge logit
        price[:2], label[:2] = np.float32(outlier), (0, 1)
    return SampleBatch.from_columns(
        impression_id=[f"i{seed}-{k}" for k in range(n)], ts=np.full(n, 1_700_000_000_000),
        label=label, label_delay_ms=np.zeros(n), user_id=users,
        item_id=rng.integers(0, 40, n), history=[[]] * n, dense={"price": price})


def _trainer(clip: float) -> Trainer:
    model = DeepFM(CFG, mlp=(16,), seed=0, autocast_dtype=None)
    sparse, dense = make_optimizers(model, 0.05, 0.01)
    return Trainer(model, sparse, dense, dense_grad_clip=clip)


def _second_moments(t: Trainer) -> torch.Tensor:
    return torch.cat([t.dense_opt.state[p]["exp_avg_sq"].flatten().clone()
                      for g in t.dense_opt.param_groups for p in g["params"]])


@pytest.mark.parametrize("outlier", [1e18, -3e12, 1e6])
def test_one_out_of_scale_dense_value_moves_adams_second_moment_like_a_normal_batch(outlier: float) -> None:
    """Without the clip a price of 1e18 multiplied some dense weights' second moments by ~1e35; it decays by
    0.999 a step, so those weights learned at ~1e-17 of their rate for ~80 k steps, silently. Clipped, the total
    is bounded by the square of the threshold, and each weight's moment by far less than that freeze
    (458x at most here: the outlier's gradient concentrates on the weights of its column)."""
    t = _trainer(10.0)
    for i in range(60):
        t.test_then_train(to_tensors(_batch(i), CFG))
    v0, limit = _second_moments(t), t.dense_clip.threshold
    assert limit is not None and t.dense_clip.clipped == 0  # normal batches are left alone
    t.test_then_train(to_tensors(_batch(60, outlier), CFG))
    v1 = _second_moments(t)
    assert t.dense_clip.clipped == 1 and t.overflow_steps == 0
    assert float(v1.max()) <= max(float(v0.max()) * 1.5, limit**2)  # no more than a normal batch's square
    seen = v0 > 0  # (weights of units no row had activated have no scale to compare with; bounded above)
    assert float((v1[seen] / v0[seen]).max()) < 1e4


def test_off_leaves_the_outliers_square_in_adams_second_moment() -> None:
    """The same run with dense_grad_clip = 0: what the clip prevents (and that the test above could fail)."""
    t = _trainer(0.0)
    for i in range(60):
        t.test_then_train(to_tensors(_batch(i), CFG))
    v0 = _second_moments(t)
    t.test_then_train(to_tensors(_batch(60, 1e18), CFG))
    assert t.dense_clip.threshold is None and t.dense_clip.clipped == 0
    seen = v0 > 0
    assert float((_second_moments(t)[seen] / v0[seen]).max()) > 1e30


def test_the_threshold_is_factor_times_the_median_of_the_recorded_norms_after_clipping() -> None:
    clip = AdaptiveClip(factor=10.0, history=100, min_history=5)
    g = [torch.ones(4)]
    for _ in range(4):
        assert clip.clip_(g, 1.0) == 1.0 and clip.threshold is None  # still learning the scale
    for _ in range(25):
        clip.clip_(g, 1.0)
    assert clip.threshold == 10.0
    grads = [torch.full((4,), 2.0), torch.full((3,), 2.0)]  # total norm sqrt(7) * 2
    total = float(torch.linalg.vector_norm(torch.cat(grads)))
    scale = clip.clip_(grads, total * 1e6)  # told it is far above the threshold
    assert scale == pytest.approx(10.0 / (total * 1e6)) and clip.clipped == 1
    torch.testing.assert_close(grads[0], torch.full((4,), 2.0 * scale))
    for _ in range(24):  # now 30 norms of 1, 24 + 1 outliers recorded at the threshold: the median stays
        clip.clip_([torch.ones(1)], 1e9)
    assert clip.threshold == 10.0
    for _ in range(6):  # outliers the majority of the history: it grows by the factor, not to the outliers' 1e9
        clip.clip_([torch.ones(1)], 1e9)
    assert clip.threshold == 100.0


def test_its_state_round_trips_and_an_old_checkpoint_starts_empty() -> None:
    clip = AdaptiveClip(min_history=2)
    for x in (1.0, 2.0, 3.0):
        clip.clip_([torch.ones(1)], x)
    again = AdaptiveClip(min_history=2)
    again.load_state_dict(clip.state_dict())
    assert again.threshold == clip.threshold == 20.0
    again.load_state_dict(None)
    assert again.threshold is None and again.clipped == 0
    again.load_state_dict({"norms": [1.0, float("nan"), -1.0, float("inf"), 2.0]})  # damaged entries dropped
    assert again.threshold == 15.0


@pytest.mark.parametrize("clipped", [True, 2.5, "3", -1])
def test_a_clipped_count_that_is_no_integer_is_refused_at_load_naming_it(clipped: object) -> None:
    """``int()`` read a damaged checkpoint's ``true`` as 1 clip, ``2.5`` as 2 and ``"3"`` as 3."""
    with pytest.raises(ValueError, match=r"dense gradient clip state \(dense_clip\): .*clipped"):
        AdaptiveClip().load_state_dict({"norms": [1.0], "clipped": clipped})


@pytest.mark.parametrize("norms", ["1.0", ["1.0", 2.0], [1.0, True], {"a": 1.0}])
def test_norms_that_are_no_list_of_numbers_are_refused_at_load_naming_them(norms: object) -> None:
    """Text raised a bare TypeError from ``np.isfinite`` (no field named) and ``true`` was read as a norm of 1.0."""
    with pytest.raises(ValueError, match=r'dense gradient clip state \(dense_clip\): "norms" is'):
        AdaptiveClip().load_state_dict({"norms": norms, "clipped": 0})


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_the_setting_must_be_a_finite_number_at_least_zero(value: float) -> None:
    with pytest.raises(ConfigError, match=r"\[learner\] dense_grad_clip must be a finite number >= 0"):
        LearnerSettings(dense_grad_clip=value)
    assert LearnerSettings(dense_grad_clip=0).dense_grad_clip == 0
    with pytest.raises(ValueError, match="factor"):
        AdaptiveClip(value)


def test_the_history_is_the_last_norms_in_order_across_a_checkpoint() -> None:
    clip = AdaptiveClip(history=4, min_history=1)
    for x in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
        clip.clip_([torch.ones(1)], x)
    assert clip.state_dict()["norms"] == [3.0, 4.0, 5.0, 6.0]  # oldest first, the first two dropped
    again = AdaptiveClip(history=3, min_history=1)  # a shorter history keeps the newest
    again.load_state_dict(clip.state_dict())
    assert again.state_dict()["norms"] == [4.0, 5.0, 6.0] and again.threshold == 50.0
