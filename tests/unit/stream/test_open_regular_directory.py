"""``stream.files.open_regular`` given a directory: refused as every other file that is not a regular one, naming the
path, and the descriptor it opened closed. ``os.fdopen`` refused the directory itself before the check: the error read
"[Errno 21] Is a directory: 3" (the descriptor's number, not the path: ``streamrec report --summary DIR`` said only
that) and the descriptor leaked."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from stream.files import NotRegularFile, read_regular, read_tail, sha256_file
from streamrec.cli import main


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("read", [lambda p: read_regular(p, 100, "a state file"), lambda p: read_tail(p, 100),
                                  sha256_file], ids=["read_regular", "read_tail", "sha256_file"])
def test_a_directory_is_refused_naming_its_path_and_leaks_no_descriptor(read, tmp_path: Path) -> None:
    before = open_fds()
    with pytest.raises(NotRegularFile, match=rf"^{tmp_path} is not a regular file \(mode d"):
        read(tmp_path)
    assert open_fds() == before


def test_report_given_a_directory_as_a_summary_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run-log.jsonl").write_text("")
    (summary := tmp_path / "replay.json").mkdir()
    assert main(["report", "--run-log", str(tmp_path / "run-log.jsonl"), "--summary", str(summary),
                 "--out", str(tmp_path / "r.html")]) == 2
    assert f"streamrec report: error: {summary} is not a regular file" in capsys.readouterr().err


def test_report_follow_of_a_directory_says_it_is_no_run_log_instead_of_waiting_for_one(tmp_path: Path) -> None:
    # the fd's IsADirectoryError was taken as "not written yet": it printed "waiting for the run log", and without
    # --pid waited for good; at the end it said the run log "never appeared", of a path that exists
    from monitor.follow import FollowError, follow

    out = io.StringIO()
    with pytest.raises(FollowError, match=rf"^{tmp_path} is not a regular file .*not a run log"):
        follow(tmp_path, "learner", iter([True, False]).__next__, out, every_s=0.0)
    assert "waiting" not in out.getvalue()
