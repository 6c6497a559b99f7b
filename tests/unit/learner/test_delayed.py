"""learner/delayed.py's importance weights and base-rate bias, and learner/served.py's served quality."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from learner.delayed import BaseRateBias, DelayedFeedbackWeights, fit_delayed_rate
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


# -- the base-rate bias (learner.delayed.BaseRateBias, fit_delayed_rate) ---------------------------------------


def _bias_model() -> torch.nn.Module:
    model = torch.nn.Module()
    model.bias = torch.nn.Parameter(torch.zeros(1))
    return model


def _young_stream(rate: float, mean_delay_s: float, seconds: int, per_s: int, seed: int = 0,
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What a learner has seen ``seconds`` into a fresh fake_negative stream: every impression as an OBSERVED 0
    at its time, and the clicks whose exponential delay has passed as DELAYED_POSITIVE rows, all in emission
    order. Returns (labels, kinds, ts_ms, label_delay_ms), shapes (B,)."""
    rng = np.random.default_rng(seed)
    ts = np.sort(rng.uniform(0, seconds * 1000, seconds * per_s)).astype(np.int64)
    delay = rng.exponential(mean_delay_s * 1000, len(ts)).astype(np.int64)
    arrived = (rng.random(len(ts)) < rate) & (ts + delay <= seconds * 1000)
    labels = np.concatenate([np.zeros(len(ts)), np.ones(int(arrived.sum()))]).astype(np.float32)
    kinds = np.concatenate([np.full(len(ts), OBSERVED), np.full(int(arrived.sum()), DELAYED_POSITIVE)]).astype(np.int8)
    all_ts = np.concatenate([ts, ts[arrived]])
    delays = np.concatenate([np.zeros(len(ts), np.int64), delay[arrived]])
    order = np.argsort(all_ts + delays, kind="stable")
    return labels[order], kinds[order], all_ts[order], delays[order]


def test_the_delayed_feedback_model_finds_the_click_rate_that_the_running_rate_misses_on_a_young_stream() -> None:
    """Two mean delays into a stream at CTR 0.1, most clicks of the last minute have not come: the running rate
    reads far too low; Chapelle's model, fitted to the same counts, finds the rate and the delay."""
    labels, kinds, ts, delays = _young_stream(rate=0.1, mean_delay_s=30, seconds=60, per_s=2000)
    naive = labels.sum() / (kinds != DELAYED_POSITIVE).sum()
    assert naive < 0.07
    b = BaseRateBias()
    b.observe(labels, kinds, ts, delays)
    assert b.rate == pytest.approx(0.1, rel=0.08)
    assert 1 / b.delay_rate == pytest.approx(30, rel=0.15)


def test_fit_delayed_rate_is_the_plain_rate_when_every_click_has_come() -> None:
    r, lam = fit_delayed_rate(np.array([1000.0, 1000.0]), np.array([100.0, 80.0]), np.array([1e6, 1e6]),
                              click_delay_s=180 * 10.0, prior_rate=0.05, prior_delay_s=60)
    assert r == pytest.approx(181 / 2020, rel=1e-4)  # with the prior's click in 20 impressions
    assert lam == pytest.approx(181 / (1800 + 60), rel=1e-3)


def test_without_a_click_the_rate_leaves_the_prior_only_as_the_impressions_age() -> None:
    rates = [fit_delayed_rate(np.array([500.0]), np.array([0.0]), np.array([age]), 0.0, prior_rate=0.05)[0]
             for age in (0.0, 5.0, 60.0, 600.0)]
    assert rates[0] == pytest.approx(0.05, rel=1e-3)  # nothing could have been clicked yet: the prior
    assert rates[0] > rates[1] > rates[2] > rates[3]
    assert rates[3] == pytest.approx(1 / 520, rel=0.05)  # long past the prior's delay: no clicks means none


def test_the_bias_follows_the_rate_until_its_early_clicks_have_come_then_training_owns_it() -> None:
    model = _bias_model()
    b = BaseRateBias(min_positives=50)
    b.start(model)
    assert model.bias.item() == pytest.approx(math.log(0.05 / 0.95))
    labels, kinds, ts, delays = _young_stream(rate=0.1, mean_delay_s=30, seconds=300, per_s=100, seed=1)
    chunks = np.array_split(np.arange(len(labels)), 300)
    done_at = None
    for i, idx in enumerate(chunks):
        logit = b.update(model, labels[idx], kinds[idx], ts[idx], delays[idx])
        if logit is None:
            done_at = i
            break
        assert model.bias.item() == pytest.approx(logit)
        if b.positives == 0:  # no click has come: the prior stands (the running rate would read 0)
            assert b.rate == 0.05
    # not done at the 50th click (a few seconds in) but after five mean delays of event time
    assert done_at is not None and b.positives > 500
    assert (b.now_ms - b.first_ms) / 1000 >= 5 / b.delay_rate
    assert 1 / (1 + math.exp(-model.bias.item())) == pytest.approx(0.1, rel=0.1)
    model.bias.data.fill_(7.0)
    assert b.update(model, np.ones(10, np.float32), np.zeros(10, np.int8)) is None and model.bias.item() == 7.0


def test_one_row_stamped_a_day_early_does_not_end_the_bias_rule_before_its_clicks_have_come() -> None:
    """The rule ends after five mean delays of event time from the stream's start (its quorum-th smallest time):
    taken as the smallest, one row stamped a day early ended it at the 50th click, at the prior's guess."""
    base = 1_700_000_000_000
    labels, kinds, ts, delays = _young_stream(rate=0.1, mean_delay_s=30, seconds=300, per_s=100, seed=1)
    ts = ts + base
    chunks = np.array_split(np.arange(len(labels)), 300)
    ends = []
    for early in (False, True):
        t = ts.copy()
        if early:
            t[0] = base - 86_400_000
        b = BaseRateBias(min_positives=50)
        model = _bias_model()
        b.start(model)
        done_at = next((i for i, idx in enumerate(chunks)
                        if b.update(model, labels[idx], kinds[idx], t[idx], delays[idx]) is None), None)
        ends.append(done_at)
        assert b.first_ms is not None and b.first_ms >= base
    assert ends[0] is not None and ends[1] == ends[0]


def _es_dfm_stream(rate: float, mean_delay_s: float, seconds: int, per_s: int, elapsed_s: int, seed: int = 0,
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A fresh es_dfm stream as the learner reads it (the joiner's rule, stream/joiner/engine.py): a click within
    ``elapsed_s`` an OBSERVED 1 at the click, else an OBSERVED 0 ``elapsed_s`` after the impression and a later
    click a DELAYED_POSITIVE; rows out by ``seconds``, in emission order. (labels, kinds, ts_ms, label_delay_ms)."""
    rng = np.random.default_rng(seed)
    ts = np.sort(rng.uniform(0, seconds * 1000, seconds * per_s)).astype(np.int64)
    delay = rng.exponential(mean_delay_s * 1000, len(ts)).astype(np.int64)
    clicked, elapsed = rng.random(len(ts)) < rate, elapsed_s * 1000
    early = clicked & (delay <= elapsed)
    rows = [(ts, np.where(early, delay, elapsed), early.astype(np.float32), np.full(len(ts), OBSERVED)),
            (ts[clicked & ~early], delay[clicked & ~early], np.ones(int((clicked & ~early).sum()), np.float32),
             np.full(int((clicked & ~early).sum()), DELAYED_POSITIVE))]
    t, d, labels, kinds = (np.concatenate(c) for c in zip(*rows, strict=True))
    out = np.flatnonzero(t + d <= seconds * 1000)
    order = out[np.argsort((t + d)[out], kind="stable")]
    return labels[order], kinds[order].astype(np.int8), t[order], d[order]


def test_under_es_dfm_the_bias_rule_neither_reads_the_early_clicks_as_the_rate_nor_ends_high() -> None:
    """es_dfm holds an unclicked impression back for its elapsed time: a second younger than that holds only its
    clicks. Fitted with them, the first minute read a rate near 1 (truth 0.1) and the rule ended 20% high."""
    labels, kinds, ts, delays = _es_dfm_stream(rate=0.1, mean_delay_s=30, seconds=400, per_s=100, elapsed_s=60)
    b, model = BaseRateBias(min_positives=50), _bias_model()
    chunks = np.array_split(np.arange(len(labels)), 400)
    for i, idx in enumerate(chunks):
        if i == len(chunks) // 2:  # a restart half way: the rule goes on from its checkpointed state
            b2 = BaseRateBias(min_positives=50)
            b2.load_state_dict(b.state_dict())
            b = b2
        if b.update(model, labels[idx], kinds[idx], ts[idx], delays[idx]) is None:
            break
        if not ((kinds[:idx[-1] + 1] == OBSERVED) & (labels[:idx[-1] + 1] == 0)).any():
            assert b.rate == pytest.approx(0.05)  # no unclicked impression out yet: nothing says how many there are
        assert b.rate < 0.2
    assert b.done and b.rate == pytest.approx(0.1, rel=0.1)


def test_an_es_dfm_bias_rule_restored_from_an_older_state_goes_on_to_the_same_rate() -> None:
    """A state saved before the per-second click delays were kept: read as seconds without delays, the fit took the
    delays for nil, the mean delay for ~0 and the rule ended at once, at 0.0955 (5% low)."""
    labels, kinds, ts, delays = _es_dfm_stream(rate=0.1, mean_delay_s=30, seconds=400, per_s=100, elapsed_s=60)
    chunks = np.array_split(np.arange(len(labels)), 400)
    ends = []
    for older in (False, True):
        b, model = BaseRateBias(min_positives=50), _bias_model()
        for i, idx in enumerate(chunks):
            if i == 60:
                state = b.state_dict()
                if older:
                    del state["bin_delay_s"], state["elapsed_ms"]
                b = BaseRateBias(min_positives=50)
                b.load_state_dict(state)
            if b.update(model, labels[idx], kinds[idx], ts[idx], delays[idx]) is None:
                break
        ends.append((i, b.rate))
    assert ends[1][0] > 60 + 5  # not ended by the restore itself
    assert ends[1][1] == pytest.approx(ends[0][1], rel=0.02)


def test_the_bias_of_final_rows_follows_the_running_rate_with_the_prior_worth_one_click() -> None:
    model = _bias_model()
    b = BaseRateBias(min_positives=3)
    b.update(model, np.array([0, 0, 1, 1], np.float32), np.zeros(4, np.int8))  # FINAL rows: no delays to model
    assert model.bias.item() == pytest.approx(math.log(3 / 24 / (1 - 3 / 24)))
    assert b.update(model, np.ones(1, np.float32), None) is not None and b.done  # the third click
    assert b.update(model, np.ones(1, np.float32), None) is None


def test_the_bias_rule_resumes_from_its_state_as_if_never_stopped() -> None:
    labels, kinds, ts, delays = _young_stream(rate=0.05, mean_delay_s=20, seconds=40, per_s=200, seed=2)
    half = len(labels) // 2
    a, m1 = BaseRateBias(), _bias_model()
    a.update(m1, labels[:half], kinds[:half], ts[:half], delays[:half])
    b = BaseRateBias()
    b.load_state_dict(a.state_dict())
    m2 = _bias_model()
    assert a.update(m1, labels[half:], kinds[half:], ts[half:], delays[half:]) == pytest.approx(
        b.update(m2, labels[half:], kinds[half:], ts[half:], delays[half:]))


def test_a_bias_restored_done_stays_done_and_its_summary_survives_a_restart() -> None:
    """Checkpoints keep a done bias too (learner/daemon.py, sharded_daemon.py): a worker restarted after it finished
    (an elastic restart of a rank, a crash) neither sets the bias again nor loses the rate it followed from its
    summary (it read ``base_rate_bias: None`` when a rank was restarted, once in ten 2-rank runs)."""
    labels, kinds, ts, delays = _young_stream(rate=0.1, mean_delay_s=30, seconds=300, per_s=100, seed=1)
    a, model = BaseRateBias(min_positives=50), _bias_model()
    for idx in np.array_split(np.arange(len(labels)), 300):
        if a.update(model, labels[idx], kinds[idx], ts[idx], delays[idx]) is None:
            break
    assert a.done
    state = a.state_dict()
    assert state["bins"] == []  # only the fit reads them, and it is over
    b = BaseRateBias(min_positives=50)
    b.load_state_dict(state)
    assert b.done and b.summary() == a.summary()
    model.bias.data.fill_(7.0)  # training owns it now
    assert b.update(model, np.ones(10, np.float32), np.zeros(10, np.int8)) is None and model.bias.item() == 7.0


def test_a_done_bias_rule_frees_its_per_second_counts_and_click_delays() -> None:
    """Memory, the class docstring: a pair of counts per second of event time (up to ``max_bins``) and, since the
    es_dfm fit, a click-delay sum per second too, only until done. Once done nothing reads them (the fit is over, a
    checkpoint leaves them out), yet the learner held both for the rest of its life."""
    labels, kinds, ts, delays = _es_dfm_stream(rate=0.1, mean_delay_s=30, seconds=400, per_s=100, elapsed_s=60)
    b, model = BaseRateBias(min_positives=50), _bias_model()
    seen = 0
    for idx in np.array_split(np.arange(len(labels)), 400):
        seen = max(seen, len(b.bins))
        if b.update(model, labels[idx], kinds[idx], ts[idx], delays[idx]) is None:
            break
    assert b.done and seen > 100  # it counted per second until done ...
    assert (b.bins, b.bin_delay_s) == ({}, {})  # ... and holds none after
    assert b.rate == pytest.approx(0.1, rel=0.1)


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5])
def test_a_prior_click_rate_outside_0_1_is_refused_with_the_setting_named(bad: float) -> None:
    from learner.config import LearnerSettings
    from stream.errors import ConfigError

    with pytest.raises(ConfigError, match=r"\[learner\] prior_click_rate"):
        LearnerSettings(prior_click_rate=bad)


def test_the_protocol_starts_a_fresh_bias_from_the_prior_click_rate() -> None:
    """On a stream too short for any click to have come by the first step, the first batch is served at the prior:
    a low prior serves a low-CTR stream's first impressions better than the default."""
    from learner.evaluation.protocols import evaluate

    small = {"mlp": (16,), "batch_size": 256, "syn_base_ctr": 0.004, "syn_impressions": 3_000}
    default = evaluate("synthetic", "delayed", config=small, seed=0)
    low = evaluate("synthetic", "delayed", config={**small, "prior_click_rate": 0.004}, seed=0)
    assert low["served"]["logloss"] < default["served"]["logloss"]


@pytest.mark.parametrize("delay_ms", [-60_000, -10**12])
def test_a_negative_label_delay_that_reaches_the_bias_rule_leaves_a_finite_bias(delay_ms: int) -> None:
    """Defence in depth behind SampleBatch.decode (which refuses it): a negative delay made lam negative, the fit
    NaN and the model's bias NaN (or pinned at a wrong rate) for good."""
    model = _bias_model()
    b = BaseRateBias()
    b.start(model)
    t0 = 1_700_000_000_000
    for k in range(30):  # a third of the impressions clicked at once (OBSERVED 1s, no delay)
        if k == 1:
            b.update(model, np.array([1, 1, 0, 0], np.float32), np.full(4, OBSERVED, np.int8), np.full(4, t0 + 100_000),
                     np.array([delay_ms, delay_ms, 0, 0], np.int64))
        labels = (np.arange(64) % 3 == 0).astype(np.float32)
        b.update(model, labels, np.full(64, OBSERVED, np.int8), t0 + 1000 * (k * 64 + np.arange(64)),
                 np.zeros(64, np.int64))
        assert math.isfinite(model.bias.item())
    assert 0 < b.rate < 1 and b.delay_rate > 0
    assert 1 / (1 + math.exp(-model.bias.item())) < 0.5  # not pinned near 1 (the click rate is 1/3)


def test_fit_delayed_rate_returns_a_sound_rate_for_a_negative_delay_sum() -> None:
    r, lam = fit_delayed_rate(np.array([100.0, 100.0]), np.array([5.0, 5.0]), np.array([10.0, 1e6]),
                              click_delay_s=-1e9, prior_rate=0.05)
    assert math.isfinite(r) and math.isfinite(lam) and 0 < r < 1 and lam > 0


def test_the_bias_rules_clock_does_not_lead_the_wall_clock() -> None:
    """One row's ts + label_delay_ms far ahead made every impression look old, its missing clicks final."""
    import time

    now = int(time.time() * 1000)
    b = BaseRateBias()
    b.observe(np.array([1, 0], np.float32), np.full(2, OBSERVED, np.int8), np.array([now - 1000, now - 1000]),
              np.array([10**12, 0]))
    assert b.now_ms is not None and b.now_ms <= time.time() * 1000


def test_served_samples_carry_the_event_time_their_label_became_known() -> None:
    """The served windows are timed (learner/served.py): a sample's time is its click, or its window's close for a
    negative that waited, not its impression's time (a negative resolves a window after it was served)."""
    s = ServedQuality(window_ms=1000)
    s.record(np.array(["a", "b", "c", "d"], object), np.array([0, 10, 20, 30]),
             np.array([OBSERVED, OBSERVED, OBSERVED, FINAL], np.int8), np.array([0, 0, 1, 0], np.float32),
             np.array([0.9, 0.2, 0.8, 0.1]), None, label_delay_ms=np.array([0, 0, 40, 5000]))
    s.record(np.array(["a"], object), np.array([0]), np.array([DELAYED_POSITIVE], np.int8), np.ones(1, np.float32),
             np.array([0.5]), None, label_delay_ms=np.array([700]))
    s.advance(2000)
    # c: observed 1, clicked at 60; d: final 0, labelled at 5030; a: its delayed click at 700; b: its window closed
    assert s.state_dict()["all"]["window_ts"].tolist() == [60, 5030, 700, 1010]
    assert s.state_dict()["all"]["window_probs"].tolist() == [0.8, 0.1, 0.9, 0.2]


def test_an_observed_impression_seen_again_on_another_partition_keeps_its_first_prediction_and_no_crash() -> None:
    """An impression id whose OBSERVED row comes twice (a client that re-sent it after the impressions topic grew
    partitions, past the daemon's dedup window): both were kept pending, one partition's queue outlived the id's
    entry, and its expiry raised KeyError inside training, a crash that struck the innocent batch of that moment."""
    s = ServedQuality(window_ms=1000)
    for part, prob in ((0, 0.9), (1, 0.2)):
        s.record(np.array(["a"], object), np.array([0]), np.array([OBSERVED], np.int8), np.zeros(1, np.float32),
                 np.array([prob]), None, partitions=np.array([part]))
    assert s.pending == 1
    s.advance(5000)  # both partitions' windows close
    assert s.pending == 0 and s.all.count == 1
    assert s.state_dict()["all"]["window_probs"].tolist() == [0.9]  # the prediction served first
    s.record(np.array(["b"], object), np.array([9000]), np.array([OBSERVED], np.int8), np.zeros(1, np.float32),
             np.array([0.4]), None, partitions=np.array([0]))
    s.record(np.array(["b", "b"], object), np.array([9000, 9000]), np.array([OBSERVED, DELAYED_POSITIVE], np.int8),
             np.array([0, 1], np.float32), np.array([0.7, 0.7]), None, partitions=np.array([1, 1]),
             label_delay_ms=np.array([0, 300]))
    s.advance(20_000)
    assert s.pending == 0 and s.unmatched == 0 and s.all.count == 2
    assert s.state_dict()["all"]["window_probs"].tolist() == [0.9, 0.4]  # b's click found its first prediction


def test_a_click_exactly_a_window_after_its_impression_is_served_as_a_click_as_the_joiner_labels_it() -> None:
    """The joiner joins a click with 0 <= click.ts - imp.ts <= window (inclusive). Another click of that same
    millisecond, delivered a batch earlier, took the click clock to ts + window: a's window was taken as closed,
    a served as a negative, and its delayed positive, a batch later, went unmatched."""
    s = ServedQuality(window_ms=1000)
    s.record(np.array(["a", "b"], object), np.array([0, 900]), np.full(2, OBSERVED, np.int8), np.zeros(2, np.float32),
             np.array([0.8, 0.2]), None, partitions=np.array([0, 0]))
    for imp, ts in (("b", 900), ("a", 0)):  # both clicked at 1000 ms, in two batches
        s.record(np.array([imp], object), np.array([ts]), np.array([DELAYED_POSITIVE], np.int8),
                 np.ones(1, np.float32), np.array([0.5]), None, partitions=np.array([0]),
                 label_delay_ms=np.array([1000 - ts]))
    assert s.unmatched == 0 and s.pending == 0 and s.all.count == 2
    assert s.all.logloss == pytest.approx(-(np.log(0.8) + np.log(0.2)) / 2)  # both served predictions, label 1
    s.record(np.array(["c"], object), np.array([1000]), np.array([OBSERVED], np.int8), np.zeros(1, np.float32),
             np.array([0.1]), None, partitions=np.array([0]))
    s.advance(2000)  # every window ending by then has closed: c's (at 2000) too
    assert s.pending == 0 and s.all.count == 3


def test_delayed_feedback_counts_of_disjoint_rows_merge_into_those_of_one_counter_over_all_of_them() -> None:
    """What a restore on another number of ranks and --unshard give (each rank counted its own rows)."""
    rng = np.random.default_rng(0)
    kinds = rng.choice(np.array([FINAL, OBSERVED, DELAYED_POSITIVE], np.int8), 300)
    labels = (rng.random(300) < 0.3).astype(np.float32)
    labels[kinds == DELAYED_POSITIVE] = 1.0
    one, parts = DelayedFeedbackWeights(), [DelayedFeedbackWeights() for _ in range(3)]
    one.observe(kinds, labels)
    for r, part in enumerate(parts):
        part.observe(kinds[r::3], labels[r::3])
    assert DelayedFeedbackWeights.merged([p.state_dict() for p in parts]) == one.state_dict()
    assert one.state_dict()["delayed"] > 0


def test_under_fake_negative_the_first_batch_already_gets_ktena_weights_not_the_priors() -> None:
    """fake_negative's observed 0s go out at once (label_delay_ms 0): every click is a delayed one, S = 1 exactly.
    Counted with the prior (0.5, worth 20 clicks), the first batch's S was 11/21 and a delayed positive at p = 0.5
    weighed 1.26 instead of FNW's 1.5."""
    w = DelayedFeedbackWeights()
    kinds = np.array([OBSERVED, OBSERVED, OBSERVED, DELAYED_POSITIVE], np.int8)
    labels = np.array([0, 0, 0, 1], np.float32)
    w.observe(kinds, labels, np.array([0, 0, 0, 4000], np.int64))  # (B,) label_delay_ms: the fake 0s at once
    assert w.late_share == 1.0
    out = w.weights(kinds, torch.from_numpy(labels), torch.full((4,), 0.5))
    assert out is not None
    np.testing.assert_allclose(out.numpy(), [0.75, 0.75, 0.75, 1.5], rtol=1e-6)  # (1 - p)(1 + p), 1 + p


def test_under_es_dfm_the_late_share_is_still_counted_and_the_elapsed_time_survives_a_restore() -> None:
    w = DelayedFeedbackWeights(prior_late_share=0.5, prior_weight=2)
    kinds = np.array([OBSERVED, OBSERVED, DELAYED_POSITIVE], np.int8)
    w.observe(kinds, np.array([1, 0, 1], np.float32), np.array([9000, 60_000, 90_000], np.int64))
    assert w.late_share == pytest.approx((1 + 1) / (2 + 2))  # es_dfm's observed 0s waited 60 s: counted
    fake = DelayedFeedbackWeights()
    fake.observe(kinds[1:], np.array([0, 1], np.float32), np.array([0, 5000], np.int64))
    again = DelayedFeedbackWeights()
    again.load_state_dict(fake.state_dict())
    assert again.late_share == 1.0
    merged = DelayedFeedbackWeights.merged([w.state_dict(), fake.state_dict(), {"positives": 3, "delayed": 1}])
    assert merged == {"positives": 6, "delayed": 3, "elapsed_ms": 60_000}  # the longest wait seen: not FNW
    assert DelayedFeedbackWeights.share([fake.state_dict()] * 2, 1, 3)["elapsed_ms"] == 0  # not split


def test_a_restart_under_another_elapsed_time_weighs_by_the_new_policy_not_the_checkpoints_counts() -> None:
    """A learner restored from an es_dfm run (observed 0s after 60 s, a quarter of the clicks late) and then fed
    fake_negative's samples (observed 0s at once): every click is late, S = 1 (FNW) from the first batch; and the
    reverse, a fake_negative run's counts (every click late) do not hold an es_dfm stream's share at ~1."""
    es_dfm = DelayedFeedbackWeights()
    kinds = np.array([OBSERVED] * 4 + [DELAYED_POSITIVE], np.int8)
    for _ in range(1000):
        es_dfm.observe(kinds, np.array([1, 1, 1, 0, 1], np.float32), np.array([9000] * 3 + [60_000, 90_000]))
    assert es_dfm.late_share == pytest.approx(0.25, abs=0.01)
    fake = DelayedFeedbackWeights()
    fake.load_state_dict(es_dfm.state_dict())
    fake.observe(np.array([OBSERVED, DELAYED_POSITIVE], np.int8), np.array([0, 1], np.float32), np.array([0, 5000]))
    assert fake.late_share == 1.0
    again = DelayedFeedbackWeights(prior_late_share=0.5, prior_weight=20)
    again.load_state_dict(fake.state_dict())
    again.observe(kinds, np.array([1, 1, 1, 0, 1], np.float32), np.array([9000] * 3 + [60_000, 90_000]))
    assert again.late_share == pytest.approx((1 + 0.5 * 20) / (4 + 20))  # this stream's counts and the prior


def test_counts_from_a_checkpoint_that_does_not_say_their_elapsed_time_do_not_hold_an_es_dfm_stream_at_fnw() -> None:
    """A checkpoint written before ``elapsed_ms`` was kept holds counts of an unknown policy: a fake_negative run's
    (every click late) resumed under es_dfm weighed its clicks by S ~ 1 for as many clicks again, not its own 1/4."""
    old = DelayedFeedbackWeights()
    old.load_state_dict({"positives": 100_000, "delayed": 100_000})  # an older format: no elapsed_ms
    kinds = np.array([OBSERVED] * 4 + [DELAYED_POSITIVE], np.int8)
    for _ in range(1000):
        old.observe(kinds, np.array([1, 1, 1, 0, 1], np.float32), np.array([9000] * 3 + [60_000, 90_000]))
    assert old.late_share == pytest.approx(0.25, abs=0.01)


def test_one_stray_observed_zero_does_not_start_the_late_share_counts_again() -> None:
    """The elapsed time is the bulk's, never one row's: a single OBSERVED 0 with another label_delay_ms (a foreign
    producer, a damaged row) in a batch of es_dfm's took the counts of the whole stream back to the prior, twice."""
    w = DelayedFeedbackWeights()
    kinds = np.array([OBSERVED] * 4 + [DELAYED_POSITIVE], np.int8)
    labels = np.array([1, 1, 1, 0, 1], np.float32)
    for _ in range(1000):
        w.observe(kinds, labels, np.array([9000] * 3 + [60_000, 90_000]))
    stray = np.array([OBSERVED] * 4, np.int8), np.zeros(4, np.float32), np.array([60_000] * 3 + [1_800_000])
    w.observe(*stray)
    w.observe(kinds, labels, np.array([9000] * 3 + [60_000, 90_000]))
    assert w.late_share == pytest.approx(0.25, abs=0.01) and w.elapsed_ms == 60_000


def test_a_restore_under_another_es_dfm_elapsed_s_counts_the_late_share_afresh_in_one_process_and_resharded() -> None:
    """[joiner] elapsed_s changed across a learner restart (es_dfm at 60 s, then at 30 s). Not refused: the importance
    weights make the loss the true distribution's under any elapsed time, so the restored model's parameters estimate
    the same click probability; what was learnt under the old window is the late share ``S`` alone (a shorter wait
    makes more clicks late), and the first batch whose observed 0s waited 30 s starts its counts again (the prior
    takes over), whether restored in one process or resharded onto 2 ranks (``share``)."""
    kinds = np.array([OBSERVED] * 4 + [DELAYED_POSITIVE], np.int8)
    at_60s = DelayedFeedbackWeights()
    for _ in range(1000):  # 3 of 4 clicks within 60 s: S ~ 0.25
        at_60s.observe(kinds, np.array([1, 1, 1, 0, 1], np.float32), np.array([9000] * 3 + [60_000, 90_000]))
    assert at_60s.late_share == pytest.approx(0.25, abs=0.01)
    one = DelayedFeedbackWeights(prior_late_share=0.5, prior_weight=20)
    one.load_state_dict(at_60s.state_dict())
    ranks = [DelayedFeedbackWeights(prior_late_share=0.5, prior_weight=20) for _ in range(2)]
    for r, w in enumerate(ranks):
        w.load_state_dict(DelayedFeedbackWeights.share([at_60s.state_dict()], r, 2))
    for w in (one, *ranks):
        assert w.late_share == pytest.approx(0.25, abs=0.01)  # restored: the old window's share until told otherwise
        # at 30 s: 1 of 3 clicks within it, 2 late
        late = np.array([OBSERVED, OBSERVED, DELAYED_POSITIVE, DELAYED_POSITIVE], np.int8)
        w.observe(late, np.array([1, 0, 1, 1], np.float32), np.array([9000, 30_000, 50_000, 70_000]))
        assert w.elapsed_ms == 30_000
        assert w.late_share == pytest.approx((2 + 0.5 * 20) / (3 + 20))  # this window's counts and the prior only


def test_batches_alternating_two_elapsed_times_count_every_change_and_warn_once_a_minute(
        caplog: pytest.LogCaptureFixture) -> None:
    """Two joiners of different policies writing one samples topic (fake_negative's 0s at once, es_dfm's after 60 s)
    start the late share again at every other batch, S held at its prior: each change is counted, and the WARNING
    goes out at most once a minute of the clock, saying how many changes since the last one and both elapsed times."""
    now = [0.0]
    w = DelayedFeedbackWeights(clock=lambda: now[0])
    kinds = np.array([OBSERVED, OBSERVED, DELAYED_POSITIVE], np.int8)
    labels = np.array([0, 1, 1], np.float32)
    before = REGISTRY.get_sample_value("streamrec_learner_elapsed_changes_total") or 0.0
    with caplog.at_level("WARNING", logger="streamrec.train"):
        for i in range(10):  # one batch every 20 s, the waits alternating: 9 changes at t = 20 .. 180 s
            now[0] = 20.0 * i
            wait = 0 if i % 2 == 0 else 60_000
            w.observe(kinds, labels, np.array([wait, 5000, wait + 7000], np.int64))  # (B,) label_delay_ms
            assert REGISTRY.get_sample_value("streamrec_learner_elapsed_changes_total") == before + i
            assert w.positives == 2  # this batch's clicks only: the counts started again
    warned = [r.getMessage() for r in caplog.records if "elapsed time changed" in r.getMessage()]
    assert len(warned) == 3  # at t = 20, 80 and 140 s; the changes at 160 and 180 s wait for the next minute
    assert "from 0 ms to 60000 ms (1 change(s) since the last warning, 1 in all)" in warned[0]
    assert "(3 change(s) since the last warning, 4 in all)" in warned[1]
    assert "from 0 ms to 60000 ms (3 change(s) since the last warning, 7 in all)" in warned[2]
    assert w.elapsed_changes == 9


CORRUPT_DELAYED_COUNTS = {
    "positives_at_minus_the_prior_weight": ({"positives": -20, "delayed": 0}, "positives"),  # S divided by zero
    "negative_positives": ({"positives": -3, "delayed": 0}, "positives"),
    "negative_delayed": ({"positives": 5, "delayed": -1}, "delayed"),
    "more_delayed_than_positives": ({"positives": 2, "delayed": 7}, "delayed 7 > positives 2"),
    "fractional_positives": ({"positives": 2.5, "delayed": 0}, "positives"),
    "text_delayed": ({"positives": 2, "delayed": "x"}, "delayed"),
    "negative_elapsed_time": ({"positives": 2, "delayed": 1, "elapsed_ms": -5}, "elapsed_ms"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT_DELAYED_COUNTS))
def test_delayed_feedback_counts_no_stream_counts_are_refused_at_load_naming_the_state_and_value(case: str) -> None:
    """A damaged or edited checkpoint's counts are refused when loaded (the restore then uses the previous
    checkpoint), not at every batch: ``positives = -20`` divided by zero in the late share of each batch, and the
    batch's messages were struck for it; other negative counts gave negative or NaN weights."""
    state, named = CORRUPT_DELAYED_COUNTS[case]
    w = DelayedFeedbackWeights()
    with pytest.raises(ValueError, match="delayed_weights") as err:
        w.load_state_dict(state)
    assert named in str(err.value)
    assert (w.positives, w.delayed, w.elapsed_ms) == (0, 0, None)  # nothing of it kept
    kinds = np.array([OBSERVED, DELAYED_POSITIVE], np.int8)
    out = w.weights(kinds, torch.tensor([0.0, 1.0]), torch.tensor([0.3, 0.6]))  # a batch still trains
    assert out is not None and bool(torch.isfinite(out).all())


def test_sound_delayed_feedback_counts_still_load_including_states_without_elapsed_time() -> None:
    w = DelayedFeedbackWeights()
    w.load_state_dict({"positives": 4, "delayed": 4, "elapsed_ms": 0})
    assert (w.positives, w.delayed, w.elapsed_ms, w.late_share) == (4, 4, 0, 1.0)
    w.load_state_dict({})
    assert (w.positives, w.delayed, w.elapsed_ms) == (0, 0, None)


CORRUPT_BIAS_STATES = {
    "impressions_at_minus_the_prior": ({"impressions": -20}, "impressions"),  # the running rate divided by zero
    "negative_positives": ({"positives": -1}, "positives"),
    "rate_of_one": ({"rate": 1.0}, "rate 1.0"),  # its logit divided by zero on every batch
    "negative_rate": ({"rate": -0.2}, "rate -0.2"),
    "nan_rate": ({"rate": float("nan")}, "rate nan"),
    "infinite_delay_rate": ({"delay_rate": float("inf")}, "delay_rate inf"),
    "negative_click_delay_sum": ({"click_delay_s": -5.0}, "click_delay_s -5.0"),
    "negative_bin_clicks": ({"bins": [[3, 4, -1]]}, "bins[3][1]"),
    "negative_bin_impressions": ({"bins": [[3, -4, 1]]}, "bins[3][0]"),  # checked too, not only the last count
    "nan_bin_delay": ({"bins": [[3, 4, 1]], "bin_delay_s": [[3, float("nan")]]}, "bin_delay_s[3] nan"),
    "negative_elapsed_time": ({"elapsed_ms": -1}, "elapsed_ms"),
    # of another type: bool("false") was True, "0.1" and True were read as numbers
    "stopped_as_text": ({"stopped": "false"}, "stopped 'false' is not true or false"),
    "rate_as_text": ({"rate": "0.1"}, "rate '0.1'"),
    "impressions_as_bool": ({"impressions": True}, "impressions"),
    "clock_time_as_bool": ({"clock": [True]}, "event clock state: True"),
    "first_time_as_text": ({"first_ms": "1700000000000"}, "event clock state: '1700000000000'"),
    # the delay fields too: float() read "0.1" and true (as 1.0), and "fast" raised a message naming no field
    "delay_rate_as_text": ({"delay_rate": "0.1"}, "delay_rate '0.1'"),
    "delay_rate_as_a_word": ({"delay_rate": "fast"}, "delay_rate 'fast'"),
    "click_delay_sum_as_bool": ({"click_delay_s": True}, "click_delay_s True"),
    "bin_delay_as_text": ({"bins": [[3, 4, 1]], "bin_delay_s": [[3, "2.5"]]}, "bin_delay_s[3] '2.5'"),
    "bin_second_as_text": ({"bins": [["3", 4, 1]]}, "bins second '3'"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT_BIAS_STATES))
def test_a_bias_rule_state_no_stream_makes_is_refused_at_load_naming_the_value(case: str) -> None:
    """A damaged or edited checkpoint's bias rule is refused when loaded (the restore uses the previous checkpoint):
    loaded, ``impressions = -20`` or ``rate = 1`` divided by zero in every batch's bias update, striking its
    messages."""
    change, named = CORRUPT_BIAS_STATES[case]
    sound = BaseRateBias()
    sound.observe(np.array([0, 1, 0, 0], np.float32), None)
    bias = BaseRateBias()
    with pytest.raises(ValueError, match="base_rate_bias") as err:
        bias.load_state_dict({**sound.state_dict(), **change})
    assert named in str(err.value)
    model = torch.nn.Module()
    model.register_parameter("bias", torch.nn.Parameter(torch.zeros(1)))
    got = bias.update(model, np.array([0, 1], np.float32), np.array([FINAL, FINAL], np.int8))  # a batch still trains
    assert got is not None and math.isfinite(got)


def test_a_sound_bias_rule_state_of_a_corrected_stream_still_loads() -> None:
    bias = BaseRateBias(min_positives=1000)
    kinds = np.array([OBSERVED, OBSERVED, DELAYED_POSITIVE], np.int8)
    bias.observe(np.array([0, 0, 1], np.float32), kinds, np.array([1000, 2000, 1000]), np.array([0, 0, 4000]))
    again = BaseRateBias(min_positives=1000)
    again.load_state_dict(bias.state_dict())
    assert again.state_dict() == bias.state_dict()


def test_served_impressions_whose_prediction_is_not_finite_are_counted_unscored_not_dropped_without_a_word() -> None:
    """A NaN or inf served prediction has no rank and no logloss: it is left out of the served metrics, and was
    left out of every count too, so a model serving NaN to most impressions read as one measured on the rest."""
    s = ServedQuality(window_ms=1000)
    s.record(np.array(["a", "b", "c", "d"], object), np.zeros(4, np.int64),
             np.array([FINAL, OBSERVED, OBSERVED, OBSERVED], np.int8), np.array([1, 1, 0, 0], np.float32),
             np.array([np.nan, np.inf, 0.3, np.nan]), None)
    s.record(np.array(["d"], object), np.array([0]), np.array([DELAYED_POSITIVE], np.int8), np.ones(1, np.float32),
             np.array([0.5]), None, label_delay_ms=np.array([200]))  # d's click: its served NaN resolved
    s.advance(5000)  # c's window closes
    assert s.all.count == 1 and s.unscored == 3 and s.summary()["unscored"] == 3
    r = ServedQuality(window_ms=1000)
    r.load_state_dict(s.state_dict())  # kept across a restart
    assert r.unscored == 3
    old = s.state_dict()
    del old["unscored"]
    r.load_state_dict(old)  # a state saved before the count: none
    assert r.unscored == 0
