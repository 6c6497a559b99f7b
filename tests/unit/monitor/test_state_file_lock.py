"""One monitor a state file (``monitor/state_file.py``: ``FiringStateFile.hold``): two monitors on one ``state_path``
both sent every alert and each overwrote the other's records; the second is refused, naming the first's pid and the
lock file, and starts once the first has closed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from monitor.delivery import QueuedSink
from monitor.engine import Monitor
from monitor.rules import loads_rules
from stream.errors import ConfigError
from tests.unit.monitor.test_engine_faults import Clocks, ListSink, monitor, shares
from tests.unit.monitor.test_pending_restart import rules


def test_a_second_monitor_on_one_state_file_is_refused_naming_the_first_ones_pid_and_the_lock(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    first, _ = monitor(rules(state), shares(["share 0.9\n"]), Clocks())
    try:
        config = loads_rules(rules(state))
        sink = QueuedSink(ListSink(), config.sinks)  # what streamrec monitor closes when the monitor is refused
        try:
            with pytest.raises(ConfigError, match=rf"state file {state} is in use by another monitor "
                                                  rf"\(pid {os.getpid()}, holding {state}\.lock\)"):
                Monitor(config, sink, scrape=shares(["share 0.9\n"]))
        finally:
            sink.close(0)
    finally:
        first.close(5)
    second, _ = monitor(rules(state), shares(["share 0.9\n"]), Clocks())  # free once the first has closed
    second.close(5)


def test_a_state_file_lock_that_cannot_be_taken_is_logged_and_the_monitor_starts(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = tmp_path / "state.json"
    (tmp_path / "state.json.lock").mkdir()  # no regular file: flock cannot be taken there
    mon, _ = monitor(rules(state), shares(["share 0.9\n"]), Clocks())
    mon.close(5)
    assert any("cannot take its lock" in r.getMessage() and "not detected" in r.getMessage() for r in caplog.records)


def test_a_monitor_refused_for_its_run_log_leaves_the_state_file_free(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    config = loads_rules(rules(state) + f'\n[run_log]\npath = "{tmp_path}"\n')  # a directory: cannot be appended to
    sink = QueuedSink(ListSink(), config.sinks)
    try:
        with pytest.raises(ConfigError, match="run_log"):
            Monitor(config, sink, scrape=shares(["share 0.9\n"]))
    finally:
        sink.close(0)
    mon, _ = monitor(rules(state), shares(["share 0.9\n"]), Clocks())  # before: refused, the lock still held
    mon.close(5)
