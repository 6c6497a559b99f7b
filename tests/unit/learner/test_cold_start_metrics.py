"""The cold-start metrics the learner exports, read the way ``streamrec monitor`` reads them: the packaged default
rules (``monitor/default_rules.toml``) evaluated over this process's Prometheus text, so each test shows what an
operator's alert does, not only what a gauge holds."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY, generate_latest

from learner.quality import BUCKET_SHARE, COLD_AUC, COLD_LOGLOSS, WARM_AUC, IdMetrics, TrainingQuality
from learner.row_mapper import MapStats
from monitor.alerts import AlertState
from monitor.rule_engine import RuleEngine
from monitor.rules import load_rules
from monitor.scrape import Snapshot


def default_rule(name: str) -> RuleEngine:
    rules = [r for r in load_rules().rules if r.name == name]
    assert rules, f"no rule {name!r} in the packaged default rules"
    return RuleEngine(rules, history_s=max(r.for_s for r in rules) + 60)


def scraped() -> Snapshot:
    """This process's metrics as the monitor's scrape of the learner parses them."""
    return Snapshot.from_texts({"learner": generate_latest(REGISTRY).decode()})


def fired(engine: RuleEngine, seconds: float, step_s: float = 60.0) -> list[str]:
    """The rules that fired while the monitor scraped every ``step_s`` for ``seconds``."""
    out = []
    for k in range(int(seconds / step_s) + 1):
        out += [a.rule for a in engine.evaluate(scraped(), k * step_s) if a.state is AlertState.FIRING]
    return out


def test_a_learner_that_counts_no_user_as_cold_does_not_fire_the_cold_user_auc_gap() -> None:
    # cold_k = 0 ("no sample is cold", learner/config.py): there is no cold-user AUC at all, so no gap to alert on.
    # The cold gauges used to stay at the 0 a fresh process exports, and warm AUC - 0 fired cold_user_auc_gap after
    # its 10 minutes on every such learner, however well it ranked.
    for g in (COLD_AUC, COLD_LOGLOSS, WARM_AUC):
        g.set(0.0)  # as a fresh process exports them
    q = TrainingQuality(cold_k=0, metrics_window=1000, attribution_window_s=1800.0, recent_s=3600.0, min_recent=100,
                        cold_capacity=1000)
    rng = np.random.default_rng(0)
    labels = (rng.random(500) < 0.3).astype(np.float64)
    probs = np.clip(0.3 + 0.4 * (labels - 0.3) + 0.05 * rng.standard_normal(500), 0.01, 0.99)  # a good ranker
    users = rng.integers(0, 50, 500)
    cold = q.cold_of(users, 0.0, None)
    assert cold is not None and not cold.any()
    q.record(np.array([f"i{k}" for k in range(500)]), np.arange(500) + 1_700_000_000_000, None, labels, probs,
             cold, None, np.zeros(500), now_s=1_700_000_000.5)
    assert 0.9 < WARM_AUC._value.get() <= 1.0  # the warm users' AUC is published
    assert fired(default_rule("cold_user_auc_gap"), 900) == []


def burst_of_new_users(rounds: int) -> list[MapStats]:
    """What the id maps count while every user is brand new: each round's 100 user lookups all on a bucket."""
    return [MapStats(lookups={"user_id": 100, "item_id": 100}, bucket_lookups={"user_id": 100, "item_id": 5},
                     admitted={"user_id": 0, "item_id": 2}, evicted={"user_id": 0, "item_id": 0})
            for _ in range(rounds)]


def test_the_distributed_learner_publishes_the_bucket_share_the_cold_start_alert_reads() -> None:
    # The sharded daemon's rank 0 counted lookups, admissions, evictions and occupancy but never set
    # streamrec_learner_bucket_share, the only input of cold_start_share: on N ranks that rule could not fire. Its
    # _observe_ids is called here on the state it reads (rank 0, the sharded mapper's occupancy).
    from learner.sharded_daemon import ShardedLearner

    BUCKET_SHARE.clear()  # as a fresh process exports it: no series before the first lookups
    rank0 = SimpleNamespace(ctx=SimpleNamespace(rank=0), ids=SimpleNamespace(occupancy={"user_id": 0.0}),
                            id_metrics=IdMetrics(metrics_window=1000))
    engine = default_rule("cold_start_share")
    alerts = []
    for k, st in enumerate(burst_of_new_users(8)):
        ShardedLearner._observe_ids(rank0, st)  # type: ignore[arg-type]
        alerts += [(a.labels.get("field"), a.state) for a in engine.evaluate(scraped(), k * 60.0)]
    assert alerts == [("user_id", AlertState.FIRING)]  # after for_s = 300 s; item ids stay admitted


def test_one_process_and_rank_0_of_n_publish_the_same_bucket_share() -> None:
    # One definition (learner.quality.IdMetrics) for both daemons: the same counts give the same share.
    from learner.daemon import Learner
    from learner.sharded_daemon import ShardedLearner

    rounds = burst_of_new_users(3) + [MapStats(lookups={"user_id": 40}, bucket_lookups={"user_id": 4})] * 2
    shares = []
    for observe, owner in ((Learner._observe_ids, "mapper"), (ShardedLearner._observe_ids, "ids")):
        BUCKET_SHARE.clear()
        me = SimpleNamespace(ctx=SimpleNamespace(rank=0), id_metrics=IdMetrics(metrics_window=1000),
                             **{owner: SimpleNamespace(occupancy={}, stats=lambda: {})})
        for st in rounds:
            observe(me, st)  # type: ignore[arg-type]
        shares.append(BUCKET_SHARE.labels("user_id")._value.get())
    # 3 rounds of 100 all-bucket lookups (share 1), then 2 of 40 at 0.1, each weighing 40/100 of the window
    assert shares[0] == shares[1] == pytest.approx(1 - 0.9 * (1 - 0.6 ** 2))


def _learner_with_dynamic_ids(tmp_path: Path, daemon: str, **settings: Any) -> Any:
    """A single-process ``Learner`` or a one-rank ``ShardedLearner`` (rank 0 of N: the same code path) with its
    model built, whose Kafka is never contacted (no offsets to commit). ``settings``: more ``[learner]`` settings."""
    from learner.config import LearnerSettings
    from learner.features import default_config
    from stream.config import KafkaSettings

    ls = LearnerSettings(**{"checkpoint_dir": tmp_path / "ckpt", "mlp": "8", "buckets": 16, "ctx_buckets": 8,
                            "embedding_dim": 4, "id_capacity": 50, "admit_after": 5, **settings})
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9")
    cfg = default_config({}, buckets=ls.buckets, ctx_buckets=ls.ctx_buckets, embedding_dim=ls.embedding_dim,
                         id_capacity=ls.id_capacity, admit_after=ls.admit_after)
    if daemon == "one process":
        from learner.daemon import Learner

        learner = Learner(kafka, ls)
        learner._build(cfg, learner._model_settings())
    else:
        from learner.distributed import RankContext
        from learner.sharded_daemon import ShardedLearner

        learner = ShardedLearner(kafka, ls, RankContext())
        learner._build(cfg)
    return learner



@pytest.mark.parametrize("daemon", ["one process", "rank 0 of N"])
def test_a_restarted_learner_keeps_a_firing_cold_start_share_firing_without_a_resolve(
        tmp_path: Path, request: pytest.FixtureRequest, daemon: str) -> None:
    # The bucket share lived only in memory: a restarted learner exported no streamrec_learner_bucket_share until
    # its first batch, the monitor resolved the firing cold_start_share on that gap and fired it again a for_s
    # (5 minutes) later. It is checkpoint state now, published at restore, before any batch.
    if daemon == "rank 0 of N":
        request.getfixturevalue("one_rank_group")
    BUCKET_SHARE.clear()
    first = _learner_with_dynamic_ids(tmp_path, daemon)
    engine = default_rule("cold_start_share")
    alerts = []
    try:
        for k, st in enumerate(burst_of_new_users(7)):
            first._observe_ids(st)
            alerts += [(a.labels.get("field"), a.state) for a in engine.evaluate(scraped(), k * 60.0)]
        assert alerts == [("user_id", AlertState.FIRING)]
        first.save()
    finally:
        first.close()
    BUCKET_SHARE.clear()  # the restarted process: no series of its own yet
    again = _learner_with_dynamic_ids(tmp_path, daemon)
    try:
        assert again._restore()
        after = [(a.labels.get("field"), a.state) for k in range(7, 15)
                 for a in engine.evaluate(scraped(), k * 60.0)]  # the monitor scrapes it before its first batch
        assert after == []  # still firing: neither resolved nor fired again
        assert engine.firing() and BUCKET_SHARE.labels("user_id")._value.get() == pytest.approx(
            first.id_metrics.bucket_share["user_id"])
    finally:
        again.close()
    if daemon == "rank 0 of N":  # and a reshard to one process (learner/sharded_checkpoint.unshard) keeps it
        from learner import checkpoint, sharded_checkpoint

        single = sharded_checkpoint.unshard(tmp_path / "ckpt", tmp_path / "single")
        assert checkpoint.load(single)["id_metrics"] == first.id_metrics.state_dict()


def test_a_checkpoint_without_the_bucket_share_loads_with_none_until_the_first_lookups() -> None:
    # Checkpoints written before the share was kept have no "id_metrics": no series, as a fresh learner's.
    BUCKET_SHARE.clear()
    m = IdMetrics(metrics_window=1000)
    m.load_state_dict({})
    assert m.bucket_share == {} and "streamrec_learner_bucket_share{" not in generate_latest(REGISTRY).decode()
    m.observe(burst_of_new_users(1)[0], {})
    assert BUCKET_SHARE.labels("user_id")._value.get() == 1.0


@pytest.mark.parametrize("shares", [{"user_id": "0.3"}, {"user_id": True}, {"user_id": 1.5},
                                    {"user_id": float("nan")}, [0.3]])
def test_a_checkpointed_bucket_share_that_is_no_share_is_refused_naming_it(shares: object) -> None:
    """``float()`` read a damaged checkpoint's ``"0.3"`` as 0.3 and ``true`` as 1.0 (every lookup in a bucket: the
    cold-start alert's input), and published a share of 1.5 or NaN as it was."""
    with pytest.raises(ValueError, match='id metrics state: "bucket_share" is'):
        IdMetrics(metrics_window=1000).load_state_dict({"bucket_share": shares})


T0_MS = 1_700_000_000_000  # event time of the first sample


def _minute(q: TrainingQuality, minute: int, cold_rows: int, warm_rows: int, rng: np.random.Generator) -> None:
    """One minute of event time's samples into ``q``: cold users ranked at random, warm users ranked well."""
    n = cold_rows + warm_rows
    labels = (rng.random(n) < 0.3).astype(np.float64)
    good = np.clip(0.3 + 0.4 * (labels - 0.3) + 0.05 * rng.standard_normal(n), 0.01, 0.99)
    cold = np.arange(n) < cold_rows
    probs = np.where(cold, rng.random(n), good)
    ts = T0_MS + minute * 60_000 + np.sort(rng.integers(0, 60_000, n))
    q.record(np.array([f"m{minute}-{k}" for k in range(n)]), ts, None, labels, probs, cold, None, np.zeros(n),
             now_s=float(ts[-1]) / 1000)


def test_a_quiet_night_without_new_users_does_not_keep_the_cold_user_auc_gap_firing_on_the_evenings_samples(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The cold window held the last metrics_window // 10 cold samples however old: with no new user all night, the
    # evening's gap stayed in streamrec_learner_cold_auc and cold_user_auc_gap fired till morning on a model that had
    # trained on all night. Now the window says NaN (no data) once fewer than [learner] quality_min_samples of its
    # samples are within quality_recent_s of event time (the defaults here): the alert resolves and stays quiet.
    import learner.quality
    from learner.config import LearnerSettings

    monkeypatch.setattr(learner.quality, "_PUBLISH_EVERY_S", 0.0)  # each call below stands for a minute
    ls = LearnerSettings()
    q = TrainingQuality(cold_k=10, metrics_window=10_000, attribution_window_s=1800.0,
                        recent_s=ls.quality_recent_s, min_recent=ls.quality_min_samples,
                        cold_capacity=1000)
    engine = default_rule("cold_user_auc_gap")
    rng = np.random.default_rng(3)
    states = []
    for minute in range(5 * 60):  # the monitor scrapes once a minute of event time
        evening = minute < 30
        _minute(q, minute, cold_rows=40 if evening else 0, warm_rows=120 if evening else 20, rng=rng)
        states += [(minute, a.state) for a in engine.evaluate(scraped(), minute * 60.0)]
    # fired on the evening's real gap: measured from minute 12 (the 500th cold sample: 40 a minute), firing its for_s
    # of 10 minutes later; resolved within quality_recent_s of the last cold sample (minute 29), once fewer than
    # quality_min_samples cold samples were that recent; never again
    assert [s for _, s in states] == [AlertState.FIRING, AlertState.RESOLVED]
    assert states[0][0] == 22 and 29 < states[1][0] <= 29 + ls.quality_recent_s / 60 + 1
    assert np.isnan(COLD_AUC._value.get()) and 0.8 < WARM_AUC._value.get() <= 1.0  # warm users are still measured


def test_a_cold_window_of_recent_samples_keeps_measuring_through_a_quiet_hour_with_a_few_new_users(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The horizon must not blind the rule to a real gap: a steady trickle of cold samples (more than
    # quality_min_samples an hour) keeps the cold AUC measured, and the gap keeps firing.
    import learner.quality
    from learner.config import LearnerSettings

    monkeypatch.setattr(learner.quality, "_PUBLISH_EVERY_S", 0.0)
    ls = LearnerSettings()
    q = TrainingQuality(cold_k=10, metrics_window=10_000, attribution_window_s=1800.0,
                        recent_s=ls.quality_recent_s, min_recent=ls.quality_min_samples,
                        cold_capacity=1000)
    engine = default_rule("cold_user_auc_gap")
    rng = np.random.default_rng(4)
    states = []
    for minute in range(3 * 60):
        _minute(q, minute, cold_rows=40 if minute < 30 else 10, warm_rows=100, rng=rng)  # 600 cold samples an hour
        states += [a.state for a in engine.evaluate(scraped(), minute * 60.0)]
    assert states == [AlertState.FIRING] and not np.isnan(COLD_AUC._value.get())


def test_cold_and_warm_windows_restored_from_a_checkpoint_without_event_times_count_as_not_recent() -> None:
    # Checkpoints written before the windows kept their samples' event times still load: those samples have no
    # known time, so they are never recent (no data until quality_min_samples recent ones arrive), and the window's
    # samples themselves are kept.
    from learner.progressive import ProgressiveMetrics

    old = ProgressiveMetrics(window=100)
    rng = np.random.default_rng(5)
    labels = (rng.random(80) < 0.5).astype(np.float64)
    old.update(rng.random(80), labels)
    state = old.state_dict()
    assert "window_ts" not in state
    m = ProgressiveMetrics(window=100, timed=True)
    m.load_state_dict(state)
    assert np.isnan(m.window_metrics(since_ms=0.0, min_samples=10)[0])
    assert m.window_metrics() == old.window_metrics()  # all of the window, as before
    m.update(rng.random(20), (np.arange(20) % 2).astype(np.float64), ts_ms=np.full(20, 5_000.0))
    assert not np.isnan(m.window_metrics(since_ms=0.0, min_samples=10)[0])
    again = ProgressiveMetrics(window=100, timed=True)
    again.load_state_dict(m.state_dict())  # and the times round-trip through the state
    assert again.window_metrics(since_ms=0.0, min_samples=10) == m.window_metrics(since_ms=0.0, min_samples=10)


def _served_minute(q: TrainingQuality, minute: int, rows: int, good: bool, rng: np.random.Generator,
                   ) -> tuple[np.ndarray, np.ndarray]:
    """One minute of event time's final samples into ``q`` (every row served and labelled at once), ranked well or at
    random; returns their (probs, labels)."""
    labels = (rng.random(rows) < 0.3).astype(np.float64)
    probs = (np.clip(0.3 + 0.4 * (labels - 0.3) + 0.05 * rng.standard_normal(rows), 0.01, 0.99) if good
             else rng.random(rows))
    ts = T0_MS + minute * 60_000 + np.sort(rng.integers(0, 60_000, rows))
    q.record(np.array([f"s{minute}-{k}" for k in range(rows)]), ts, None, labels, probs, np.ones(rows, bool), None,
             np.zeros(rows), now_s=float(ts[-1]) / 1000)
    return probs, labels


def test_the_served_auc_counts_only_samples_of_the_last_quality_recent_s_and_reads_nan_below_quality_min_samples(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # streamrec_learner_served_auc (and ..._served_cold_auc) read their whole window however old: after a quiet night
    # they still published the evening's served quality. Now they are bounded as the cold/warm windows: only the
    # samples whose label became known in the last quality_recent_s count, NaN while fewer than quality_min_samples.
    import learner.quality
    from learner.config import LearnerSettings
    from learner.progressive import auc
    from learner.quality import SERVED_AUC, SERVED_COLD_AUC

    monkeypatch.setattr(learner.quality, "_PUBLISH_EVERY_S", 0.0)
    ls = LearnerSettings()
    q = TrainingQuality(cold_k=10, metrics_window=100_000, attribution_window_s=1800.0,
                        recent_s=ls.quality_recent_s, min_recent=ls.quality_min_samples,
                        cold_capacity=1000)
    rng = np.random.default_rng(6)
    for minute in range(30):  # the evening: 100 samples a minute, ranked well
        _served_minute(q, minute, 100, good=True, rng=rng)
    assert 0.9 < SERVED_AUC._value.get() <= 1.0
    recent: list[tuple[np.ndarray, np.ndarray]] = []
    for minute in range(30, 30 + 2 * 60):  # then 20 a minute ranked at random: 1,200 an hour
        recent.append(_served_minute(q, minute, 20, good=False, rng=rng))
    # the last hour's samples only (all served samples are cold here: the cold window is a tenth, 10,000, as big)
    probs, labels = (np.concatenate(x) for x in zip(*recent[-60:], strict=True))
    for gauge in (SERVED_AUC, SERVED_COLD_AUC):
        assert gauge._value.get() == pytest.approx(auc(probs, labels), abs=0.02)
        assert gauge._value.get() < 0.6  # the evening's well-ranked samples no longer count
    for minute in range(150, 150 + 2 * 60):  # a quiet night: 5 a minute, 300 an hour < quality_min_samples
        _served_minute(q, minute, 5, good=False, rng=rng)
    assert np.isnan(SERVED_AUC._value.get()) and np.isnan(SERVED_COLD_AUC._value.get())
    assert q.served.all.count == 30 * 100 + 120 * 20 + 120 * 5  # cumulative metrics still count everything


def test_the_served_ne_reads_the_last_quality_recent_s_so_a_model_gone_bad_fires_without_waiting_for_days(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # streamrec_learner_served_ne (the critical served_worse_than_base_rate rule: NE >= 1) was cumulative since the
    # start: after a long good run, an hour of predictions no better than chance left it far below 1. It now reads the
    # served AUC's samples: the last quality_recent_s, NaN below quality_min_samples.
    import learner.quality
    from learner.progressive import normalized_entropy
    from learner.quality import SERVED_NE

    monkeypatch.setattr(learner.quality, "_PUBLISH_EVERY_S", 0.0)
    q = TrainingQuality(cold_k=10, metrics_window=100_000, attribution_window_s=1800.0, recent_s=3600.0,
                        min_recent=1000, cold_capacity=1000)
    rng = np.random.default_rng(8)
    for minute in range(60):  # a good hour, 1,000 samples a minute
        _served_minute(q, minute, 1000, good=True, rng=rng)
    assert SERVED_NE._value.get() < 0.9
    recent = [_served_minute(q, minute, 20, good=False, rng=rng) for minute in range(60, 60 + 2 * 60)]
    probs, labels = (np.concatenate(x) for x in zip(*recent[-60:], strict=True))
    assert SERVED_NE._value.get() == pytest.approx(normalized_entropy(probs, labels), rel=0.05)
    assert SERVED_NE._value.get() >= 1.0  # the rule fires on the bad hour ...
    assert q.served.all.ne < 0.9  # ... which the cumulative NE (still in the summary) hides
    for minute in range(180, 180 + 60):  # too few recent samples: no data
        _served_minute(q, minute, 5, good=False, rng=rng)
    assert np.isnan(SERVED_NE._value.get())


def test_the_served_windows_keep_when_their_samples_labels_became_known_across_a_checkpoint() -> None:
    # The served windows' event times are checkpoint state like the cold and warm ones' (window_ts): a restarted
    # learner reads the same recent served quality; a state saved before them loads its samples as never recent.
    rng = np.random.default_rng(7)
    q = TrainingQuality(cold_k=10, metrics_window=1000, attribution_window_s=1800.0, recent_s=3600.0, min_recent=50,
                        cold_capacity=1000)
    for minute in range(90):
        _served_minute(q, minute, 20, good=True, rng=rng)
    now_s = (T0_MS + 90 * 60_000) / 1000
    before = q.recent_metrics(q.served.all, now_s)
    assert not np.isnan(before[0])
    again = TrainingQuality(cold_k=10, metrics_window=1000, attribution_window_s=1800.0, recent_s=3600.0,
                            min_recent=50, cold_capacity=1000)
    state = q.state_dict()
    assert len(state["served"]["all"]["window_ts"]) == len(state["served"]["all"]["window_probs"]) == 1000
    again.load_state_dict(state)
    assert again.recent_metrics(again.served.all, now_s) == before
    assert again.recent_metrics(again.served.cold, now_s) == q.recent_metrics(q.served.cold, now_s)
    for key in ("all", "cold"):
        del state["served"][key]["window_ts"]  # as saved before the served windows kept their times
    older = TrainingQuality(cold_k=10, metrics_window=1000, attribution_window_s=1800.0, recent_s=3600.0,
                            min_recent=50, cold_capacity=1000)
    older.load_state_dict(state)
    assert np.isnan(older.recent_metrics(older.served.all, now_s)[0])


@pytest.mark.parametrize("daemon", ["one process", "rank 0 of N"])
def test_cold_tracker_capacity_from_the_config_file_and_the_environment_sizes_the_learners_cold_tracker(
        tmp_path: Path, request: pytest.FixtureRequest, daemon: str) -> None:
    # The cold tracker held a fixed 1 M users (175 MiB) whatever the deployment; [learner] cold_tracker_capacity sizes
    # it now, in the file or STREAMREC_LEARNER_COLD_TRACKER_CAPACITY (the environment wins), default as before.
    from learner.config import LearnerSettings
    from streamrec.settings import SettingsError, build

    if daemon == "rank 0 of N":
        request.getfixturevalue("one_rank_group")
    assert LearnerSettings().cold_tracker_capacity == 1_000_000
    from_file = build(LearnerSettings, "learner", {"learner": {"cold_tracker_capacity": 3000}}, environ={})
    from_env = build(LearnerSettings, "learner", {"learner": {"cold_tracker_capacity": 3000}},
                     environ={"STREAMREC_LEARNER_COLD_TRACKER_CAPACITY": "2048"})
    assert (from_file.cold_tracker_capacity, from_env.cold_tracker_capacity) == (3000, 2048)
    learner = _learner_with_dynamic_ids(tmp_path, daemon, cold_tracker_capacity=from_env.cold_tracker_capacity)
    try:
        assert learner.quality.cold.capacity == 2048
    finally:
        learner.close()
    for bad in (0, -1, "many"):
        with pytest.raises(SettingsError, match="cold_tracker_capacity"):
            build(LearnerSettings, "learner", {"learner": {"cold_tracker_capacity": bad}}, environ={})


def test_a_full_cold_tracker_forgets_its_least_recently_seen_warm_users_and_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    # Full, the tracker's id map evicts the least recently seen warm users, who are then cold again; that was silent.
    # Now each eviction counts in streamrec_learner_cold_tracker_evictions_total, and the first is logged, once.
    from learner.quality import COLD_TRACKER_EVICTIONS

    q = TrainingQuality(cold_k=1, metrics_window=1000, attribution_window_s=1800.0, recent_s=3600.0, min_recent=10,
                        cold_capacity=64)
    before = COLD_TRACKER_EVICTIONS._value.get()
    for t in range(8):  # 64 users, 8 a second, 2 impressions each: the first cold, the second warm
        cold = q.cold_of(np.repeat(np.arange(8 * t, 8 * t + 8), 2), float(t), None)
        assert cold is not None and cold.tolist() == [True, False] * 8
    assert COLD_TRACKER_EVICTIONS._value.get() == before and q.cold.evictions == 0  # exactly full
    with caplog.at_level("WARNING", logger="streamrec.train"):
        for t in range(8, 11):  # 3 x 8 new users become warm: the tracker makes room
            cold = q.cold_of(np.repeat(np.arange(8 * t, 8 * t + 8), 2), float(t), None)
            assert cold is not None and cold.tolist() == [True, False] * 8
    assert q.cold.evictions >= 24
    assert COLD_TRACKER_EVICTIONS._value.get() - before == q.cold.evictions
    full = [r for r in caplog.records if "cold tracker is full" in r.getMessage()]
    assert len(full) == 1 and "cold_tracker_capacity = 64" in full[0].getMessage()
    again = q.cold_of(np.array([0, 87]), 11.0, None)  # user 0 was seen first (forgotten); 87 last (remembered)
    assert again is not None and again.tolist() == [True, False]


def test_the_time_to_admission_histogram_counts_each_admission_as_observe_would() -> None:
    from prometheus_client import CollectorRegistry, Histogram

    from learner.quality import TIME_TO_ADMISSION, TIME_TO_ADMISSION_BUCKETS

    delays = np.array([0.0, 1.0, 1.5, 59.9, 60.0, 3600.0, 86400.0, 86401.0, 40 * 86400.0])
    TIME_TO_ADMISSION.clear()
    IdMetrics(metrics_window=1000).observe(MapStats(lookups={"user_id": 9}, bucket_lookups={"user_id": 9},
                                                    admitted={"user_id": 9}, evicted={"user_id": 0},
                                                    time_to_admission={"user_id": delays}), {"user_id": 0.1})
    one_by_one = CollectorRegistry()
    h = Histogram("streamrec_learner_id_time_to_admission_seconds", "", ["field"],
                  buckets=TIME_TO_ADMISSION_BUCKETS, registry=one_by_one)
    for d in delays:
        h.labels("user_id").observe(float(d))
    got = scraped().metrics.get("streamrec_learner_id_time_to_admission_seconds_bucket", {})
    want = Snapshot.from_texts({"learner": generate_latest(one_by_one).decode()}).metrics.get(
        "streamrec_learner_id_time_to_admission_seconds_bucket", {})
    assert want and got == want  # every cumulative bucket, per field, as one observe per admission gives
    sample = REGISTRY.get_sample_value
    assert sample("streamrec_learner_id_time_to_admission_seconds_count", {"field": "user_id"}) == 9
    assert sample("streamrec_learner_id_time_to_admission_seconds_sum", {"field": "user_id"}) == pytest.approx(
        delays.sum())
    TIME_TO_ADMISSION.observe("item_id", np.empty(0))  # nothing admitted: no observation
    assert sample("streamrec_learner_id_time_to_admission_seconds_count", {"field": "item_id"}) == 0


def test_a_learner_with_hash_buckets_only_still_tells_cold_users_from_warm_ones(tmp_path: Path) -> None:
    """``id_capacity = 0`` (no own rows, hash buckets only: a documented setting) keeps ``cold_k``: a user's first
    ``cold_k`` impressions are cold whatever the id rows. The batches of such a static config carried no hashed ids
    (``TensorBatch.keys``), so the learner found no users, counted none cold and none warm, and the cold and warm AUC
    (and the ``cold_user_auc_gap`` alert on them) stayed NaN for good, in silence."""
    from learner.batch import to_tensors
    from learner.config import Device, LearnerSettings
    from learner.daemon import Learner
    from learner.features import default_config
    from stream.config import KafkaSettings
    from stream.samples import SampleBatch

    ls = LearnerSettings(checkpoint_dir=tmp_path / "ck", mlp=(8,), buckets=16, ctx_buckets=5, embedding_dim=4,
                         id_capacity=0, cold_k=2, device=Device.CPU, amp=False)
    cfg = default_config({}, buckets=ls.buckets, embedding_dim=ls.embedding_dim, id_capacity=ls.id_capacity)
    assert not cfg.dynamic
    learner = Learner(KafkaSettings(bootstrap_servers="127.0.0.1:9"), ls)  # never contacted
    try:
        learner._build(cfg, learner._model_settings())
        users = np.repeat(np.arange(10), 4)  # (40,) each user's first 2 impressions cold, the next 2 warm
        n = len(users)
        sb = SampleBatch.from_columns(impression_id=[f"i{k}" for k in range(n)], ts=np.arange(n) * 1000,
                                      label=np.arange(n) % 2, label_delay_ms=np.zeros(n), user_id=users,
                                      item_id=np.arange(n) % 7, history=[[] for _ in range(n)], context={})
        learner._train(to_tensors(sb, cfg))
        assert learner.quality.cold_metrics.count == 20 and learner.quality.warm_metrics.count == 20
    finally:
        learner.close()


def test_a_click_that_comes_after_the_users_next_impressions_counts_with_its_impressions_cold_or_warm() -> None:
    """The cold and warm windows hold every trained sample, a delayed positive (``fake_negative``'s click after its
    impression's observed 0) too, cold when its impression was among the user's first ``cold_k``. It read the user's
    state at the click instead: a new user's session (impressions seconds apart, the click minutes later) had the
    click of its first impression counted warm, moving cold users' positives into the warm window."""
    from stream.samples import DELAYED_POSITIVE, OBSERVED

    q = TrainingQuality(cold_k=2, metrics_window=1000, attribution_window_s=1800.0, recent_s=3600.0, min_recent=1,
                        cold_capacity=100)
    t0 = 1_700_000_000_000

    def train(ids: list[str], kinds: list[int], labels: list[float]) -> None:
        n = len(ids)
        k = np.array(kinds, np.int8)
        ts = np.full(n, t0)
        cold = q.cold_of(np.full(n, 5, np.int64), t0 / 1000, k != DELAYED_POSITIVE)
        q.record(np.array(ids, object), ts, k, np.array(labels), np.full(n, 0.5), cold, None, np.zeros(n, np.int64),
                 now_s=t0 / 1000)

    train(["a"], [OBSERVED], [0.0])  # user 5's first impression: cold
    train(["b", "c"], [OBSERVED, OBSERVED], [0.0, 0.0])  # its second (cold) and third (warm)
    train(["a", "d", "c"], [DELAYED_POSITIVE, OBSERVED, DELAYED_POSITIVE], [1.0, 0.0, 1.0])  # clicks of a (cold), c
    assert (q.cold_metrics.count, q.warm_metrics.count) == (3, 3)  # a, b, a's click | c, d, c's click


def test_a_burst_of_new_items_fires_cold_start_share_for_item_id_whatever_the_users_histories_hold() -> None:
    # The history field shares item_id's rows, and its lookups (read-only: they neither count towards admission nor
    # say anything about new ids) were counted as item_id's: with 48 known items in each user's history (the default
    # history_len is 50), a batch whose candidate items were all brand new read 8 / 392 = 0.02 on buckets, and
    # cold_start_share ("a burst of new ids") could never fire for items.
    from learner.batch import to_tensors
    from learner.features import FeatureConfig, FieldSpec
    from learner.row_mapper import RowMapper
    from stream.samples import SampleBatch

    cfg = FeatureConfig((FieldSpec("user_id", "single", 8, capacity=50, admit_after=2),
                         FieldSpec("item_id", "single", 8, capacity=50, admit_after=2),
                         FieldSpec("history", "sequence", 1, shares="item_id")), embedding_dim=4)
    users, known = list(range(8)), list(range(100, 108))

    def batch(items: list[int], history: list[list[int]], start: int) -> Any:
        n = len(items)
        return to_tensors(SampleBatch.from_columns(
            impression_id=[f"i{start + k}" for k in range(n)], ts=np.arange(start, start + n) * 1000,
            label=np.arange(n) % 2, label_delay_ms=np.zeros(n), user_id=np.array(users), item_id=np.array(items),
            history=history, context={}), cfg)

    mapper, metrics = RowMapper(cfg), IdMetrics(metrics_window=10)  # a window of 1 lookup: the last batch's share
    for k in range(2):  # users and items seen twice: admitted
        mapper.apply(batch(known, [[] for _ in users], 8 * k), now=float(k))
    BUCKET_SHARE.clear()
    st = mapper.apply(batch(list(range(900, 908)), [known * 6 for _ in users], 16), now=2.0)  # new items only
    metrics.observe(st, {})
    assert st.lookups == {"user_id": 8, "item_id": 8} and st.bucket_lookups == {"user_id": 0, "item_id": 8}
    engine = default_rule("cold_start_share")
    alerts = [(a.labels.get("field"), a.state) for k in range(7) for a in engine.evaluate(scraped(), k * 60.0)]
    assert alerts == [("item_id", AlertState.FIRING)]
