"""A rule whose condition flaps at every evaluation: ``keep_firing_for_s`` keeps it one firing alert, not a storm."""

from __future__ import annotations

import pytest

from monitor.rule_engine import RuleEngine, State
from monitor.rules import RulesError, loads_rules
from monitor.scrape import Snapshot

RULE = """
[[rule]]
name = "lag"
expr = "streamrec_lag"
op = ">"
threshold = 5
"""


def scrape(value: float | None) -> Snapshot:
    return Snapshot.from_texts({"learner": "" if value is None else f"streamrec_lag {value}\n"})


def states(engine: RuleEngine, values: list[float | None], step_s: float = 10.0) -> list[str]:
    """The alerts of one evaluation per value, ``step_s`` apart, as "firing"/"resolved" strings."""
    return [a.state.value for i, v in enumerate(values) for a in engine.evaluate(scrape(v), i * step_s)]


def test_a_rule_flapping_at_every_evaluation_sends_one_firing_then_one_resolved_with_keep_firing_for() -> None:
    flaps = [9.0, 1.0] * 10
    storm = RuleEngine(loads_rules(RULE).rules)
    assert states(storm, flaps) == ["firing", "resolved"] * 10  # without it: two alerts per flap
    engine = RuleEngine(loads_rules(RULE + "keep_firing_for_s = 30\n").rules)
    assert states(engine, flaps) == ["firing"]
    # it resolves once the condition has not held for 30 s (the last hold at t=180: resolved at t=210), the series
    # gone or not
    assert [a.state.value for t in (200.0, 210.0) for a in engine.evaluate(scrape(None), t)] == ["resolved"]


def test_keep_firing_for_neither_fires_early_nor_keeps_a_pending_series() -> None:
    engine = RuleEngine(loads_rules(RULE + "for_s = 20\nkeep_firing_for_s = 30\n").rules)
    assert states(engine, [9.0, 1.0, 9.0, 9.0, 9.0]) == ["firing"]  # pending reset by the 1.0; fires at t=40
    assert engine.states["lag"][()].state is State.FIRING


def test_keep_firing_for_is_a_number_of_seconds_not_below_zero() -> None:
    with pytest.raises(RulesError, match="keep_firing_for_s"):
        loads_rules(RULE + "keep_firing_for_s = -1\n")
    with pytest.raises(RulesError, match="keep_firing_for_s"):
        loads_rules(RULE + 'keep_firing_for_s = "5m"\n')


def restarted(before: RuleEngine, wall: float) -> RuleEngine:
    """A new engine restored from ``before``'s firing records at ``wall``, its own clock at 1000."""
    after = RuleEngine(before.rules)
    after.restore(before.firing(), now=1000.0, wall=wall)
    return after


def alerts_at(engine: RuleEngine, value: float, wall: float) -> list[str]:
    return [a.state.value for a in engine.evaluate(scrape(value), 1000.0 + wall - 15.0, wall)]


def test_a_flapping_rule_restarted_while_its_condition_does_not_hold_stays_one_firing_alert() -> None:
    # the state file did not keep when the firing series had last held, so the restarted monitor resolved it at once
    # (the condition not holding at that flap) and fired it again at the next: two more alerts per restart
    before = RuleEngine(loads_rules(RULE + "keep_firing_for_s = 30\n").rules)
    assert states(before, [9.0, 1.0]) == ["firing"]  # held at t=0, not at t=10
    after = restarted(before, wall=15.0)
    assert alerts_at(after, 1.0, 15.0) == []
    assert alerts_at(after, 9.0, 25.0) == ["firing"]  # announced again once it holds (the restart may have lost it)
    assert alerts_at(after, 1.0, 54.0) == []
    assert alerts_at(after, 1.0, 55.0) == ["resolved"]  # 30 s after it last held


def test_a_restored_firing_series_resolves_keep_firing_for_after_it_last_held_the_outage_counted() -> None:
    before = RuleEngine(loads_rules(RULE + "keep_firing_for_s = 30\n").rules)
    assert states(before, [9.0, 1.0]) == ["firing"]  # last held at wall t=0
    after = restarted(before, wall=15.0)
    assert alerts_at(after, 1.0, 29.0) == []
    assert alerts_at(after, 1.0, 30.0) == ["resolved"]
    assert alerts_at(restarted(before, wall=40.0), 1.0, 40.0) == ["resolved"]  # an outage past it: at once
