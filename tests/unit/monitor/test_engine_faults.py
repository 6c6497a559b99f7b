"""The monitor off the happy path: a run log that cannot rotate, a wall clock that steps, two processes
exporting the same series, scrape targets that trickle, answer too much or answer garbage, and a sink
backing off when the monitor is told to stop. Each test failed before the fix it is named for."""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from monitor import scrape as scrape_mod
from monitor.alerts import Alert, AlertState, Severity, SinkError, SinkSettings, WebhookSink
from monitor.delivery import QueuedSink
from monitor.engine import Monitor
from monitor.http_deadline import post_json
from monitor.rules import loads_rules
from monitor.scrape import Scraper, Snapshot
from streamrec.cli import main


class ListSink:
    """Keeps what it is sent; fails the first ``fail`` attempts."""

    name, timeout_s, batch_max = "list", 1.0, 100

    def __init__(self, fail: int = 0) -> None:
        self.got: list[Alert] = []
        self.fail, self.attempts = fail, 0

    def send(self, alerts: Sequence[Alert], deadline: float | None = None) -> None:
        self.attempts += 1
        if self.fail > 0:
            self.fail -= 1
            raise SinkError("down")
        self.got.extend(alerts)

    def close(self) -> None:
        pass


class Clocks:
    """A wall clock and a monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.wall, self.mono = 1_000_000.0, 50.0

    def tick(self, s: float) -> None:
        self.wall += s
        self.mono += s


def monitor(rules: str, scrape: Callable[[], Snapshot], clocks: Clocks) -> tuple[Monitor, ListSink]:
    config = loads_rules(rules)
    sink = ListSink()
    return Monitor(config, QueuedSink(sink, config.sinks), scrape=scrape, clock=lambda: clocks.wall,
                   monotonic=lambda: clocks.mono), sink


def delivered(mon: Monitor, sink: ListSink) -> list[tuple[str, str]]:
    assert mon.sink.wait_idle(10)
    return [(a.rule, a.state.value) for a in sink.got]


# -- the run log ----------------------------------------------------------------------------------
def test_alerts_reach_the_sinks_when_the_run_logs_rotation_fails(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    logs = tmp_path / "logs"
    rules = f"""
[run_log]
path = "{logs}/run.jsonl"
max_bytes = 4096
[[rule]]
name = "hot"
expr = "m"
op = ">"
threshold = 0
"""
    value = [0]
    padding = "".join(f"streamrec_pad{i} 1\n" for i in range(60))  # each scrape's record fills the file fast
    clocks = Clocks()
    mon, sink = monitor(rules, lambda: Snapshot.from_texts({"src": f"m {value[0]}\n{padding}"}), clocks)
    try:
        mon.step()
        shutil.rmtree(logs)  # a clean-up removed the directory: the next rotation's rename fails
        with caplog.at_level(logging.WARNING):
            for _ in range(6):  # rotation fails, then the file is closed: every later write used to raise
                clocks.tick(15)
                mon.step()
            value[0] = 1
            clocks.tick(15)
            [fired] = mon.step()
        assert fired.state is AlertState.FIRING
        assert delivered(mon, sink) == [("hot", "firing")]
        assert mon.run_log is not None and mon.run_log.failures >= 1
        assert "cannot write" in caplog.text
        assert (logs / "run.jsonl").exists()  # the run log starts again once it can
        assert '"kind":"alert"' in (logs / "run.jsonl").read_text()
    finally:
        mon.close(5)


def _run_log_of_one_step(tmp_path: Path, url: str, scrape: Callable[[], Snapshot]) -> str:
    """The run log a monitor with the one source ``url`` writes in one step, scraping with ``scrape``."""
    logs = tmp_path / "logs"
    rules = f"""
[sources]
learner = "{url}"
[run_log]
path = "{logs}/run.jsonl"
[[rule]]
name = "hot"
expr = "m"
op = ">"
threshold = 0
"""
    mon, _ = monitor(rules, scrape, Clocks())
    try:
        mon.step()
    finally:
        mon.close(5)
    return (logs / "run.jsonl").read_text()


def test_the_run_log_writes_a_sources_password_as_stars(tmp_path: Path) -> None:
    """The run log's start record held each source's url as written: a ``user:password@`` in one reached the file
    (which outlives the process and is read by ``streamrec report``) in clear, where logs and summaries redact it."""
    text = _run_log_of_one_step(tmp_path, "http://scraper:hunter2-secret@127.0.0.1:9/metrics",
                                lambda: Snapshot.from_texts({"learner": "m 0\n"}))
    assert '"kind":"start"' in text and "127.0.0.1:9/metrics" in text
    assert "hunter2-secret" not in text


def test_a_failed_scrape_of_a_source_with_a_password_writes_it_as_stars(tmp_path: Path) -> None:
    """A scrape error was ``f"{url}: {why}"`` with the url as written: a source's ``user:password@`` reached the run
    log's ``scrape_error`` records (a file that outlives the process, read by ``streamrec report``) and the monitor's
    status in clear, although its start record masked it."""
    url = "http://scraper:hunter2-secret@127.0.0.1:1/metrics"  # port 1: refused at once
    text = _run_log_of_one_step(tmp_path, url, Scraper({"learner": url}, timeout_s=2.0).scrape)
    assert '"kind":"scrape_error"' in text and "127.0.0.1:1/metrics" in text
    assert "hunter2-secret" not in text


def test_a_run_log_that_cannot_be_opened_is_a_settings_error(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    rules = tmp_path / "rules.toml"
    rules.write_text(f'[sources]\nx = "http://127.0.0.1:9/metrics"\n[run_log]\npath = "{tmp_path}"\n')
    assert main(["monitor", "--rules", str(rules)]) == 2  # was a traceback, exit 1
    assert f"[run_log] path {tmp_path}: cannot open it for appending: Is a directory" in capsys.readouterr().err


# -- clocks -----------------------------------------------------------------------------------------
RULES_WITH_DURATIONS = """
[[rule]]
name = "served_worse_than_base_rate"
expr = "ne"
op = ">="
threshold = 1
for_s = 900
[[rule]]
name = "nan_losses"
expr = "increase(nan_total[5m])"
op = ">"
threshold = 0
"""


def test_a_forward_step_of_the_wall_clock_does_not_fire_a_pending_rule_early() -> None:
    clocks = Clocks()
    mon, sink = monitor(RULES_WITH_DURATIONS, lambda: Snapshot.from_texts({"l": "ne 1.2\nnan_total 0\n"}), clocks)
    try:
        mon.step()
        clocks.tick(15)
        clocks.wall += 3600  # NTP steps the wall clock an hour ahead: 15 s have passed, not 900
        assert mon.step() == []
        for _ in range(58):  # 60 evaluations 15 s apart: pending for 885 s ...
            clocks.tick(15)
            assert mon.step() == []
        clocks.tick(15)
        [fired] = mon.step()  # ... then 900 s: it fires, stamped with the wall clock
        assert fired.ts == int(clocks.wall * 1000)
        assert delivered(mon, sink) == [("served_worse_than_base_rate", "firing")]
    finally:
        mon.close(5)


def test_a_backward_step_of_the_wall_clock_does_not_blind_increase() -> None:
    clocks = Clocks()
    losses = [0]
    mon, sink = monitor(RULES_WITH_DURATIONS, lambda: Snapshot.from_texts(
        {"l": f"ne 0.5\nnan_total {losses[0]}\n"}), clocks)
    try:
        for _ in range(4):
            mon.step()
            clocks.tick(15)
        clocks.wall -= 3600  # NTP steps the wall clock an hour back
        losses[0] = 3  # and the learner starts seeing NaN losses
        mon.step()
        assert delivered(mon, sink) == [("nan_losses", "firing")]
    finally:
        mon.close(5)


# -- several processes, one series ------------------------------------------------------------------
def test_a_series_two_sources_export_never_reads_as_an_increase_when_one_flaps(
        caplog: pytest.LogCaptureFixture) -> None:
    rules = """
[[rule]]
name = "dense_clipped"
expr = "increase(clipped_total[5m])"
op = ">"
threshold = 0
"""
    n = [0]

    def scrape() -> Snapshot:  # neither process's counter ever moves; source a fails every third scrape
        n[0] += 1
        snap = Snapshot()
        if n[0] % 3:
            snap.add_text("a", "clipped_total 100\n")
        else:
            snap.errors["a"] = "timed out"
        snap.add_text("b", "clipped_total 40\n")
        return snap

    clocks = Clocks()
    mon, sink = monitor(rules, scrape, clocks)
    try:
        with caplog.at_level(logging.WARNING, logger="streamrec.alerts"):
            for _ in range(12):
                mon.step()
                clocks.tick(15)
        assert delivered(mon, sink) == []  # the old history read 100 -> 40 as a reset: increase 40, firing
        said = [r.message for r in caplog.records if "all export" in r.message]
        assert said == ["sources a, b all export clipped_total{}: rules read a's only (give each process a label "
                        "of its own, e.g. rank, to watch them all)"]  # once, not every interval
    finally:
        mon.close(5)


def test_one_failed_scrape_of_the_first_of_two_sources_exporting_a_series_does_not_resolve_its_increase() -> None:
    rules = """
scrape_error_hold_s = 60
[[rule]]
name = "dense_clipped"
expr = "increase(clipped_total[5m])"
op = ">"
threshold = 0
"""
    n = [0]

    def scrape() -> Snapshot:  # a's counter rises every scrape, b's never; a fails its 7th scrape only
        n[0] += 1
        snap = Snapshot()
        if n[0] == 7:
            snap.errors["a"] = "timed out"
        else:
            snap.add_text("a", f"clipped_total {100 + n[0]}\n")
        snap.add_text("b", "clipped_total 40\n")
        return snap

    clocks = Clocks()
    mon, sink = monitor(rules, scrape, clocks)
    try:
        for _ in range(12):
            mon.step()
            clocks.tick(15)
        # a's history was dropped when b's value stood in, so a's next answer had no increase (no data) and the
        # alert resolved, then fired again a scrape later
        assert delivered(mon, sink) == [("dense_clipped", "firing")]
    finally:
        mon.close(5)


# -- a source that fails now and then --------------------------------------------------------------
SHARE_RULE = """
scrape_error_hold_s = 60
[[rule]]
name = "cold_start_share"
expr = "share"
op = ">"
threshold = 0.5
for_s = 300
"""


def flapping(fails: Callable[[int], bool]) -> Callable[[], Snapshot]:
    """The share stays at 0.9; scrape number n (from 1) of the learner fails where ``fails(n)``."""
    n = [0]

    def scrape() -> Snapshot:
        n[0] += 1
        snap = Snapshot()
        if fails(n[0]):
            snap.errors["learner"] = "no answer within scrape_timeout_s=5s"
        else:
            snap.add_text("learner", "share 0.9\n")
        return snap

    return scrape


def test_a_source_failing_now_and_then_still_lets_its_rules_fire() -> None:
    clocks = Clocks()
    mon, sink = monitor(SHARE_RULE, flapping(lambda n: n % 10 == 0), clocks)  # one scrape in 10 (150 s) fails
    try:
        for _ in range(480):  # 2 hours: the old engine reset pending at every failure and never fired
            mon.step()
            clocks.tick(15)
        assert delivered(mon, sink) == [("cold_start_share", "firing")]
        assert sink.got[0].ts == int((1_000_000 + 300) * 1000)  # for_s counted through the failed scrapes
    finally:
        mon.close(5)


def test_one_failed_scrape_does_not_resolve_a_firing_alert_but_a_dead_source_does() -> None:
    clocks = Clocks()
    mon, sink = monitor(SHARE_RULE, flapping(lambda n: n == 30 or n > 40), clocks)
    try:
        for _ in range(40):  # fires at 300 s; scrape 30 fails (it used to resolve the alert)
            mon.step()
            clocks.tick(15)
        assert delivered(mon, sink) == [("cold_start_share", "firing")]
        resolved = []
        for _ in range(6):  # from scrape 41 the source is down for good: no data once it has failed 60 s
            resolved += mon.step()
            clocks.tick(15)
        assert [(a.state.value, a.value, a.ts) for a in resolved] == [("resolved", None, (1_000_000 + 660) * 1000)]
    finally:
        mon.close(5)


def test_an_alert_a_dead_source_resolves_or_fires_as_absent_says_the_source_fails_to_scrape() -> None:
    rules = SHARE_RULE + "absent_for_s = 120\n"
    clocks = Clocks()
    mon, sink = monitor(rules, flapping(lambda n: n > 22), clocks)
    try:
        for _ in range(22):  # fires at 300 s, then from 330 s the learner's scrapes time out for good
            mon.step()
            clocks.tick(15)
        assert delivered(mon, sink) == [("cold_start_share", "firing")]
        sent = []
        for _ in range(9):
            sent += mon.step()
            clocks.tick(15)
        why = "source learner failing to scrape for {}s (no answer within scrape_timeout_s=5s)"
        # it said "no longer holds (no data)" and "no data for share for 120s", as if the share had dropped or the
        # learner had stopped exporting it, with the learner down
        assert [(a.state.value, a.kind.value, a.message) for a in sent] == [
            ("resolved", "series", f"cold_start_share: share > 0.5 no longer holds (no data: {why.format(60)})"),
            ("firing", "absent", f"cold_start_share: no data for share for 120s: {why.format(120)}")]
    finally:
        mon.close(5)


# -- restarts ------------------------------------------------------------------------------------------
def restart_rules(state: Path) -> str:
    return f"""
state_path = "{state}"
[[rule]]
name = "cold_start_share"
expr = "share"
op = ">"
threshold = 0.5
for_s = 300
[[rule]]
name = "learner_lag"
expr = "sum(lag)"
op = ">"
threshold = 500
absent_for_s = 60
"""


def shares(values: list[str]) -> Callable[[], Snapshot]:
    it = iter(values)
    return lambda: Snapshot.from_texts({"learner": next(it)})


def test_a_restart_resolves_an_alert_that_cleared_while_the_monitor_was_down(tmp_path: Path) -> None:
    clocks = Clocks()
    mon, sink = monitor(restart_rules(tmp_path / "state.json"), shares(["share 0.9\nlag 3\n"] * 21), clocks)
    for _ in range(21):
        mon.step()
        clocks.tick(15)
    assert delivered(mon, sink) == [("cold_start_share", "firing")]
    mon.close(5)  # SIGTERM: a deploy restarts the monitor, and the burst of new users ends meanwhile
    clocks.tick(120)
    clocks.mono = 7.0  # a new process: the monotonic clock has another origin
    mon, sink = monitor(restart_rules(tmp_path / "state.json"), shares(["share 0.1\nlag 3\n"] * 3), clocks)
    try:
        [resolved] = mon.step()  # the old monitor forgot it was firing: no resolved, ever
        assert (resolved.rule, resolved.state, resolved.value, resolved.labels) == (
            "cold_start_share", AlertState.RESOLVED, 0.1, {})
        clocks.tick(15)
        assert mon.step() == []
    finally:
        mon.close(5)


def test_an_alert_firing_when_its_rule_is_renamed_or_removed_is_resolved_after_the_restart(tmp_path: Path) -> None:
    clocks = Clocks()
    rules = restart_rules(tmp_path / "state.json").replace('expr = "share"', 'expr = "share"\nseverity = "critical"'
                                                          '\nlabels = { team = "ranking" }')
    mon, sink = monitor(rules, shares(['share{field="user_id"} 0.9\nlag 3\n'] * 21), clocks)
    for _ in range(21):
        mon.step()
        clocks.tick(15)
    assert mon.sink.wait_idle(10)  # (the queued sink delivers on its own thread)
    [fired] = sink.got
    mon.close(5)
    clocks.tick(30)
    renamed = rules.replace('name = "cold_start_share"', 'name = "new_user_share"')  # a deploy renames the rule
    mon, sink = monitor(renamed, shares(['share{field="user_id"} 0.9\nlag 3\n'] * 3), clocks)
    try:
        # the old monitor skipped the old rule's record: the receiver showed its alert firing for ever
        [resolved] = [a for a in mon.step() if a.rule == "cold_start_share"]
        assert (resolved.state, resolved.fingerprint, resolved.severity, resolved.labels, resolved.kind) == (
            AlertState.RESOLVED, fired.fingerprint, Severity.CRITICAL, fired.labels, fired.kind)
        assert "no longer in the rules file" in resolved.message
        assert delivered(mon, sink) == [("cold_start_share", "resolved")]
        clocks.tick(15)
        assert [a.rule for a in mon.step()] == []  # once, not every evaluation
    finally:
        mon.close(5)
    assert [r["rule"] for r in json.loads((tmp_path / "state.json").read_text())["firing"]] == []  # delivered


def test_an_absence_alert_firing_when_its_rules_absent_for_s_is_removed_is_resolved_after_the_restart(
        tmp_path: Path) -> None:
    clocks = Clocks()
    mon, sink = monitor(restart_rules(tmp_path / "state.json"), shares(["share 0.1\n"] * 6), clocks)
    for _ in range(6):  # no lag for 75 s: learner_lag's absence alert fires
        mon.step()
        clocks.tick(15)
    assert mon.sink.wait_idle(10)  # (the queued sink delivers on its own thread)
    [fired] = sink.got
    assert (fired.rule, fired.kind.value) == ("learner_lag", "absent")
    mon.close(5)
    without = restart_rules(tmp_path / "state.json").replace("absent_for_s = 60\n", "")
    mon, sink = monitor(without, shares(["share 0.1\n"] * 3), clocks)
    try:
        [resolved] = mon.step()  # it was skipped: the absence alert stayed firing at the receivers
        assert (resolved.rule, resolved.state, resolved.fingerprint, resolved.kind) == (
            "learner_lag", AlertState.RESOLVED, fired.fingerprint, fired.kind)
        assert "absent_for_s" in resolved.message
    finally:
        mon.close(5)


def test_a_restart_announces_what_still_fires_at_once_and_only_once(tmp_path: Path) -> None:
    clocks = Clocks()
    mon, sink = monitor(restart_rules(tmp_path / "state.json"), shares(["share 0.9\n"] * 21), clocks)
    for _ in range(21):  # the share fires at 300 s; the lag has been absent 60 s by then
        mon.step()
        clocks.tick(15)
    assert sorted(delivered(mon, sink)) == [("cold_start_share", "firing"), ("learner_lag", "firing")]
    mon.close(5)
    clocks.tick(30)
    mon, sink = monitor(restart_rules(tmp_path / "state.json"), shares(["share 0.9\n"] * 30), clocks)
    try:
        again = mon.step()  # sent again (it may never have been delivered), not after another for_s
        assert sorted((a.rule, a.state.value, a.labels.get("absent")) for a in again) == [
            ("cold_start_share", "firing", None), ("learner_lag", "firing", "true")]
        for _ in range(29):
            clocks.tick(15)
            assert mon.step() == []  # still firing: nothing more, and the absence does not resolve
        assert {s.rule: s.state.value for s in mon.engine.status()} == {"cold_start_share": "firing",
                                                                         "learner_lag": "firing"}
    finally:
        mon.close(5)


def test_an_unreadable_state_file_is_logged_and_monitoring_goes_on(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    state = tmp_path / "state.json"
    state.write_text('{"firing": [{"rule": "cold_start_share", "labels": {}, "since": 1, "value": "lots"}, 3]}')
    clocks = Clocks()
    with caplog.at_level(logging.ERROR, logger="streamrec.monitor"):
        mon, sink = monitor(restart_rules(state), shares(["share 0.1\nlag 3\n"]), clocks)
    try:
        assert "2 malformed record(s) skipped" in caplog.text
        assert mon.step() == []
    finally:
        mon.close(5)
    state.write_bytes(b"\xff not json")
    with caplog.at_level(logging.ERROR, logger="streamrec.monitor"):
        mon, sink = monitor(restart_rules(state), shares(["share 0.1\nlag 3\n"]), clocks)
    try:
        assert "cannot read it" in caplog.text and mon.step() == []
    finally:
        mon.close(5)


def test_a_state_file_nested_too_deeply_to_parse_is_logged_and_monitoring_starts_without_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = tmp_path / "state.json"
    state.write_text("[" * 100_000)  # 100 KB, well under the size bound: json.loads raised RecursionError
    clocks = Clocks()
    with caplog.at_level(logging.ERROR, logger="streamrec.monitor"):
        mon, sink = monitor(restart_rules(state), shares(["share 0.9\nlag 3\n"]), clocks)
    try:
        assert "cannot read it" in caplog.text
        assert mon.step() == []
    finally:
        mon.close(5)


def test_a_state_file_record_with_a_number_out_of_range_is_skipped_not_a_crash(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = tmp_path / "state.json"
    huge = "1" + "0" * 400  # an integer no float holds
    records = ['{"rule": "cold_start_share", "labels": {}, "since": ' + huge + ', "value": 1}',
               '{"rule": "cold_start_share", "labels": {}, "since": -Infinity, "value": 1}',
               '{"rule": "cold_start_share", "labels": {}, "since": 1, "value": ' + huge + '}',
               '{"rule": "learner_lag", "labels": {"absent": "true"}, "since": 1, "value": null}']
    state.write_text('{"version": 1, "firing": [' + ", ".join(records) + "]}")
    clocks = Clocks()
    with caplog.at_level(logging.ERROR, logger="streamrec.monitor"):
        mon, sink = monitor(restart_rules(state), shares(["share 0.9\n"] * 3), clocks)  # was OverflowError
    try:
        assert "3 malformed record(s) skipped" in caplog.text
        assert [(a.rule, a.state.value) for a in mon.step()] == [("learner_lag", "firing")]
        assert firing_in(state) == ["learner_lag"]  # the file is written again (-Infinity: ValueError each time)
    finally:
        mon.close(5)
    assert firing_in(state) == ["learner_lag"]


def test_a_state_file_that_cannot_be_written_is_logged_once_and_written_when_it_can(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "state"
    blocker.write_text("a file where the state file's directory should be")
    clocks = Clocks()
    mon, sink = monitor(restart_rules(blocker / "state.json"), shares(["share 0.9\nlag 3\n"] * 30), clocks)
    try:
        with caplog.at_level(logging.ERROR, logger="streamrec.monitor"):
            for _ in range(25):  # pending from the first evaluation, firing at 300 s: every write fails
                mon.step()
                clocks.tick(15)
        assert delivered(mon, sink) == [("cold_start_share", "firing")]
        assert sum("cannot write it" in r.message for r in caplog.records) == 1
        assert mon.state_file is not None and mon.state_file.failures == 25
        blocker.unlink()
        mon.step()  # no alert this time, but the state still waits to be written
        assert [r["rule"] for r in json.loads((blocker / "state.json").read_text())["firing"]] == ["cold_start_share"]
    finally:
        mon.close(5)



def firing_in(state: Path) -> list[str]:
    return [r["rule"] for r in json.loads(state.read_text())["firing"]]


def firing_then_webhook_down(rules: str, clocks: Clocks) -> tuple[Monitor, ListSink]:
    """A monitor whose cold_start_share alert fired (delivered), its sink then failing every attempt."""
    mon, sink = monitor(rules, shares(["share 0.9\nlag 3\n"] * 21 + ["share 0.1\nlag 3\n"]), clocks)
    for _ in range(21):
        mon.step()
        clocks.tick(15)
    assert delivered(mon, sink) == [("cold_start_share", "firing")]
    sink.fail = 10**6  # the webhook goes down
    return mon, sink


def test_a_resolved_alert_left_queued_at_shutdown_is_resolved_again_after_the_restart(tmp_path: Path) -> None:
    state, clocks = tmp_path / "state.json", Clocks()
    mon, sink = firing_then_webhook_down(restart_rules(state), clocks)  # just as the burst of new users ends
    assert [(a.rule, a.state.value) for a in mon.step()] == [("cold_start_share", "resolved")]
    assert mon.close(0.2) == 1  # SIGTERM: the resolved alert is still queued
    assert firing_in(state) == ["cold_start_share"]  # was []: the receiver would show it firing for ever
    clocks.tick(60)
    clocks.mono = 7.0
    mon, sink = monitor(restart_rules(state), shares(["share 0.1\nlag 3\n"] * 3), clocks)
    try:
        assert [(a.rule, a.state.value, a.value) for a in mon.step()] == [("cold_start_share", "resolved", 0.1)]
        assert delivered(mon, sink) == [("cold_start_share", "resolved")]
        clocks.tick(15)
        assert mon.step() == [] and firing_in(state) == []
    finally:
        mon.close(5)


def test_a_second_stop_signal_ends_the_drain_and_the_state_file_is_still_saved(tmp_path: Path) -> None:
    """SIGTERM stops the monitor, which then drains its queued alerts for up to close_timeout_s; a second SIGTERM
    during that drain (an impatient operator, a supervisor) killed the process: the default handlers were back, so no
    summary and no last save of the state file. The second signal now ends the drain; the resolve still queued is
    kept firing in the state file (resolved again after the restart) and the previous handlers are put back."""
    state, clocks = tmp_path / "state.json", Clocks()
    mon, _sink = firing_then_webhook_down(restart_rules(state), clocks)
    assert [(a.rule, a.state.value) for a in mon.step()] == [("cold_start_share", "resolved")]
    queue = mon.sink
    assert isinstance(queue, QueuedSink)

    def signal_twice() -> None:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)  # the stop
        while queue._close_deadline is None:  # the drain has begun (its deadline: close_timeout_s, 10 s away)
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)  # the second one

    before = signal.getsignal(signal.SIGTERM)
    sender = threading.Thread(target=signal_twice)
    sender.start()
    try:
        assert mon.run_until_signalled() == 1  # the resolve, undelivered
    finally:
        sender.join()
    assert firing_in(state) == ["cold_start_share"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_handler_not_set_from_python_is_put_back_as_the_default_after_the_monitor_stops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``signal.signal`` returns None for a handler a C library or an embedding program installed: putting that back
    was ``signal.signal(sig, None)``, a TypeError from run_until_signalled's ``finally`` that replaced its count of
    undelivered alerts (``stream/stop_signals.py`` puts back the default for it)."""
    state, clocks = tmp_path / "state.json", Clocks()
    mon, _sink = firing_then_webhook_down(restart_rules(state), clocks)
    real, saved = signal.signal, {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def installed_outside_python(sig: int, handler: object) -> object:
        previous = real(sig, handler)  # type: ignore[arg-type]
        return None if handler not in (signal.SIG_DFL, signal.SIG_IGN) else previous

    def stop_soon() -> None:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(signal, "signal", installed_outside_python)
    sender = threading.Thread(target=stop_soon)
    sender.start()
    try:
        assert mon.run_until_signalled() >= 0
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    finally:
        sender.join()
        for sig, handler in saved.items():
            real(sig, handler)


def test_a_second_stop_signal_while_the_last_evaluation_runs_ends_the_drain_too(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator's second SIGTERM that comes before the drain begins (the evaluation in hand still querying its
    sources, which may take their timeouts) was counted as the stop itself: the drain then ran its whole
    close_timeout_s and a third signal was needed. Every signal past the first ends the drain."""
    state, clocks = tmp_path / "state.json", Clocks()
    rules = restart_rules(state) + "[sinks]\nclose_timeout_s = 3\n"
    mon, sink = firing_then_webhook_down(rules, clocks)
    step = mon.step

    def step_signalled_twice() -> list[Alert]:
        out = step()  # the resolve, queued
        os.kill(os.getpid(), signal.SIGTERM)  # the stop
        os.kill(os.getpid(), signal.SIGTERM)  # the second one, this evaluation still in hand
        return out

    monkeypatch.setattr(mon, "step", step_signalled_twice)
    with caplog.at_level(logging.WARNING, logger="streamrec.alerts"):
        assert mon.run_until_signalled() == 1  # the resolve, undelivered
    assert "SIGTERM during the alert drain at shutdown: the drain ends now" in caplog.text
    assert firing_in(state) == ["cold_start_share"]


def test_the_state_file_keeps_a_resolved_series_until_its_alert_is_delivered(tmp_path: Path) -> None:
    state, clocks = tmp_path / "state.json", Clocks()
    rules = restart_rules(state) + "[sinks]\nretry_backoff_s = 0.01\nretry_backoff_max_s = 0.01\n"
    mon, sink = monitor(rules, shares(["share 0.9\nlag 3\n"] * 21 + ["share 0.1\nlag 3\n"] * 3), clocks)
    try:
        for _ in range(21):
            mon.step()
            clocks.tick(15)
        sink.fail = 10**6
        mon.step()
        # written when the alert was queued: a monitor killed now (SIGKILL, a second SIGTERM) resolves it after all
        assert firing_in(state) == ["cold_start_share"]
        clocks.tick(15)
        mon.step()
        assert firing_in(state) == ["cold_start_share"]
        sink.fail = 0
        assert delivered(mon, sink) == [("cold_start_share", "firing"), ("cold_start_share", "resolved")]
        clocks.tick(15)
        mon.step()  # delivered now: a restart must not resolve it once more
        assert firing_in(state) == []
    finally:
        mon.close(5)

# -- scrape targets -----------------------------------------------------------------------------------
class Target:
    """A local scrape target: ``answer(handler)`` writes the answer."""

    def __init__(self, answer: Callable[[BaseHTTPRequestHandler, threading.Event], None]) -> None:
        self.stop = threading.Event()
        self.finished = threading.Event()  # the answer was written whole
        target = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                try:
                    answer(self, target.stop)
                    target.finished.set()
                except OSError:  # the scraper hung up: what these tests want
                    pass
                self.close_connection = True

            do_POST = do_GET  # noqa: N815 - a webhook receiver too

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def target() -> Iterator[Callable[..., Target]]:
    made: list[Target] = []

    def make(answer: Callable[[BaseHTTPRequestHandler, threading.Event], None]) -> Target:
        made.append(Target(answer))
        return made[-1]

    try:
        yield make
    finally:
        for t in made:
            t.close()


def _headers(h: BaseHTTPRequestHandler) -> None:
    h.send_response(200)
    h.send_header("Content-Type", "text/plain")
    h.send_header("Connection", "close")
    h.end_headers()


def test_a_trickling_scrape_target_is_cut_off_at_scrape_timeout_s(target: Callable[..., Target]) -> None:
    def trickle(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
        _headers(h)
        for _ in range(600):  # a comment byte every 0.1 s: 60 s in all, each read well within the timeout
            if stop.wait(0.1):
                return
            h.wfile.write(b"#")
            h.wfile.flush()
        h.wfile.write(b"\nstreamrec_x 1\n")

    t = target(trickle)
    snap = Scraper({"slow": t.url}, timeout_s=0.5).scrape()
    assert snap.errors == {"slow": f"{t.url}: no answer within scrape_timeout_s=0.5s"}
    assert not t.finished.is_set()  # cut off while the target was still sending (it used to wait it out)
    assert snap.metrics == {}


def test_sources_are_scraped_at_once_so_one_that_hangs_does_not_add_its_timeout_to_the_next() -> None:
    both = threading.Barrier(2)

    def answer_once_both_asked(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
        try:
            both.wait(5)  # scraped one after the other, the first waits here until it is cut off
        except threading.BrokenBarrierError:
            return
        _headers(h)
        h.wfile.write(b"streamrec_x 1\n")

    a, b = Target(answer_once_both_asked), Target(answer_once_both_asked)
    try:
        snap = Scraper({"a": a.url, "b": b.url}, timeout_s=2).scrape()
        assert snap.errors == {} and snap.metrics["streamrec_x"][()].sources == frozenset({"a"})
    finally:
        a.close()
        b.close()


def test_more_hanging_sources_than_threads_still_end_the_round_at_scrape_timeout_s(
        target: Callable[..., Target]) -> None:
    # each fetch had scrape_timeout_s from when a thread took it, so every MAX_PARALLEL hanging sources added one more
    # scrape_timeout_s to the round (17 hanging sources: two of them), delaying every rule's evaluation
    asked: list[str] = []

    def hang(name: str) -> Callable[[BaseHTTPRequestHandler, threading.Event], None]:
        def answer(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
            asked.append(name)
            stop.wait(30)
        return answer

    class OneThread(Scraper):
        MAX_PARALLEL = 1

    first, second = target(hang("first")), target(hang("second"))
    snap = OneThread({"first": first.url, "second": second.url}, timeout_s=0.5).scrape()
    assert {name: err.split(": ", 1)[1] for name, err in snap.errors.items()} == {
        "first": "no answer within scrape_timeout_s=0.5s", "second": "no answer within scrape_timeout_s=0.5s"}
    assert "second" not in asked  # it waited for the thread until the round's deadline: not scraped at all


def test_a_sources_scrape_errors_are_exported_as_0_before_its_first_failure_so_increase_counts_that_one(
        target: Callable[..., Target]) -> None:
    def down(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
        h.send_error(500)

    t = target(down)
    errors = {"source": "rv_first_failure"}
    scraper = Scraper({"rv_first_failure": t.url}, timeout_s=5)
    # exported from the start: a series that appears at 1 is no increase() to Prometheus, so the first failure
    # (and a source that failed once only) went unseen by any rule on the monitor's own metrics
    assert REGISTRY.get_sample_value("streamrec_monitor_scrape_errors_total", errors) == 0
    assert scraper.scrape().errors
    assert REGISTRY.get_sample_value("streamrec_monitor_scrape_errors_total", errors) == 1


def test_an_answer_larger_than_scrape_max_bytes_is_a_failed_scrape(target: Callable[..., Target],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scrape_mod, "SCRAPE_MAX_BYTES", 10_000)

    def huge(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
        _headers(h)
        h.wfile.write(b"streamrec_x 1\n" + b"# padding\n" * 2_000)

    t = target(huge)
    snap = Scraper({"big": t.url}, timeout_s=10).scrape()
    assert snap.errors == {"big": f"{t.url}: the answer is larger than 10000 bytes; not read further"}
    assert snap.metrics == {}


def test_a_label_value_that_is_not_utf8_fails_the_scrape_not_read_as_a_replacement_character(
        target: Callable[..., Target]) -> None:
    def latin1(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
        _headers(h)
        h.wfile.write(b'streamrec_x{city="K\xf6ln"} 1\n')  # Latin-1: Prometheus refuses, invalid UTF-8 label value

    t = target(latin1)
    snap = Scraper({"bad": t.url}, timeout_s=10).scrape()
    assert snap.errors["bad"].startswith(f"{t.url}: line 1: ") and "not valid UTF-8" in snap.errors["bad"]
    assert snap.metrics == {}  # was read as city="K\ufffdln"


def test_a_scrape_target_answering_in_chunks_or_with_an_error_status(target: Callable[..., Target]) -> None:
    def chunked(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
        h.protocol_version = "HTTP/1.1"
        h.send_response(200)
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        for part in (b"streamrec_x 1\n", b'streamrec_y{f="a"} 2\n'):
            h.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
        h.wfile.write(b"0\r\n\r\n")

    def missing(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
        h.send_error(404)

    ok, gone = target(chunked), target(missing)
    snap = Scraper({"ok": ok.url, "gone": gone.url}, timeout_s=10).scrape()
    assert sorted(snap.metrics) == ["streamrec_x", "streamrec_y"] and snap.metrics["streamrec_y"][(("f", "a"),)]
    assert snap.errors == {"gone": f"{gone.url}: HTTP 404 Not Found"}


def test_an_answer_cut_off_mid_line_or_before_its_first_byte_is_a_failed_scrape(
        target: Callable[..., Target]) -> None:
    def cut_mid_value(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
        _headers(h)  # HTTP/1.0, no Content-Length: the answer ends where the connection does
        h.wfile.write(b"streamrec_x 1\nstreamrec_lag 12")  # the target died while writing 12345\n

    def cut_before_the_body(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
        _headers(h)

    mid, empty = target(cut_mid_value), target(cut_before_the_body)
    snap = Scraper({"mid": mid.url, "empty": empty.url}, timeout_s=10).scrape()
    assert sorted(snap.errors) == ["empty", "mid"]  # streamrec_lag read 12 and the empty answer read as healthy
    assert "cut off" in snap.errors["mid"] and "cut off" in snap.errors["empty"]
    assert snap.metrics == {} and snap.raw == {}


def test_a_malformed_answer_gives_no_series_not_some() -> None:
    class Garbled(Scraper):
        def fetch(self, url: str) -> str:
            return 'streamrec_a 1\nstreamrec_b{x="1"} oops\nstreamrec_c 3\n'

    snap = Garbled({"learner": "http://127.0.0.1:1/metrics"}).scrape()
    assert list(snap.errors) == ["learner"] and "oops" in snap.errors["learner"]
    assert snap.metrics == {} and snap.raw == {}  # streamrec_a, before the bad line, used to be kept


def test_a_webhooks_refusal_reason_is_kept_when_it_hangs_up_after_answering(target: Callable[..., Target]) -> None:
    class Refuse(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(400)
            self.send_header("Connection", "close")  # no Content-Length: the body ends when it hangs up
            self.end_headers()
            self.wfile.write(b"unknown field: labels")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/hook"
        assert post_json(url, b"{}", time.monotonic() + 10) == (400, "Bad Request", b"unknown field: labels", None)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


# -- close ------------------------------------------------------------------------------------------
def test_a_user_and_password_in_a_webhook_or_source_url_are_sent_as_basic_auth(
        target: Callable[..., Target]) -> None:
    seen: list[str | None] = []

    def guarded(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
        h.rfile.read(int(h.headers.get("Content-Length") or 0))
        seen.append(h.headers.get("Authorization"))
        if seen[-1] != "Basic " + base64.b64encode("alert bot:pä:ss".encode()).decode():
            h.send_error(401)  # was every request: the alerts dropped as rejected, every scrape failed
            return
        _headers(h)
        h.wfile.write(b"streamrec_x 1\n")

    t = target(guarded)
    url = t.url.replace("http://", "http://alert%20bot:p%C3%A4%3Ass@")
    WebhookSink(url, timeout_s=5).send([Alert("r", "s", Severity.WARNING, AlertState.FIRING, 1.0, 0.0, "m", 1)])
    snap = Scraper({"guarded": url}, timeout_s=5).scrape()
    assert snap.errors == {} and snap.metrics["streamrec_x"][()].value == 1.0
    assert len(seen) == 2
    Scraper({"open": t.url}, timeout_s=5).scrape()  # no user in the URL: no header
    assert seen[-1] is None


def test_an_attempt_close_gave_up_on_that_delivers_after_all_says_so(caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()

    class Slow(ListSink):
        timeout_s = 30.0

        def send(self, alerts: Sequence[Alert], deadline: float | None = None) -> None:
            release.wait(10)
            super().send(alerts, deadline)

    sink = Slow()
    queued = QueuedSink(sink, SinkSettings())
    queued.send([Alert("r", "learner", Severity.WARNING, AlertState.FIRING, 1.0, 0.5, "m", 1)])
    deadline = time.monotonic() + 10
    while queued.depth and not queued._in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    with caplog.at_level(logging.WARNING, logger="streamrec.alerts"):
        assert queued.close(0.05) == 1  # the attempt (its own deadline 30 s) still runs: reported undelivered
        release.set()
        queued._thread.join(10)
    assert len(sink.got) == 1  # ... yet it got through: the log says so rather than leave "undelivered" standing
    assert "an attempt cut off at close delivered 1 alert(s) after all" in caplog.text



def test_close_tries_a_sink_that_is_backing_off_at_once() -> None:
    sink = ListSink(fail=10**9)  # down
    queued = QueuedSink(sink, SinkSettings(retry_backoff_s=0.01, retry_backoff_max_s=3600))
    a = Alert("r", "learner", Severity.WARNING, AlertState.RESOLVED, 0.1, 0.5, "m", 1)
    try:
        queued.send([a])
        deadline = time.monotonic() + 10
        while queued.stats.failed < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        with queued._cond:  # as after an hour-long outage: the next retry is due an hour from now
            queued._retry_at = time.monotonic() + 3600
        sink.fail = 0  # the sink answers again; then SIGTERM: close gets 5 s (it used to wait them out, idle)
        assert queued.close(5) == 0
        assert sink.got == [a] and queued.stats.dropped == {}
    finally:
        queued.close(0)
