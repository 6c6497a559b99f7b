"""learner/delayed.py's importance weights and learner/served.py's served quality."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learner.delayed import DelayedFeedbackWeights
from learner.served import ServedQuality
from stream.samples import DELAYED_POSITIVE, FINAL, OBSERVED


def weights_at(share: float, kinds, labels, probs) -> np.ndarray:
    w = DelayedFeedbackWeights(prior_late_share=share, prior_weight=1e9)  # the prior alone: S = share
    out = w.weights(np.array(kinds, np.int8), torch.tensor(labels, dtype=torch.float32),
                    torch.tensor(probs, dtype=torch.float32))
    assert out is not None
    return out.numpy()


def test_with_every_click_late_the_weights_are_ktena_fake_negative_weighting() -> None:
    p = np.array([0.1, 0.5, 0.9, 0.1, 0.5, 0.9], np.float32)
    y = [1, 1, 1, 0, 0, 0]
    w = weights_at(1.0, [DELAYED_POSITIVE] * 3 + [OBSERVED] * 3, y, p)
    np.testing.assert_allclose(w[:3], 1 + p[:3], rtol=1e-5)
    np.testing.assert_allclose(w[3:], (1 - p[3:]) * (1 + p[3:]), rtol=1e-5)


def test_a_saturated_model_still_feels_its_observed_zeros() -> None:
    # uncapped, FNW weighs an observed 0 at (1 - p)(1 + p) -> 0 as p -> 1, and a model that predicts 1
    # everywhere stays there (the demo's daemon did, for 15 k samples)
    p = np.array([0.999999, 0.99, 0.95], np.float32)
    w = weights_at(1.0, [OBSERVED] * 3, [0, 0, 0], p)
    np.testing.assert_allclose(w, (1 - 0.95) * (1 + 0.95), rtol=1e-5)
    w_pos = weights_at(1.0, [DELAYED_POSITIVE] * 3, [1, 1, 1], p)
    np.testing.assert_allclose(w_pos, 1 + 0.95, rtol=1e-5)


def test_final_rows_keep_weight_one_and_a_final_batch_needs_no_weights() -> None:
    w = weights_at(0.7, [FINAL, OBSERVED, FINAL], [1, 0, 0], [0.3, 0.3, 0.3])
    assert w[0] == 1 and w[2] == 1 and w[1] != 1
    assert DelayedFeedbackWeights().weights(np.zeros(3, np.int8), torch.zeros(3), torch.zeros(3)) is None
    np.testing.assert_allclose(weights_at(0.0, [OBSERVED, OBSERVED], [1, 0], [0.4, 0.4]), [1, 1])


def fixed_point(p: float, share: float, steps: int = 200) -> float:
    """The prediction the weighted loss settles at for one x with true click probability ``p`` when the
    stream is ES-DFM's: per impression an observed 1 with probability p(1-S), an observed 0 with probability
    1 - p(1-S), and a delayed positive with probability pS. Each step minimises the weighted log loss with
    the weights taken at the current prediction (their gradient is stopped, as in training)."""
    f = 0.5
    for _ in range(steps):
        w_pos = weights_at(share, [OBSERVED], [1], [f])[0]
        w_neg = weights_at(share, [OBSERVED], [0], [f])[0]
        pos, neg = p, 1 - p * (1 - share)  # observed 1s + delayed positives; observed 0s
        f = w_pos * pos / (w_pos * pos + w_neg * neg)
    return f


@pytest.mark.parametrize("share", [1.0, 0.6, 0.25])
@pytest.mark.parametrize("p", [0.004, 0.1, 0.58])
def test_the_weighted_loss_settles_at_the_true_click_probability(p: float, share: float) -> None:
    biased = p / (1 + p * share)  # what an unweighted model learns from the duplicated stream
    f = fixed_point(p, share)
    assert f == pytest.approx(p, rel=1e-3)
    assert abs(biased - p) > 10 * abs(f - p)  # the weights remove the duplicated positives' bias


def test_the_late_share_is_counted_from_the_stream() -> None:
    w = DelayedFeedbackWeights(prior_late_share=0.5, prior_weight=2)
    w.observe(np.array([OBSERVED, DELAYED_POSITIVE, DELAYED_POSITIVE, OBSERVED, FINAL], np.int8),
              np.array([1, 1, 1, 0, 1], np.float32))
    assert w.late_share == pytest.approx((2 + 1) / (3 + 2))  # FINAL rows are not counted


def test_the_bias_follows_the_running_click_rate_until_enough_clicks_then_training_owns_it() -> None:
    from learner.delayed import BaseRateBias

    model = torch.nn.Module()
    model.bias = torch.nn.Parameter(torch.zeros(1))
    b = BaseRateBias(min_positives=3)
    kinds = np.array([OBSERVED, OBSERVED, OBSERVED, OBSERVED, DELAYED_POSITIVE], np.int8)
    b.update(model, np.array([0, 0, 0, 1, 1], np.float32), kinds)  # 2 clicks / 4 impressions
    assert model.bias.item() == pytest.approx(math.log(2.5 / 5 / (1 - 2.5 / 5)))
    b.update(model, np.zeros(400, np.float32), np.zeros(400, np.int8))  # a batch without clicks moves it down
    assert model.bias.item() == pytest.approx(math.log(2.5 / 405 / (1 - 2.5 / 405)))
    b.update(model, np.ones(1, np.float32), np.zeros(1, np.int8))  # the third click: the estimate is final
    assert b.done
    model.bias.data.fill_(7.0)
    assert b.update(model, np.ones(10, np.float32), np.zeros(10, np.int8)) is None and model.bias.item() == 7.0


def test_served_quality_pairs_the_first_prediction_with_the_final_label() -> None:
    s = ServedQuality(window_ms=1000)
    ids = np.array(["a", "b", "c", "d"], object)
    s.record(ids, np.array([0, 0, 0, 0]), np.array([OBSERVED, OBSERVED, OBSERVED, FINAL], np.int8),
             np.array([0, 0, 1, 0], np.float32), np.array([0.9, 0.2, 0.8, 0.1]), None)
    assert s.all.count == 2 and s.pending == 2  # c (observed 1) and d (final) at once; a, b wait
    s.record(np.array(["a"], object), np.array([500]), np.array([DELAYED_POSITIVE], np.int8),
             np.array([1], np.float32), np.array([0.01]), None)  # a's later prediction is not what was served
    assert s.all.count == 3 and s.pending == 1
    s.advance(1000)  # b's window closes: a negative
    assert s.pending == 0 and s.all.count == 4
    # served: a 0.9 -> 1, b 0.2 -> 0, c 0.8 -> 1, d 0.1 -> 0: perfectly ranked
    assert s.all.auc == pytest.approx(1.0)
    assert 0 < s.all.ne < 1


def test_served_quality_bounds_its_pending_impressions_and_counts_the_unmatched() -> None:
    s = ServedQuality(window_ms=10**9, max_pending=2)
    s.record(np.array(["a", "b", "c"], object), np.array([0, 1, 2]), np.full(3, OBSERVED, np.int8),
             np.zeros(3, np.float32), np.array([0.5, 0.5, 0.5]), None)
    assert s.pending == 2 and s.forced == 1
    s.record(np.array(["zz"], object), np.array([3]), np.array([DELAYED_POSITIVE], np.int8),
             np.ones(1, np.float32), np.array([0.5]), None)
    assert s.unmatched == 1


def test_served_quality_waits_for_the_partitions_clicks_not_for_newer_impressions() -> None:
    """A backlog: the joiner puts out a batch of impressions a day ahead before the clicks of the ones before
    them. The newest impression time is not the clock; the partition's newest click time is."""
    day = 86_400_000
    s = ServedQuality(window_ms=1000)
    s.record(np.array(["a", "b"], object), np.array([0, 10]), np.full(2, OBSERVED, np.int8), np.zeros(2, np.float32),
             np.array([0.9, 0.1]), None, partitions=np.array([0, 0]))
    s.record(np.array(["x", "c"], object), np.array([day, day]), np.full(2, OBSERVED, np.int8),
             np.zeros(2, np.float32), np.array([0.5, 0.5]), None, partitions=np.array([0, 1]))
    assert s.pending == 4  # a day of impressions closed nothing
    s.record(np.array(["a"], object), np.array([0]), np.array([DELAYED_POSITIVE], np.int8), np.ones(1, np.float32),
             np.array([0.3]), None, partitions=np.array([0]), label_delay_ms=np.array([30]))
    assert s.unmatched == 0 and s.all.count == 1 and s.pending == 3  # a's click found a's served prediction
    s.record(np.array(["c"], object), np.array([day]), np.array([DELAYED_POSITIVE], np.int8), np.ones(1, np.float32),
             np.array([0.3]), None, partitions=np.array([1]), label_delay_ms=np.array([2000]))
    assert s.pending == 2  # partition 1's click clock (day + 2 s) says nothing about partition 0's impressions
    s.record(np.array(["y", "y"], object), np.array([1500, 1500]), np.array([OBSERVED, DELAYED_POSITIVE], np.int8),
             np.array([0, 1], np.float32), np.array([0.2, 0.2]), None, partitions=np.array([0, 0]),
             label_delay_ms=np.array([0, 500]))
    assert s.pending == 1  # partition 0's clicks reached 2000 ms: b (10 ms) closed as a negative, x (a day) waits
    assert s.all.count == 4 and s.all.auc == pytest.approx(1.0)  # a 0.9 -> 1, c 0.5 -> 1, y 0.2 -> 1, b 0.1 -> 0
