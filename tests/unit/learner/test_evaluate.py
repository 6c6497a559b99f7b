"""``learner/evaluation/``: the AutoInt split and labels, history as of time (and after a delay), calibration,
and small end-to-end runs through ``learner.evaluation.protocols.evaluate`` (what ``streamrec evaluate`` calls)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learner.evaluation.calibration import apply_platt, fit_platt
from learner.evaluation.config import EvalConfig, resolve_config
from learner.evaluation.protocols import evaluate
from learner.evaluation.ratings import Ratings, autoint_labels, online_labels, split_811
from learner.evaluation.samples import build_samples, feature_config, history_as_of
from learner.progressive import logloss
from stream.errors import DatasetMissing
from stream.features import hash_value, request_time
from stream.replay.movielens import DATASETS

# Small, fast model settings for the end-to-end runs (the defaults are tuned for the full data set).
SMALL = {"mlp": (64, 64), "id_buckets": 20_000, "zip_buckets": 20_000, "ctx_buckets": 2_000, "batch_size": 1024}


def needs_ml1m(test):  # noqa: ANN001, ANN201
    """Tests on ML-1M fail (never skip) when it is missing: `make test` installs it (streamrec data install)."""
    try:
        DATASETS["ml-1m"].locate()
        return test
    except DatasetMissing as exc:
        message = str(exc)

    def missing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError(message)

    missing.__name__ = test.__name__
    return missing


# -- split and labels -----------------------------------------------------------------------
def test_split_is_8_1_1_and_a_partition() -> None:
    tr, va, te = split_811(739_012, seed=42)
    assert (len(tr), len(va), len(te)) == (591_209, 73_901, 73_902)
    every = np.concatenate([tr, va, te])
    assert np.array_equal(np.sort(every), np.arange(739_012))
    for n in (0, 1, 9, 10, 11, 1001):
        a, b, c = split_811(n, seed=0)
        assert (len(a), len(b), len(c)) == (n * 8 // 10, n // 10, n - n * 8 // 10 - n // 10)


def test_split_is_deterministic_by_seed() -> None:
    a = split_811(10_000, seed=7)
    b = split_811(10_000, seed=7)
    c = split_811(10_000, seed=8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[2], c[2])


def test_split_ignores_the_global_numpy_seed() -> None:
    np.random.seed(1)
    a = split_811(1000, seed=3)
    np.random.seed(2)
    b = split_811(1000, seed=3)
    assert np.array_equal(a[0], b[0])


def test_autoint_labels_drop_3() -> None:
    keep, label = autoint_labels(np.array([1.0, 2.0, 3.0, 4.0, 5.0, 3.0]))
    assert keep.tolist() == [True, True, False, True, True, False]
    assert label[keep].tolist() == [0, 0, 1, 1]


def test_online_labels_click_at_4() -> None:
    assert online_labels(np.array([1, 2, 3, 4, 5])).tolist() == [0, 0, 0, 1, 1]


# -- history as of time ---------------------------------------------------------------------
# user, item, ts, rating; deliberately not in time order
FRAME = [
    ("a", "i5", 40, 4),
    ("a", "i1", 10, 5),
    ("b", "i9", 15, 5),
    ("a", "i3", 20, 5),  # same second as i2: neither sees the other
    ("a", "i2", 20, 4),
    ("a", "i4", 30, 2),  # a negative: never in a history
    ("b", "i1", 50, 3),
    ("a", "i6", 40, 1),
    ("a", "i7", 60, 5),
]


def _histories(max_len: int = 50, rows: np.ndarray | None = None) -> list[list[str]]:
    user = np.array([r[0] for r in FRAME])
    item = np.array([r[1] for r in FRAME])
    ts = np.array([r[2] for r in FRAME])
    pos = np.array([r[3] for r in FRAME]) >= 4
    flat, offsets = history_as_of(user, item, ts, pos, max_len=max_len, rows=rows)
    return [flat[offsets[k]:offsets[k + 1]].tolist() for k in range(len(offsets) - 1)]


def test_history_is_strictly_before_and_never_includes_the_rating_itself() -> None:
    assert _histories() == [
        ["i1", "i3", "i2"],  # a@40: the positives at 10 and 20, not the negative at 30, not i6 at 40
        [],  # a@10: nothing earlier
        [],  # b@15: a's items never leak into b
        ["i1"],  # a@20: not itself, not i2 of the same second
        ["i1"],
        ["i1", "i3", "i2"],  # a@30
        ["i9"],  # b@50
        ["i1", "i3", "i2"],  # a@40 (negative i6): not i5 of the same second
        ["i1", "i3", "i2", "i5"],  # a@60: i5 at 40 now counts, newest last
    ]


def test_history_keeps_the_newest_max_len_and_selects_rows() -> None:
    assert _histories(max_len=2)[8] == ["i2", "i5"]
    assert _histories(max_len=2, rows=np.array([8, 1, 0])) == [["i2", "i5"], [], ["i3", "i2"]]


def test_history_matches_brute_force_on_random_frames() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(1, 300))
        user = rng.integers(0, 5, n)
        item = rng.integers(0, 1000, n)
        ts = rng.integers(0, 40, n)
        pos = rng.random(n) < 0.6
        delay = int(rng.choice([0, 0, 1, 7]))
        flat, offsets = history_as_of(user, item, ts, pos, max_len=7, delay_ms=delay)
        for k in range(n):
            earlier = [j for j in np.lexsort((np.arange(n), ts))
                       if user[j] == user[k] and ts[j] + delay < ts[k] and pos[j]]
            firsts = {(ts[j], item[j]): j for j in reversed(earlier)}  # one entry per (time, item): the first
            earlier = [j for j in earlier if firsts[(ts[j], item[j])] == j]
            assert flat[offsets[k]:offsets[k + 1]].tolist() == item[earlier][-7:].tolist()


def test_history_delay_lets_an_item_in_only_after_the_delay() -> None:
    """A positive rated at t is absent from the history of a rating at t + d/2 and present at t + 2d (and
    with no delay it is present at both): the history of a joiner whose click arrives d after the rating."""
    t, d = 1_000_000, 30_000  # ms
    user = np.array(["a", "a", "a", "b"])
    item = np.array(["i1", "i2", "i3", "i1"])
    ts = np.array([t, t + d // 2, t + 2 * d, t + 2 * d])
    pos = np.array([True, False, False, True])
    flat, offsets = history_as_of(user, item, ts, pos, delay_ms=d)
    got = [flat[offsets[k]:offsets[k + 1]].tolist() for k in range(len(user))]
    assert got == [[], [], ["i1"], []]  # b's own i1 never leaks into a, a's never into b
    flat, offsets = history_as_of(user, item, ts, pos)
    assert [flat[offsets[k]:offsets[k + 1]].tolist() for k in range(len(user))] == [[], ["i1"], ["i1"], []]
    flat, offsets = history_as_of(user, item, np.array([t, t + d, t + d + 1, t]), pos, delay_ms=d)
    assert flat[offsets[1]:offsets[2]].tolist() == [] and flat[offsets[2]:offsets[3]].tolist() == ["i1"]  # strict


def _frame_ratings() -> Ratings:
    users = np.array([r[0] for r in FRAME], object)
    items = np.array([r[1] for r in FRAME], object)
    ts_ms = np.array([r[2] for r in FRAME]) * 1000
    rating = np.array([r[3] for r in FRAME], float)
    user_attrs = {"a": {"gender": "F", "age": 25, "zip": "48067"}, "b": {"gender": "M", "age": 1}}
    item_attrs = {f"i{k}": {"year": 1990 + k, "genres": ["Drama"] if k % 2 else ["Comedy", "Crime"]}
                  for k in range(1, 10)}
    return Ratings.from_raw(users, items, rating, ts_ms, user_attrs, item_attrs, dataset="toy")


def test_sample_batch_carries_hashed_features_as_the_joiner_does() -> None:
    r = _frame_ratings()
    assert r.ts_ms.tolist() == sorted(r.ts_ms.tolist())  # event-time order
    keep, label = autoint_labels(r.rating)
    rows = np.flatnonzero(keep)
    cfg = EvalConfig()
    sb = build_samples(r, rows, label[rows], "default", cfg)
    assert len(sb) == len(rows) == 8
    user_ids, item_ids = sb.column("user_id"), sb.column("item_id")
    values, offsets = sb.lists("history")
    first_a = [k for k in range(len(sb)) if user_ids[k] == hash_value("a")]
    # every history item is a hashed item id the same user rated >= 4 strictly earlier
    for k in range(len(sb)):
        hist = set(values[offsets[k]:offsets[k + 1]].tolist())
        assert item_ids[k] not in hist
        earlier = {item_ids[j] for j in range(len(sb)) if user_ids[j] == user_ids[k]
                   and sb.column("ts")[j] < sb.column("ts")[k] and sb.column("label")[j] == 1}
        assert hist <= earlier
    last_a = first_a[-1]  # a@60: i1, i3, i2, i5
    assert values[offsets[last_a]:offsets[last_a + 1]].tolist() == [hash_value(x) for x in ("i1", "i3", "i2", "i5")]
    gender = sb.column("ctx.gender")
    assert {gender[k] for k in first_a} == {hash_value("F")}
    zips = sb.column("ctx.zip")
    assert {zips[k] for k in range(len(sb)) if k not in first_a} == {0}  # b has no zip: MISSING
    g_values, g_offsets = sb.lists("ctx.genres")
    assert g_values[g_offsets[0]:g_offsets[1]].tolist() in ([hash_value("Drama")],
                                                           [hash_value("Comedy"), hash_value("Crime")])
    hours = request_time(sb.column("ts"), cfg.request_time)
    assert sb.column("ctx.request_time").tolist() == [hash_value(int(h)) for h in hours]
    assert sb.impression_ids[0].startswith("toy-")
    paper = build_samples(r, rows, label[rows], "paper", cfg)
    assert len(paper.lists("history")[0]) == 0
    names = [f.name for f in feature_config("paper", cfg).fields]
    assert names == ["ctx.gender", "ctx.age", "ctx.occupation", "ctx.zip", "ctx.request_time", "ctx.year", "ctx.genres"]
    assert [f.name for f in feature_config("default", cfg).fields][:3] == ["user_id", "item_id", "history"]


def test_build_samples_applies_the_configured_history_delay() -> None:
    r = _frame_ratings()  # FRAME: user a rates positives at 10, 20, 20, 40, 60 s
    rows = np.arange(len(r))
    label = online_labels(r.rating)
    values, offsets = build_samples(r, rows, label, "default", EvalConfig(history_delay_s=25.0)).lists("history")
    a60 = int(np.flatnonzero(r.ts_ms == 60_000)[0])
    # i1 (10 s) and i3, i2 (20 s) entered by 45 s; i5 (40 s) only at 65 s, after the rating at 60 s
    assert values[offsets[a60]:offsets[a60 + 1]].tolist() == [hash_value(x) for x in ("i1", "i3", "i2")]
    with pytest.raises(ValueError, match="history_delay_s"):
        EvalConfig(history_delay_s=-1.0)


def test_config_overrides_are_checked() -> None:
    cfg = resolve_config("autoint", "paper", {"embedding_dim": 8, "mlp": [32]}, epochs=2)
    assert (cfg.embedding_dim, cfg.mlp, cfg.epochs) == (8, (32,), 2)
    assert resolve_config("online", "default").history_delay_s == 0.0  # the README's figures: no delay
    with pytest.raises(ValueError, match="unknown evaluation settings"):
        resolve_config("autoint", "paper", {"embeding_dim": 8})
    with pytest.raises(ValueError, match="protocol"):
        evaluate("ml-1m", "kfold", "paper")


# -- end to end on a subsample ----------------------------------------------------------------
@needs_ml1m
def test_autoint_protocol_learns_on_a_subsample() -> None:
    # 25 k ratings (AUC 0.82, logloss 0.39 here: far from the bounds; 50 k took twice as long for no more proof)
    d = evaluate("ml-1m", "autoint", "default", seed=0, epochs=2, limit=25_000, config=SMALL)
    assert d["n_train"] + d["n_valid"] + d["n_test"] < 25_000
    assert d["n_train"] == (d["n_train"] + d["n_valid"] + d["n_test"]) * 8 // 10
    assert d["auc"] > 0.6 and d["logloss"] < 0.69
    assert d["fields"][:3] == ["user_id", "item_id", "history"] and d["config"]["epochs"] == 2
    again = evaluate("ml-1m", "autoint", "default", seed=0, epochs=1, limit=2_000, config=SMALL)
    assert again["n_test"] == evaluate("ml-1m", "autoint", "paper", seed=0, epochs=1, limit=2_000,
                                       config=SMALL)["n_test"]


@needs_ml1m
def test_online_protocol_learns_on_a_subsample() -> None:
    d = evaluate("ml-1m", "online", "default", seed=0, limit=50_000, config=SMALL)
    assert d["n_samples"] == 50_000 and d["n_last"] == 10_000
    assert d["auc"] > 0.6 and d["last_auc"] > 0.6


def test_platt_scaling_recovers_a_known_miscalibration_and_keeps_the_order() -> None:
    rng = np.random.default_rng(0)
    z = rng.normal(0, 2, 200_000)
    y = (rng.random(len(z)) < 1 / (1 + np.exp(-z))).astype(np.float64)  # true logits z
    over = 1 / (1 + np.exp(-(2.5 * z - 0.7)))  # over-confident and shifted
    a, b = fit_platt(over, y)
    assert a == pytest.approx(1 / 2.5, rel=0.05) and b == pytest.approx(0.7 / 2.5, abs=0.03)
    fixed = apply_platt(over, (a, b))
    assert logloss(fixed, y) < logloss(over, y) - 0.05
    inner = (over > 1e-6) & (over < 1 - 1e-6)  # away from the clipping: a strictly increasing map
    assert np.all(np.diff(fixed[inner][np.argsort(over[inner])]) >= 0)


# -- the delayed protocol (learner/evaluation/delayed.py) --------------------------------------------------
# The policies' plumbing on 10 k ratings (40 steps), with a bias at 0 and no Adagrad starting sum: the daemon's
# defaults (BaseRateBias, initial_accumulator) start slower on so short a stream (served AUC 0.548 under `wait`).
# One torch thread (EvalConfig's default is 2): under `pytest -n 2` on 2 cores two workers' 2 threads each
# oversubscribe the cores and these small steps slowed 3-8x (the cold-start test: 2.8 s alone, 9-22 s beside another).
DELAYED_SMALL = {"mlp": (32,), "id_buckets": 20_000, "zip_buckets": 20_000, "ctx_buckets": 2_000, "batch_size": 256,
                 "init_bias": False, "initial_accumulator": 0.0, "threads": 1}


@pytest.mark.parametrize("emission", ["wait", "window", "fake_negative", "es_dfm"])
def test_delayed_protocol_serves_every_impression_once_and_trains_what_the_policy_emits(emission: str) -> None:
    n = 10_000
    d = evaluate("ml-1m", "delayed", "default", seed=0, limit=n, config={**DELAYED_SMALL, "emission": emission})
    assert d["served"]["n"] == n and d["served_last"]["n"] == n // 5
    assert d["served_cold"]["n"] + d["served_warm"]["n"] == n
    positives = round(d["positive_rate"] * n)
    if emission in ("wait", "window"):
        assert d["emitted_samples"] == n and d["delayed_positives"] == 0
    else:  # every clicked impression that was not clicked by its observation comes again as a delayed positive
        assert d["emitted_samples"] == n + d["delayed_positives"]
        assert 0 < d["delayed_positives"] <= positives
        if emission == "fake_negative":
            assert d["delayed_positives"] == positives
    assert d["served"]["auc"] > 0.55 and math.isfinite(d["served"]["ne"])  # learns something (0.5: nothing)


def test_delayed_protocol_is_deterministic_and_the_window_policy_trains_a_window_late() -> None:
    a = evaluate("ml-1m", "delayed", "default", seed=0, limit=8_000, config={**DELAYED_SMALL, "emission": "window"})
    b = evaluate("ml-1m", "delayed", "default", seed=0, limit=8_000, config={**DELAYED_SMALL, "emission": "window"})
    assert a["served"] == b["served"]
    w = evaluate("ml-1m", "delayed", "default", seed=0, limit=8_000, config={**DELAYED_SMALL, "emission": "wait"})
    assert a["click_to_model_s"]["p50"] > w["click_to_model_s"]["p50"]  # window: a click waits for its window


def test_evaluate_leaves_the_callers_torch_generator_as_it_was_and_is_the_same_given_its_seed() -> None:
    """Dropout draws from torch's global generator: an evaluation seeded it and left the caller's stream changed."""
    small = {"mlp": (16,), "dropout": 0.3, "batch_size": 256, "syn_impressions": 2_000, "threads": 1}
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = evaluate("synthetic", "delayed", config=small, seed=0)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(456)  # another caller stream: the evaluation's draws come from its own seed alone
    b = evaluate("synthetic", "delayed", config=small, seed=0)
    assert a["served"] == b["served"]


def test_cold_start_variants_run_through_the_delayed_protocol() -> None:
    from learner.cold_start import evaluate_cold_start

    d = evaluate_cold_start("ml-1m", 0, config={"mlp": (16,), "emission": "fake_negative", "ctx_buckets": 2_000,
                                                "threads": 1},  # as DELAYED_SMALL's
                            limit=6_000, protocol="delayed")
    assert d["protocol"] == "cold-start/delayed" and set(d["variants"]) == {"zero", "buckets", "admission"}
    for v in d["variants"].values():
        assert v["all"]["samples"] == 6_000 and v["cold"]["samples"] == d["cold_samples"]


def test_platt_on_separable_scores_does_not_saturate_them() -> None:
    """On a valid split whose scores separate the labels the logloss falls without end as ``a`` grows: the fit
    returned a = 1151, which served every test probability as 0 or 1 (a miss there costs ~16 nats). Platt's
    targets, (N+ + 1) / (N+ + 2) and 1 / (N- + 2), bound it."""
    rng = np.random.default_rng(1)
    p = rng.random(100)
    y = (p > 0.5).astype(np.float64)
    a, b = fit_platt(p, y)
    fitted = apply_platt(p, (a, b))
    assert 0 < a < 10 and np.mean((fitted > 1e-3) & (fitted < 1 - 1e-3)) > 0.5  # a = 1151: none


@pytest.mark.parametrize("labels", ["all_positive", "all_negative", "one_sample", "backwards", "nan_score"])
def test_platt_keeps_the_identity_where_the_valid_split_cannot_support_a_fit(labels: str) -> None:
    """A map fitted on one class, one sample or scores that rank backwards would invert the ranking or flatten it
    (all positives: a = -0.03, b = 26.6; backwards: a = -1155), and one NaN score made (a, b) NaN: the fit keeps
    the identity, and skips non-finite scores."""
    rng = np.random.default_rng(2)
    p = rng.random(200)
    y = (rng.random(200) < p).astype(np.float64)
    p, y = {"all_positive": (p, np.ones(200)), "all_negative": (p, np.zeros(200)), "one_sample": (p[:1], y[:1]),
            "backwards": (p, (p < 0.5).astype(np.float64)), "nan_score": (np.append(p, np.nan), np.append(y, 1.0)),
            }[labels]
    a, b = fit_platt(p, y)
    if labels == "nan_score":
        assert (a, b) == pytest.approx(fit_platt(p[:-1], y[:-1])) and 0 < a < 4
    else:
        assert (a, b) == (1.0, 0.0)


def test_evaluate_reseeds_no_accelerator_generator_of_its_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    """The evaluation runs on the CPU and forks only the CPU generator (``fork_rng(devices=[])``); seeded with
    ``torch.manual_seed`` it also reseeded every CUDA (and MPS, XPU) generator of the caller, never put back: a caller
    training on a GPU had its stream changed. (This machine has no GPU: the seeders are watched instead.)"""
    reseeded: list[str] = []
    for name, module in (("cuda", torch.cuda), ("mps", torch.mps), ("xpu", torch.xpu)):
        for fn in ("manual_seed", "manual_seed_all"):
            if hasattr(module, fn):
                monkeypatch.setattr(module, fn, lambda *_, _n=f"{name}.{fn}": reseeded.append(_n))
    small = {"mlp": (16,), "dropout": 0.3, "batch_size": 256, "syn_impressions": 2_000, "threads": 1}
    evaluate("synthetic", "delayed", config=small, seed=0)
    assert reseeded == []
