"""The engine's alert identities and the memory it keeps per scrape: a rule's absence alert is never one of
its series, whatever labels the series carry, and the rates' history stays bounded however the label sets
churn. Each test failed before the fix it is named for."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from monitor.alerts import Alert, AlertKind, AlertState, alert_fingerprint
from monitor.engine import Monitor, once_text
from monitor.rule_engine import HISTORY_DROPPED, RuleEngine
from monitor.rules import RulesError, loads_rules
from monitor.scrape import Snapshot
from monitor.state_file import FiringStateFile
from tests.monitoring_io import NullSink

LAG_RULES = """
[[rule]]
name = "learner_lag"
expr = "lag"
op = ">"
threshold = 500
absent_for_s = 60
"""


def lag(value: float) -> Snapshot:
    return Snapshot.from_texts({"learner": f'lag{{absent="true"}} {value}\n'})


def failed() -> Snapshot:
    return Snapshot(errors={"learner": "down"})


def seen(alerts: list) -> list[tuple[str, float | None]]:
    return [(a.state.value, a.value) for a in alerts]


def test_a_series_labelled_absent_true_is_a_series_of_its_own_not_the_absence_alert(tmp_path: Path) -> None:
    engine = RuleEngine(loads_rules(LAG_RULES).rules, hold_s=600)
    # the series fires like any other (it used to be skipped: a rule on it never fired)
    assert seen(engine.evaluate(lag(900), 0)) == [("firing", 900.0)]
    # its source fails: the series is unknown (held firing), the expression has no data: the absence alert fires
    assert engine.evaluate(failed(), 30) == []
    both = engine.evaluate(failed(), 90)
    assert seen(both) == [("firing", None)] and "no data" in both[0].message
    assert both[0].labels == {"absent": "true"}  # what the sinks see stays readable
    # both fire at once, as two records of the state file, and come back as two after a restart
    records = engine.firing()
    assert sorted(r.get("absent", False) for r in records) == [False, True]
    state = FiringStateFile(tmp_path / "state.json")
    state.save(records)
    again = RuleEngine(loads_rules(LAG_RULES).rules, hold_s=600)
    assert again.restore(state.load(), 0, 90) == 2
    for eng in (engine, again):
        # data again, still above the threshold: the absence alert resolves, the series' alert does not
        back = eng.evaluate(lag(800), 120)
        expected = [("firing", 800.0)] if eng is again else []  # a restart announces a firing series again
        assert sorted(seen(back), key=str) == sorted([*expected, ("resolved", None)], key=str)
        assert [a.message for a in back if a.state is AlertState.RESOLVED] == ["learner_lag: lag has data again"]
        # and the series resolves on its own once its condition ends
        assert seen(eng.evaluate(lag(3), 135)) == [("resolved", 3.0)]


def test_once_and_the_summary_tell_the_absence_alert_from_a_series_labelled_absent_true() -> None:
    engine = RuleEngine(loads_rules(LAG_RULES).rules, hold_s=600)
    fired = [a for t, snap in ((0, lag(900)), (30, failed()), (90, failed())) for a in engine.evaluate(snap, t)]
    rows = [r.as_dict() for r in engine.status()]
    # the same labels, as the sinks see them: the rows differ by kind and fingerprint, the alerts' own
    assert sorted((r["kind"], r["labels"]["absent"]) for r in rows) == [("absent", "true"), ("series", "true")]
    assert {(r["kind"], r["fingerprint"]) for r in rows} == {(a.kind.value, a.fingerprint) for a in fired}
    lines = once_text({"rules_file": "r.toml", "sources": {}, "rules": rows}).splitlines()
    assert [line.split()[2] for line in lines[2:]] == ['learner_lag{absent="true"}'] * 2
    assert sorted(line.split()[3] for line in lines[2:]) == ["absent", "value=900.0"]


def test_a_version_1_state_file_reads_its_absent_labelled_record_as_the_absence_alert(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"version": 1, "firing": [
        {"rule": "learner_lag", "labels": {"absent": "true"}, "since": 10, "value": None}]}))
    engine = RuleEngine(loads_rules(LAG_RULES).rules)
    assert engine.restore(FiringStateFile(path).load(), 0, 100) == 1
    [resolved] = engine.evaluate(lag(3), 15)  # data again: the restored absence alert resolves
    assert (resolved.state, resolved.labels, resolved.value) == (AlertState.RESOLVED, {"absent": "true"}, None)
    assert engine.firing() == []


RATE_RULES = """
[[rule]]
name = "lookups"
expr = "sum(rate(lookups_total[60s]))"
op = ">"
threshold = 1000
"""


def scrape(t: int, series: int, churn: bool = False) -> Snapshot:
    """``series`` label sets of lookups_total (a new set every scrape where ``churn``), and a gauge no range reads."""
    rows = [f'lookups_total{{user="{t * series + i if churn else i}"}} {t}\n' for i in range(series)]
    return Snapshot.from_texts({"learner": "".join(rows) + 'bucket_share{field="user_id"} 0.5\n'})


def test_the_rates_history_forgets_label_sets_that_churn_and_keeps_only_the_metrics_a_range_reads() -> None:
    config = loads_rules(RATE_RULES)
    engine = RuleEngine(config.rules, config.history_s)
    for t in range(0, 3600, 15):  # an hour of a label with a new value every scrape
        engine.evaluate(scrape(t, 3, churn=True), t)
    history = engine.history
    assert set(history.samples) == {"lookups_total"}  # the gauge was kept too, every series of it
    kept = history.keep_s // 15 + 1  # the scrapes inside the window
    assert len(history.samples["lookups_total"]) <= 3 * kept
    assert len(history.sources) == len(history.samples["lookups_total"])


def test_the_rates_history_keeps_at_most_history_max_series_label_sets_per_metric_and_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    config = loads_rules("history_max_series = 10\n" + RATE_RULES)
    engine = RuleEngine(config.rules, config.history_s, history_max_series=config.history_max_series)
    dropped = HISTORY_DROPPED.labels("lookups_total")
    before = dropped._value.get()
    with caplog.at_level(logging.WARNING, logger="streamrec.monitor"):
        for t in range(0, 150, 15):
            engine.evaluate(scrape(t, 50), t)
    per = engine.history.samples["lookups_total"]
    assert sorted(per) == [(("user", str(i)),) for i in range(10)]  # the first ten go on, with every sample
    assert {len(q) for q in per.values()} == {len(range(150 - 15 - int(engine.history.keep_s), 150, 15))}
    assert dropped._value.get() - before == 40 * 10
    assert caplog.text.count("history_max_series=10") == 1  # once, not every scrape
    [alert] = [a for t in range(150, 300, 15) for a in engine.evaluate(scrape(t * 200, 50), t)]  # the kept ones rate
    assert alert.state is AlertState.FIRING


def test_history_max_series_must_be_a_whole_number_of_at_least_one() -> None:
    with pytest.raises(RulesError, match=r'r.toml: field "history_max_series": expected a whole number from 1 to '
                                         r'10000000, got 0'):
        loads_rules("history_max_series = 0\n" + RATE_RULES, "r.toml")



def test_the_duplicated_series_the_monitor_remembers_are_bounded_and_a_steady_one_is_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    n = [0]

    def scrape() -> Snapshot:  # two sources export one steady series and one whose label is new every scrape
        n[0] += 1
        text = f'share 0.1\nshare{{scrape="{n[0]}"}} 0.1\n'
        return Snapshot.from_texts({"a": text, "b": text})

    mon = Monitor(loads_rules(LAG_RULES), NullSink(), scrape=scrape)
    mon.DUPLICATES_REMEMBERED = 5
    try:
        with caplog.at_level(logging.WARNING, logger="streamrec.monitor"):
            for _ in range(50):
                mon.step()
        assert len(mon._duplicates_seen) == 5  # it kept one key per scrape, for ever
        said = [r.getMessage() for r in caplog.records if "all export share{}" in r.getMessage()]
        assert len(said) == 1
    finally:
        mon.close(5)


def test_the_state_file_and_run_log_carry_each_alerts_fingerprint_and_a_state_file_without_it_restores_the_same(
        tmp_path: Path) -> None:
    state, run = tmp_path / "state.json", tmp_path / "run.jsonl"
    config = loads_rules(f'scrape_error_hold_s = 600\nstate_path = "{state}"\n[run_log]\npath = "{run}"\n'
                         + LAG_RULES)
    clock = [0.0]

    def monitor(snaps: list[Snapshot]) -> Monitor:
        it = iter(snaps)
        return Monitor(config, NullSink(), scrape=lambda: next(it), clock=lambda: 1e9 + clock[0],
                       monotonic=lambda: clock[0])

    mon = monitor([lag(900), failed(), failed()])
    sent: list[Alert] = []
    try:
        for clock[0] in (0.0, 30.0, 90.0):
            sent.extend(mon.step())
    finally:
        mon.close(5)
    # the series and the absence alert fire, with the same labels and two fingerprints
    assert sorted(a.kind.value for a in sent) == ["absent", "series"] and len({a.fingerprint for a in sent}) == 2
    assert [a.labels for a in sent] == [{"absent": "true"}] * 2
    records = json.loads(state.read_text())["firing"]
    assert {(r.get("absent", False), r["fingerprint"]) for r in records} == {
        (a.kind.value == "absent", a.fingerprint) for a in sent}
    logged = [json.loads(line)["alert"] for line in run.read_text().splitlines() if '"kind":"alert"' in line]
    assert [(d["kind"], d["fingerprint"]) for d in logged] == [(a.kind.value, a.fingerprint) for a in sent]
    # a state file written before alerts had fingerprints (version 2 all the same): the restarted monitor resolves
    # the absence alert and announces the series again, each under the fingerprint it fired with
    state.write_text(json.dumps({"version": 2, "firing": [{k: v for k, v in r.items() if k != "fingerprint"}
                                                          for r in records]}))
    again = monitor([lag(800)])
    try:
        clock[0] = 120.0
        back = again.step()
    finally:
        again.close(5)
    fired = {a.kind: a.fingerprint for a in sent}
    assert sorted((a.kind.value, a.state.value) for a in back) == [("absent", "resolved"), ("series", "firing")]
    assert all(a.fingerprint == fired[a.kind] for a in back)


TEAM_RULES = """
[[rule]]
name = "share"
expr = "share"
op = ">"
threshold = 0.5
labels = { team = "x" }
"""


def shares(**values: float) -> Snapshot:
    """One series of ``share`` per label set: "" is {}, "team=x" is {team="x"}, "team=y,exported_team=z" ..."""
    rows = []
    for key, v in values.items():
        lbl = ",".join(f'{k}="{val}"' for k, val in (kv.split("=") for kv in key.split("__") if kv))
        rows.append(f"share{{{lbl}}} {v}\n")
    return Snapshot.from_texts({"learner": "".join(rows)})


def test_a_series_label_named_like_a_rule_label_is_kept_as_exported_and_each_series_is_an_alert_of_its_own() -> None:
    engine = RuleEngine(loads_rules(TEAM_RULES).rules)
    series = {"": {}, "team=x": {"team": "x"}, "exported_team=x": {"exported_team": "x"},
              "team=y__exported_team=z": {"team": "y", "exported_team": "z"}}
    fired = engine.evaluate(shares(**dict.fromkeys(series, 0.9)), 0)
    assert len(fired) == 4 and {a.state for a in fired} == {AlertState.FIRING}
    shown = sorted(sorted(a.labels.items()) for a in fired)
    # the rule's label wins; the series' own value stays readable under exported_ (once more while that is taken)
    assert shown == sorted([[("team", "x")], [("exported_team", "x"), ("team", "x")],
                            [("exported_team", "x"), ("team", "x")],
                            [("exported_exported_team", "y"), ("exported_team", "z"), ("team", "x")]])
    # the identity is the series' own labels: four alerts, even where the labels shown coincide (a series with an
    # exported_ label of its own, as in Prometheus)
    assert sorted(a.fingerprint for a in fired) == sorted(
        alert_fingerprint("share", AlertKind.SERIES, own) for own in series.values())
    assert len({a.fingerprint for a in fired}) == 4
    assert sorted(sorted(r["labels"].items()) for r in engine.firing()) == sorted(
        sorted(own.items()) for own in series.values())  # the state file keeps the series' own labels
    # {team="x"} ends: it resolves alone, under its own fingerprint; {} (which showed the same labels before) fires on
    [resolved] = engine.evaluate(shares(**{**dict.fromkeys(series, 0.9), "team=x": 0.1}), 15)
    assert resolved.state is AlertState.RESOLVED and resolved.labels == {"team": "x", "exported_team": "x"}
    assert resolved.fingerprint == alert_fingerprint("share", AlertKind.SERIES, {"team": "x"})
    assert sorted(sorted(r["labels"].items()) for r in engine.firing()) == sorted(
        sorted(own.items()) for key, own in series.items() if key != "team=x")
    assert json.loads(resolved.to_json())["fingerprint"] == resolved.fingerprint
