"""Absence timers over a restart (monitor.rule_engine.RuleEngine.no_data / restore_no_data, the state file's
``no_data``): a monitor restarted more often than a rule's absent_for_s still sends its absence alert, with the
pending series' semantics (tests/unit/monitor/test_pending_restart.py): the time without data before the restart
counts, the outage does not, and a restored timer fires no sooner than for_grace_period_s after the start."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from monitor.alerts import AlertKind, AlertState
from monitor.engine import Monitor
from monitor.state_file import FiringStateFile
from tests.unit.monitor.test_engine_faults import Clocks, ListSink, monitor, shares

STEP_S = 15
NO_DATA = "lag 3\n"  # the source answers, without the rule's metric


def rules(state: Path, expr: str = "share", grace: str = "for_grace_period_s = 60") -> str:
    return f"""
state_path = "{state}"
{grace}
[[rule]]
name = "cold_start_share"
expr = "{expr}"
op = ">"
threshold = 0.5
absent_for_s = 300
"""


def restart(mon: Monitor, tmp_path: Path, clocks: Clocks, down_s: float, after: list[str],
            expr: str = "share", grace: str = "for_grace_period_s = 60") -> tuple[Monitor, ListSink]:
    """Stop ``mon`` and start a new process ``down_s`` after its next evaluation was due, scraping ``after``."""
    mon.close(5)
    clocks.tick(down_s)
    clocks.mono = 7.0  # a new process: the monotonic clock has another origin
    return monitor(rules(tmp_path / "state.json", expr, grace), shares(after), clocks)


def absent_then_restarted(tmp_path: Path, clocks: Clocks, steps: int, down_s: float, after: list[str],
                          expr: str = "share", grace: str = "for_grace_period_s = 60") -> tuple[Monitor, ListSink]:
    """A monitor that saw no data for ``steps`` evaluations (never for 300 s), stopped, and a new one."""
    mon, _ = monitor(rules(tmp_path / "state.json", grace=grace), shares([NO_DATA] * steps), clocks)
    for _ in range(steps):
        assert mon.step() == []
        clocks.tick(STEP_S)
    return restart(mon, tmp_path, clocks, down_s, after, expr, grace)


def first_absence_alert(mon: Monitor, clocks: Clocks, evaluations: int) -> tuple[float, str]:
    """Seconds from the first evaluation to the absence alert (firing), within ``evaluations``, and its text."""
    try:
        for i in range(evaluations):
            alerts = mon.step()
            if alerts:
                assert [(a.rule, a.kind, a.state) for a in alerts] == [
                    ("cold_start_share", AlertKind.ABSENT, AlertState.FIRING)]
                return float(i * STEP_S), alerts[0].message
            clocks.tick(STEP_S)
        raise AssertionError(f"no alert in {evaluations} evaluations")
    finally:
        mon.close(5)


def test_a_restart_in_the_middle_of_absent_for_s_fires_when_the_time_without_data_in_all_reaches_it(
        tmp_path: Path) -> None:
    # no data for 135 s (10 evaluations) before the restart: 165 s more after it, not another 300; the 45 s from the
    # last evaluation to the restart are not counted in the delay
    mon, _ = absent_then_restarted(tmp_path, clocks := Clocks(), 10, 30, [NO_DATA] * 30)
    assert first_absence_alert(mon, clocks, 30)[0] == 165


def test_a_restored_absence_timers_alert_says_the_time_it_counted_and_the_outage_it_did_not(tmp_path: Path) -> None:
    # it said "no data for share for 300s": the source had been silent for 345 s, 45 s of them unwatched
    mon, _ = absent_then_restarted(tmp_path, clocks := Clocks(), 10, 30, [NO_DATA] * 30)
    assert first_absence_alert(mon, clocks, 30)[1] == (
        "cold_start_share: no data for share for 300s (not counting the 45s the monitor did not watch it across a "
        "restart: from its last evaluation at 1970-01-12 13:48:55 UTC to the restart at 1970-01-12 13:49:40 UTC)")


def test_the_outages_of_two_restarts_add_up_in_the_absence_text(tmp_path: Path) -> None:
    mon, _ = absent_then_restarted(tmp_path, clocks := Clocks(), 10, 30, [NO_DATA] * 2)
    for _ in range(2):
        assert mon.step() == []
        clocks.tick(STEP_S)
    mon, _ = restart(mon, tmp_path, clocks, 5, [NO_DATA] * 30)
    _, text = first_absence_alert(mon, clocks, 30)
    assert text == ("cold_start_share: no data for share for 300s (not counting the 65s the monitor did not "
                           "watch it across 2 restarts, the last from its last evaluation at 1970-01-12 13:49:55 UTC "
                           "to the restart at 1970-01-12 13:50:15 UTC)")


def test_data_after_a_restart_forgets_the_outage_the_next_absence_text_would_name(tmp_path: Path) -> None:
    mon, _ = absent_then_restarted(tmp_path, clocks := Clocks(), 10, 30, ["share 0.1\n"] + [NO_DATA] * 30)
    assert first_absence_alert(mon, clocks, 31)[1] == "cold_start_share: no data for share for 300s"


def test_a_restored_firing_absence_alert_says_the_time_counted_before_the_restart_and_the_outage(
        tmp_path: Path) -> None:
    # it said "no data for share for 300s" again at the restart, after 600 s without data and a 10-minute outage
    mon, _ = monitor(rules(tmp_path / "state.json"), shares([NO_DATA] * 41), clocks := Clocks())
    fired = []
    for _ in range(41):
        fired += [a.state for a in mon.step()]
        clocks.tick(STEP_S)
    assert fired == [AlertState.FIRING]
    mon, _ = restart(mon, tmp_path, clocks, 600, [NO_DATA])
    try:
        assert [a.message for a in mon.step()] == [
            "cold_start_share: no data for share for 600s (not counting the 615s the monitor did not watch it across "
            "a restart: from its last evaluation at 1970-01-12 13:56:40 UTC to the restart at 1970-01-12 14:06:55 UTC)"]
    finally:
        mon.close(5)


def test_malformed_outages_make_an_absence_timer_malformed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "state.json"
    timer = {"rule": "r", "expr": "share", "since": 1.0, "held": 2.0, "down_s": 5.0, "restarts": 1,
             "down_from": 2.0, "down_to": 7.0}
    path.write_text(json.dumps({"version": 2, "firing": [], "no_data": [timer, {**timer, "restarts": True},
                                                                        {**timer, "down_to": None}]}))
    assert FiringStateFile(path).read() == ([], [], [timer])
    assert "2 absence timer(s) malformed" in caplog.text


def test_a_monitor_restarted_more_often_than_absent_for_s_still_sends_the_absence_alert(tmp_path: Path) -> None:
    # a crash loop: every process lives 120 s (8 evaluations), 5 s apart; each used to start absent_for_s over
    clocks = Clocks()
    mon, _ = monitor(rules(tmp_path / "state.json"), shares([NO_DATA] * 8), clocks)
    for _ in range(3):
        for _ in range(8):
            if alerts := mon.step():
                assert [(a.kind, a.state) for a in alerts] == [(AlertKind.ABSENT, AlertState.FIRING)]
                mon.close(5)
                return
            clocks.tick(STEP_S)
        mon, _ = restart(mon, tmp_path, clocks, 5, [NO_DATA] * 8)
    mon.close(5)
    raise AssertionError("no absence alert in 3 lives of 120 s without data")


def test_a_restored_absence_timer_fires_no_sooner_than_the_grace_period_after_the_start(tmp_path: Path) -> None:
    # no data for 270 s before the restart, 30 s short of absent_for_s: fires for_grace_period_s (60 s) after start
    mon, _ = absent_then_restarted(tmp_path, clocks := Clocks(), 19, 15, [NO_DATA] * 30)
    assert first_absence_alert(mon, clocks, 30)[0] == 60


def test_the_default_grace_period_restores_an_absence_timer_of_300_s(tmp_path: Path) -> None:
    mon, _ = absent_then_restarted(tmp_path, clocks := Clocks(), 10, 30, [NO_DATA] * 30, grace="")
    assert first_absence_alert(mon, clocks, 30)[0] == 165


def test_data_at_the_first_evaluation_after_the_restart_starts_the_absence_timer_over(tmp_path: Path) -> None:
    mon, _ = absent_then_restarted(tmp_path, clocks := Clocks(), 10, 30, ["share 0.1\n"] + [NO_DATA] * 30)
    assert first_absence_alert(mon, clocks, 31)[0] == STEP_S + 300


def test_a_state_file_from_a_monitor_down_longer_than_absent_for_s_restores_no_absence_timer(tmp_path: Path) -> None:
    mon, _ = absent_then_restarted(tmp_path, clocks := Clocks(), 10, 3600, [NO_DATA] * 30)
    assert first_absence_alert(mon, clocks, 30)[0] == 300


def test_a_rule_whose_expr_changed_across_the_restart_restores_no_absence_timer(tmp_path: Path) -> None:
    mon, _ = absent_then_restarted(tmp_path, clocks := Clocks(), 10, 30, [NO_DATA] * 30, expr="max(share)")
    assert first_absence_alert(mon, clocks, 30)[0] == 300


def test_a_firing_absence_alert_is_kept_as_firing_not_as_a_timer(tmp_path: Path) -> None:
    mon, _ = absent_then_restarted(tmp_path, clocks := Clocks(), 10, 30, [NO_DATA] * 30)
    first_absence_alert(mon, clocks, 30)
    data = json.loads((tmp_path / "state.json").read_text())
    assert [(r["rule"], r.get("absent")) for r in data["firing"]] == [("cold_start_share", True)]
    assert (data["version"], data["no_data"]) == (2, [])


def test_a_state_file_written_before_absence_timers_were_kept_reads_as_none_in_silence(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "state.json"
    record = {"rule": "r", "labels": {}, "since": 1.0, "value": 2.0}
    path.write_text(json.dumps({"version": 2, "firing": [record], "pending": []}))
    with caplog.at_level(logging.DEBUG, logger="streamrec.monitor"):
        assert FiringStateFile(path).read() == ([record], [], [])
    assert caplog.records == []


def test_a_malformed_absence_timer_is_skipped_with_a_warning_and_the_good_ones_kept(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "state.json"
    timer = {"rule": "r", "expr": "share", "since": 1.0, "held": 2.0}
    path.write_text(json.dumps({"version": 2, "firing": [], "no_data": [timer, {**timer, "held": "soon"}]}))
    assert FiringStateFile(path).read() == ([], [], [timer])
    assert "1 absence timer(s) malformed" in caplog.text


def test_a_monitor_stopped_before_its_first_evaluation_keeps_its_restored_absence_timer(tmp_path: Path) -> None:
    # the save before any evaluation wrote the timer on the monotonic clock as wall time: the next start dropped it
    mon, _ = absent_then_restarted(tmp_path, clocks := Clocks(), 10, 15, [])
    mon, _ = restart(mon, tmp_path, clocks, 0, [NO_DATA] * 30)
    assert first_absence_alert(mon, clocks, 30)[0] == 165


def test_a_restored_firing_absence_alert_whose_last_evaluation_is_no_date_still_alerts(tmp_path: Path) -> None:
    # a state file edited or damaged: "held" a finite number past any date (year 33658). It passed the file's checks,
    # and every evaluation of the restarted monitor raised formatting the outage's times for the alert's text
    mon, _ = monitor(rules(tmp_path / "state.json"), shares([NO_DATA] * 41), clocks := Clocks())
    for _ in range(41):
        mon.step()
        clocks.tick(STEP_S)
    mon.close(5)
    path = tmp_path / "state.json"
    data = json.loads(path.read_text())
    data["firing"][0]["held"] = 1e12
    path.write_text(json.dumps(data))
    clocks.tick(600)
    clocks.mono = 7.0  # a new process (restart's)
    mon, _ = monitor(rules(path), shares([NO_DATA]), clocks)
    try:
        assert [a.message for a in mon.step()] == ["cold_start_share: no data for share for 600s"]
    finally:
        mon.close(5)
