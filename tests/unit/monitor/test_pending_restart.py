"""Pending series over a restart (monitor.rule_engine.RuleEngine.pending / restore_pending, the state file's
``pending``): a monitor restarted more often than a rule's for_s still fires it, with Prometheus' semantics
(ALERTS_FOR_STATE): the time held before the restart counts, the outage does not, and a restored series fires no
sooner than for_grace_period_s after the start."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from monitor.alerts import AlertState
from monitor.engine import Monitor
from monitor.scrape import Snapshot
from monitor.state_file import FiringStateFile
from tests.unit.monitor.test_engine_faults import Clocks, ListSink, monitor, shares

STEP_S = 15


def rules(state: Path, threshold: float = 0.5, grace: str = "for_grace_period_s = 60") -> str:
    return f"""
state_path = "{state}"
{grace}
[[rule]]
name = "cold_start_share"
expr = "share"
op = ">"
threshold = {threshold}
for_s = 300
"""


def held_then_restarted(tmp_path: Path, clocks: Clocks, steps: int, down_s: float,
                        after: list[str], threshold: float = 0.5, grace: str = "for_grace_period_s = 60",
                        ) -> tuple[Monitor, ListSink]:
    """A monitor that saw the share over 0.5 for ``steps`` evaluations (never for 300 s), stopped, and a new process
    started ``down_s`` after its next evaluation was due, scraping ``after``."""
    mon, _ = monitor(rules(tmp_path / "state.json", grace=grace), shares(["share 0.9\n"] * steps), clocks)
    for _ in range(steps):
        assert mon.step() == []
        clocks.tick(STEP_S)
    mon.close(5)
    assert [r["rule"] for r in json.loads((tmp_path / "state.json").read_text())["pending"]] == ["cold_start_share"]
    clocks.tick(down_s)
    clocks.mono = 7.0  # a new process: the monotonic clock has another origin
    return monitor(rules(tmp_path / "state.json", threshold, grace), shares(after), clocks)


def first_alert_after(mon: Monitor, clocks: Clocks, evaluations: int) -> float:
    """Seconds from the first evaluation to the first alert (a firing one), within ``evaluations``."""
    try:
        for i in range(evaluations):
            alerts = mon.step()
            if alerts:
                assert [(a.rule, a.state) for a in alerts] == [("cold_start_share", AlertState.FIRING)]
                return float(i * STEP_S)
            clocks.tick(STEP_S)
        raise AssertionError(f"no alert in {evaluations} evaluations")
    finally:
        mon.close(5)


def test_a_restart_in_the_middle_of_for_s_fires_when_the_time_held_in_all_reaches_for_s(tmp_path: Path) -> None:
    # held 135 s (10 evaluations) before the restart: 165 s more after it, not another 300
    mon, _ = held_then_restarted(tmp_path, clocks := Clocks(), 10, 30, ["share 0.9\n"] * 30)
    assert first_alert_after(mon, clocks, 30) == 165


def test_the_default_grace_period_restores_a_rule_of_for_s_300_as_most_packaged_rules_are(tmp_path: Path) -> None:
    # with Prometheus' 600 s as the default, no rule whose for_s is 600 s or less (15 of the 19 packaged ones) was
    # ever restored: the same rule as above, no for_grace_period_s in its file
    mon, _ = held_then_restarted(tmp_path, clocks := Clocks(), 10, 30, ["share 0.9\n"] * 30, grace="")
    assert first_alert_after(mon, clocks, 30) == 165


def test_a_restored_pending_series_fires_no_sooner_than_the_grace_period_after_the_start(tmp_path: Path) -> None:
    # held 270 s before the restart, 30 s short of for_s: fires for_grace_period_s (60 s) after the start
    mon, _ = held_then_restarted(tmp_path, clocks := Clocks(), 19, 15, ["share 0.9\n"] * 30)
    assert first_alert_after(mon, clocks, 30) == 60


def test_a_condition_that_stopped_holding_across_the_restart_waits_a_whole_for_s_again(tmp_path: Path) -> None:
    mon, _ = held_then_restarted(tmp_path, clocks := Clocks(), 10, 30, ["share 0.1\n"] + ["share 0.9\n"] * 30)
    assert first_alert_after(mon, clocks, 31) == STEP_S + 300


def test_a_state_file_from_a_monitor_down_longer_than_for_s_restores_no_pending(tmp_path: Path) -> None:
    mon, _ = held_then_restarted(tmp_path, clocks := Clocks(), 10, 3600, ["share 0.9\n"] * 30)
    assert first_alert_after(mon, clocks, 30) == 300


def test_a_rule_whose_condition_changed_across_the_restart_restores_no_pending(tmp_path: Path) -> None:
    mon, _ = held_then_restarted(tmp_path, clocks := Clocks(), 10, 30, ["share 0.9\n"] * 30, threshold=0.4)
    assert first_alert_after(mon, clocks, 30) == 300


def test_a_state_file_written_before_pending_was_kept_reads_as_none_in_silence(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "state.json"
    record = {"rule": "r", "labels": {}, "since": 1.0, "value": 2.0}
    path.write_text(json.dumps({"version": 2, "firing": [record]}))
    with caplog.at_level(logging.DEBUG, logger="streamrec.monitor"):
        assert FiringStateFile(path).read() == ([record], [], [])
    assert caplog.records == []


def test_a_malformed_pending_record_is_skipped_with_a_warning_and_the_firing_ones_kept(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "state.json"
    record = {"rule": "r", "labels": {}, "since": 1.0, "value": 2.0}
    path.write_text(json.dumps({"version": 2, "firing": [record], "pending": [{**record, "condition": "x > 1"}]}))
    assert FiringStateFile(path).read() == ([record], [], [])  # no "held"
    assert "1 pending record(s) malformed" in caplog.text


def test_a_monitor_stopped_before_its_first_evaluation_keeps_its_restored_pending_series(tmp_path: Path) -> None:
    # a crash loop that stops a process before it evaluates: close raised ValueError (the restored series' "held"
    # was -inf) and, that fixed, wrote times on the monotonic clock as wall times (the next start dropped them)
    mon, _ = held_then_restarted(tmp_path, clocks := Clocks(), 10, 15, [])
    mon.close(5)
    clocks.mono = 3.0
    mon, _ = monitor(rules(tmp_path / "state.json"), shares(["share 0.9\n"] * 30), clocks)
    assert first_alert_after(mon, clocks, 30) == 165


def test_a_restored_pending_series_whose_source_fails_at_the_first_evaluation_is_saved_and_still_fires(
        tmp_path: Path) -> None:
    # unknown (its source failing for less than scrape_error_hold_s) at the first evaluation: every step raised
    # ValueError at the save until the source answered again
    mon, _ = held_then_restarted(tmp_path, clocks := Clocks(), 10, 30, [])
    answers = iter([Snapshot(errors={"learner": "connection refused"})] + [Snapshot.from_texts(
        {"learner": "share 0.9\n"}) for _ in range(30)])
    mon.scrape = lambda: next(answers)
    assert first_alert_after(mon, clocks, 30) == 165
