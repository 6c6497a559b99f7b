"""The cold-start metrics the learner exports, read the way ``streamrec monitor`` reads them: the packaged default
rules (``monitor/default_rules.toml``) evaluated over this process's Prometheus text, so each test shows what an
operator's alert does, not only what a gauge holds."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import REGISTRY, generate_latest

from learner.quality import BUCKET_SHARE, COLD_AUC, COLD_LOGLOSS, WARM_AUC, IdMetrics, TrainingQuality
from learner.row_mapper import MapStats
from monitor.alerts import AlertState
from monitor.engine import RuleEngine, Snapshot
from monitor.rules import load_rules


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
    q = TrainingQuality(cold_k=0, metrics_window=1000, attribution_window_s=1800.0)
    rng = np.random.default_rng(0)
    labels = (rng.random(500) < 0.3).astype(np.float64)
    probs = np.clip(0.3 + 0.4 * (labels - 0.3) + 0.05 * rng.standard_normal(500), 0.01, 0.99)  # a good ranker
    users = rng.integers(0, 50, 500)
    cold = q.cold_of(users, 0.0, None)
    assert cold is not None and not cold.any()
    q.record(np.array([f"i{k}" for k in range(500)]), np.arange(500) + 1_700_000_000_000, None, labels, probs,
             cold, None, np.zeros(500))
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
