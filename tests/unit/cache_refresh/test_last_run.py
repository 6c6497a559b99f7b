"""A malformed ``<publish_root>/last_run.json`` is "no record", with a warning naming it (cache_refresh/job.py)."""

from __future__ import annotations

import datetime as dt
import json
import logging
from pathlib import Path

import pytest

from cache_refresh import run_records
from cache_refresh import status as refresh_status
from cache_refresh.scheduler import build_scheduler
from streamrec.cli import main
from tests.fifos import fed_fifo

BAD = [b"[]", b'{"last_success": null}', b'{"last_success": 1e400}', b'{"last_success": true}',
       b'{"last_success": "soon"}', b'{"last_success": [1]}', b'{"last_success": NaN}', b"[" * 100_000,
       b'"x"', b"\xff\xfe", b"{}", b"7", b'{"last_success": -1e300}']


@pytest.mark.parametrize("raw", BAD, ids=["list", "null", "1e400", "bool", "word", "nested", "nan", "deep", "string",
                                           "not-utf8", "empty-object", "number", "before-year-1"])
def test_an_unusable_record_is_no_record_with_a_warning(tmp_path: Path, raw: bytes,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / run_records.LAST_RUN).write_bytes(raw)
    with caplog.at_level(logging.WARNING, logger="streamrec.refresh"):
        assert run_records.read_last_success(tmp_path) is None
    assert str(tmp_path / run_records.LAST_RUN) in caplog.text
    # and the scheduler starts with it: no record, so the run due within the grace is caught up
    now = dt.datetime(2026, 1, 10, 3, 30, tzinfo=dt.timezone.utc)
    sched = build_scheduler(lambda: None, "0 3 * * *", "UTC", 3600, run_records.read_last_success(tmp_path), now=now)
    assert {j.id for j in sched.get_jobs()} == {"refresh", "refresh-missed"}


def test_a_good_record_and_no_file_are_read_without_a_warning(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="streamrec.refresh"):
        assert run_records.read_last_success(tmp_path) is None
        run_records.write_last_success(tmp_path, 1_750_000_000.5, "v1")
        assert run_records.read_last_success(tmp_path) == dt.datetime.fromtimestamp(1_750_000_000.5, tz=dt.timezone.utc)
    assert caplog.text == ""


@pytest.mark.parametrize("raw", [b"[]", b'{"last_success": null}', b'{"last_success": 1e400}', b"[" * 100_000],
                         ids=["list", "null", "1e400", "deep"])
def test_status_with_a_malformed_record_reports_instead_of_a_traceback(tmp_path: Path, raw: bytes,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / run_records.LAST_RUN).write_bytes(raw)
    assert main(["refresh", "--status", "--json", "--publish-root", str(tmp_path)]) == 1  # nothing published
    out = json.loads(capsys.readouterr().out)
    assert out["last_success"] is None and out["current"] is None


def test_a_record_that_is_a_fifo_is_no_record_with_a_warning_not_a_hang(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A blocking open of ``last_run.json`` waited for a writer for good (the scheduler's and ``--status``'s start);
    now it is refused unread. The FIFO is fed a good record, so the old code read it instead of hanging the test."""
    good = json.dumps({"last_success": 1_750_000_000.5, "version": "v1"}).encode()
    with fed_fifo(tmp_path / run_records.LAST_RUN, good), caplog.at_level(logging.WARNING, logger="streamrec.refresh"):
        assert run_records.read_last_success(tmp_path) is None
    assert "not a regular file" in caplog.text
    (tmp_path / run_records.LAST_RUN).unlink()
    with fed_fifo(tmp_path / run_records.LAST_RUN, good):
        assert run_records.read_last_run(tmp_path) == {}


def test_a_publish_with_warnings_is_recorded_as_such_and_status_shows_them_until_the_next_publish(
        tmp_path: Path) -> None:
    """Before, last_run.json and --status of a run published with warnings (refresh_degraded: a lock's close, a
    CURRENT not durable, a prune) read as a clean publish: the warnings were only in an alert and the summary."""
    run_records.write_last_success(tmp_path, 1_750_000_000.5, "v1")
    warned = ["v1 is current, but making that durable failed (EIO)"]
    run_records._record_warnings(tmp_path, "v1", warned)
    assert run_records.read_last_run(tmp_path)["warnings"] == warned
    assert refresh_status.status(tmp_path)["last_run_warnings"] == warned
    run_records._record_warnings(tmp_path, "v0", ["another run's"])  # not the recorded publish's: left as it is
    assert len(run_records.read_last_run(tmp_path)["warnings"]) == 1
    run_records.write_last_success(tmp_path, 1_750_000_100.5, "v2")  # a clean publish replaces the record
    assert "last_run_warnings" not in refresh_status.status(tmp_path)
