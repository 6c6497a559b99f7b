"""The cold-start metrics the learner exports, read the way ``streamrec monitor`` reads them: the packaged default
rules (``monitor/default_rules.toml``) evaluated over this process's Prometheus text, so each test shows what an
operator's alert does, not only what a gauge holds."""

from __future__ import annotations

import numpy as np
from prometheus_client import REGISTRY, generate_latest

from learner.quality import COLD_AUC, COLD_LOGLOSS, WARM_AUC, TrainingQuality
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
