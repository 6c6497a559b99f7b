"""The monitor's files (the run log it appends to, its firing-state file) and what ``streamrec report`` reads (the run
log, ``--json`` summaries, ``last_run.json`` by its one reader, ``cache_refresh.run_records.read_last_run``) are
opened with ``stream.files.open_regular`` / ``open_append_regular``: one that is a FIFO or a device is refused (a
ConfigError at the monitor's start, a logged skip of the state, an OSError naming it to the report, no record of the
last run), where a blocking open of a FIFO hung the process for good.

Each FIFO read here is fed a valid file by a writer thread (``tests.fifos``), and the one appended to has a reader
open, so the old code read or opened it and fails on the assertion instead of hanging the run."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from cache_refresh import run_records
from monitor import follow, recording, report
from monitor.rules import RunLogSettings
from monitor.run_log import RunLog
from monitor.state_file import FiringStateFile
from stream.errors import ConfigError
from stream.files import NotRegularFile
from tests.fifos import fed_fifo
from tests.unit.monitor.test_report import learner_text, run_monitor


def test_a_run_log_path_that_is_a_fifo_is_a_config_error_at_start(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    os.mkfifo(path)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # the old blocking open found it and appended into it
    try:
        with pytest.raises(ConfigError, match=r"\[run_log\] path .*run.jsonl.*not a regular file"):
            RunLog(RunLogSettings(path=path)).close()
    finally:
        os.close(reader)
    alone = tmp_path / "alone.fifo"  # (reached by the fixed code only: the old one waited here for a reader)
    os.mkfifo(alone)
    with pytest.raises(ConfigError, match=r"\[run_log\] path .*alone.fifo"):  # ENXIO: refused, not waited on
        RunLog(RunLogSettings(path=alone))


def test_a_firing_state_file_that_is_a_fifo_is_logged_and_monitoring_starts_without_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good = tmp_path / "good.json"
    FiringStateFile(good).save([{"rule": "r", "labels": {}, "since": 10.0, "value": 1.0}])
    assert FiringStateFile(good).load()  # a regular file as before
    with fed_fifo(tmp_path / "state.json", good.read_bytes()) as path:
        assert FiringStateFile(path).load() == []
    assert "not a regular file" in caplog.text


def test_a_run_log_that_is_a_fifo_is_refused_by_the_report(tmp_path: Path) -> None:
    data = run_monitor(tmp_path / "m", [learner_text(0, 0.7, (0, 0, 0), 0)]).read_bytes()
    with fed_fifo(tmp_path / "run.jsonl", data) as path, pytest.raises(NotRegularFile, match="run.jsonl"):
        report.read_run_log(path)


def test_a_summary_or_last_run_that_is_a_fifo_is_refused_by_the_report(tmp_path: Path) -> None:
    summary = json.dumps({"dataset": "ml-1m", "acked": {}}).encode()
    with fed_fifo(tmp_path / "replay.json", summary) as path, pytest.raises(NotRegularFile, match="replay.json"):
        recording.read_summaries([path])
    (tmp_path / "root").mkdir()
    with fed_fifo(tmp_path / "root" / "last_run.json", b'{"last_success": 1}'):
        assert run_records.read_last_run(tmp_path / "root") == {}


def test_a_summary_is_found_at_the_end_of_a_file_larger_than_the_tail_read(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recording, "SUMMARY_TAIL_BYTES", 100)
    path = tmp_path / "replay.json"
    path.write_text("x" * 500 + "\n" + json.dumps({"dataset": "ml-1m", "acked": {}}) + "\n")
    assert recording.read_summaries([path])["replay"]["dataset"] == "ml-1m"


def test_following_a_run_log_that_is_a_fifo_is_a_follow_error_naming_it(tmp_path: Path) -> None:
    data = run_monitor(tmp_path / "m", [learner_text(0, 0.7, (0, 0, 0), 0)]).read_bytes()
    with fed_fifo(tmp_path / "run.jsonl", data) as path, pytest.raises(follow.FollowError, match="not a run log"):
        follow.follow(path, "learner", lambda: False, io.StringIO(), print_every_s=0)
