"""The firing-state file stays within the size its next start reads (MAX_STATE_FILE_BYTES, made small here): a series
with a huge scraped label value made the monitor write a file its restart refused whole, so no alert firing before the
restart ever resolved. Each test failed before the fix."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from monitor import state_file
from monitor.alerts import WebhookSink
from monitor.scrape import Snapshot
from monitor.state_file import FiringStateFile
from tests.unit.monitor.test_engine_faults import Clocks, delivered, monitor, restart_rules

LIMIT = 20_000  # bytes a start reads, in place of the 16 MiB of MAX_STATE_FILE_BYTES
BIG = "\u4e2d" * 4_000  # 12 KB of UTF-8 in the scrape, 24 KB as JSON writes it (\\u4e2d)


def record(rule: str, labels: dict[str, str]) -> dict[str, object]:
    return {"rule": rule, "labels": labels, "since": 1.0, "value": 2.0}


def test_a_state_file_too_large_to_read_back_is_written_without_its_largest_records_saying_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(state_file, "MAX_STATE_FILE_BYTES", LIMIT)
    f = FiringStateFile(tmp_path / "state.json")
    small = [record("a", {"i": str(i)}) for i in range(50)]
    with caplog.at_level(logging.ERROR, logger="streamrec.monitor"):
        f.save([*small, record("huge", {"user": BIG})], [{**record("b", {}), "held": 1.0, "condition": "> 1"}])
        f.save([*small, record("huge", {"user": BIG})])
    assert (tmp_path / "state.json").stat().st_size <= LIMIT
    assert f.read()[0] == small  # was: nothing ("holds more than 20000 bytes"), the small records lost with it
    [said] = [r.getMessage() for r in caplog.records]  # once while it stays too large
    assert "1 largest record(s) (rules huge) are left out" in said and "may not resolve" in said


def test_a_restart_resolves_what_cleared_meanwhile_though_a_series_with_a_huge_label_fired_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_file, "MAX_STATE_FILE_BYTES", LIMIT)
    state, clocks = tmp_path / "state.json", Clocks()
    answers = iter([f'share{{user="{BIG}"}} 0.9\nshare 0.9\nlag 3\n'] * 21)
    mon, sink = monitor(restart_rules(state), lambda: Snapshot.from_texts({"learner": next(answers)}), clocks)
    for _ in range(21):
        mon.step()
        clocks.tick(15)
    assert delivered(mon, sink) == [("cold_start_share", "firing")] * 2
    mon.close(5)
    assert [r["labels"] for r in json.loads(state.read_text())["firing"]] == [{}]
    clocks.tick(60)
    clocks.mono = 7.0  # a new process
    mon, sink = monitor(restart_rules(state), lambda: Snapshot.from_texts({"learner": "share 0.1\nlag 3\n"}), clocks)
    try:
        assert [(a.rule, a.state.value, a.labels) for a in mon.step()] == [("cold_start_share", "resolved", {})]
    finally:
        mon.close(5)


def test_a_record_of_another_alert_left_out_later_is_said_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Logged once while the file stayed too large: a second huge alert firing later was left out too, and nothing
    named its rule (its alert may not resolve after a restart either)."""
    monkeypatch.setattr(state_file, "MAX_STATE_FILE_BYTES", LIMIT)
    f = FiringStateFile(tmp_path / "state.json")
    small = [record("a", {"i": str(i)}) for i in range(50)]
    with caplog.at_level(logging.ERROR, logger="streamrec.monitor"):
        f.save([*small, record("huge", {"user": BIG})])
        f.save([*small, {**record("huge", {"user": BIG}), "value": 3.0}])  # the same one left out: said once
        f.save([*small, record("huge", {"user": BIG}), record("huge2", {"user": BIG})])
    assert f.read()[0] == small
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "(rules huge)" in said[0] and "(rules huge, huge2)" in said[1], said


def test_a_resolve_queued_shortened_for_its_huge_label_stays_firing_in_the_state_file_until_delivered(
        tmp_path: Path) -> None:
    """A sink queues an alert over WebhookSink.MAX_BODY shortened (a copy): the monitor took the copy's original for
    delivered at once (it looked for the original among the alerts waiting), so an undelivered resolve of a series with
    a scraped label of megabytes left the state file, and after a restart its alert stayed firing at the receiver."""
    state, clocks = tmp_path / "state.json", Clocks()
    huge = "u" * (WebhookSink.MAX_BODY + 1)
    answers = iter([f'share{{user="{huge}"}} 0.9\nlag 3\n'] * 21 + [f'share{{user="{huge}"}} 0.1\nlag 3\n'] * 2)
    mon, sink = monitor(restart_rules(state), lambda: Snapshot.from_texts({"learner": next(answers)}), clocks)
    for _ in range(21):
        mon.step()
        clocks.tick(15)
    assert delivered(mon, sink) == [("cold_start_share", "firing")]
    sink.fail = 10**6  # the webhook goes down
    try:
        assert [(a.rule, a.state.value) for a in mon.step()] == [("cold_start_share", "resolved")]
        clocks.tick(15)
        mon.step()
        assert [r["labels"] for r in json.loads(state.read_text())["firing"]] == [{"user": huge}]  # was: []
    finally:
        assert mon.close(0.2) == 1  # SIGTERM: the resolve still queued
    assert [r["labels"] for r in json.loads(state.read_text())["firing"]] == [{"user": huge}]  # was: []
