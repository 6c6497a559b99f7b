"""``streamrec report``: --follow says what it waits for and fails when there is nothing to follow (a run log
that does not exist waited for ever without a word; a dead --pid exited 0 silently); --out naming a directory
leaves no .tmp file behind; the error lines carry the command's prefix once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamrec.cli import main
from tests.unit.monitor.test_report import learner_text, run_monitor
from tests.unit.monitor.test_report_hostile import drawing_only


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_follow_with_a_pid_that_is_not_running_fails_clearly(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    log = run_monitor(tmp_path, [learner_text(0, 0.7, (0, 0, 0), 0)])
    pid = dead_pid()
    assert main(["report", "--run-log", str(log), "--follow", "learner", "--pid", str(pid)]) == 1
    err = capsys.readouterr().err
    assert f"streamrec report: error: --pid {pid}: no such process is running" in err
    assert main(["report", "--run-log", str(log), "--follow", "learner", "--pid", "-1"]) == 1  # not a group


def test_follow_says_it_waits_for_a_missing_run_log_and_fails_if_it_never_appears(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nolog.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    try:
        assert main(["report", "--run-log", str(missing), "--follow", "learner", "--pid", str(proc.pid)]) == 1
    finally:
        proc.wait()
    err = capsys.readouterr().err
    assert err.startswith(f"waiting for the run log {missing} (streamrec monitor writes it")
    assert f"streamrec report: error: the run log {missing} never appeared" in err


def test_out_naming_a_directory_is_one_error_and_leaves_no_temp_file(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    log = run_monitor(tmp_path, [learner_text(0, 0.7, (0, 0, 0), 0)])
    adir = tmp_path / "adir"
    adir.mkdir()
    assert main(["report", "--run-log", str(log), "--out", str(adir)]) == 2
    assert f"streamrec report: error: {adir} is a directory" in capsys.readouterr().err
    assert not (tmp_path / "adir.tmp").exists()


def test_a_failed_write_removes_its_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    drawing_only(monkeypatch)  # the write is what this proves: the page with no plot on it
    log = run_monitor(tmp_path, [learner_text(0, 0.7, (0, 0, 0), 0)])
    before = sorted(tmp_path.iterdir())

    def refuse(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)  # the report is written by stream.files.write_atomic
    assert main(["report", "--run-log", str(log), "--out", str(tmp_path / "r.html")]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert sorted(tmp_path.iterdir()) == before  # no temp file, no report


def test_report_alone_names_what_to_give_with_one_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report"]) == 2
    assert capsys.readouterr().err == "streamrec report: error: give --run-log FILE or --run-dir DIR\n"


def test_config_is_read_a_missing_one_is_an_error_and_its_publish_root_and_deltas_dir_are_the_defaults(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--config was accepted and ignored: a file that does not exist gave exit 0, and its [refresh] publish_root and
    [learner] deltas_dir were not where the report looked for last_run.json and the delta files."""
    import json

    monkeypatch.chdir(tmp_path)  # (the built-in defaults are under ./.streamrec: nothing there)
    drawing_only(monkeypatch, "s_fresh")  # the one section reading last_run.json and the deltas
    log = run_monitor(tmp_path, [learner_text(0, 0.7, (0, 0, 0), 0)])
    assert main(["report", "--run-log", str(log), "--config", str(tmp_path / "nope.toml")]) == 2
    assert "config file" in capsys.readouterr().err and not (tmp_path / "report.html").exists()
    root, deltas = tmp_path / "pub", tmp_path / "deltas"
    root.mkdir()
    deltas.mkdir()
    (root / "last_run.json").write_text(json.dumps({"version": "v-from-config", "last_success": 1000.5,
                                                   "last_success_utc": "1970-01-01T00:16:40Z"}))
    (deltas / "delta-1-10.delta").write_bytes(b"")
    cfg = tmp_path / "s.toml"
    cfg.write_text(f'[refresh]\npublish_root = "{root}"\n[learner]\ndeltas_dir = "{deltas}"\n')
    out = tmp_path / "r.html"
    def fresh_points() -> int:
        capsys.readouterr()
        assert main(["report", "--run-log", str(log), "--config", str(cfg), "--out", str(out), "--json"]) == 0
        return int(json.loads(capsys.readouterr().out)["sections"]["freshness"]["points"])

    with_delta = fresh_points()  # the publish (last_run.json) and the delta file are points of it
    assert "v-from-config" in out.read_text()
    monkeypatch.setenv("STREAMREC_REFRESH_PUBLISH_ROOT", str(tmp_path / "elsewhere"))  # the environment overrides
    monkeypatch.setenv("STREAMREC_LEARNER_DELTAS_DIR", str(tmp_path / "elsewhere"))
    assert fresh_points() < with_delta and "v-from-config" not in out.read_text()



def test_summary_takes_several_files_after_one_flag_as_readme_writes_it() -> None:
    # README: `streamrec report --run-log FILE --summary F... --out report.html`; `--summary join.json train.json`
    # was "unrecognized arguments: train.json" (the flag took one file, repeated)
    from streamrec.cli import build_parser

    args = build_parser().parse_args(["report", "--run-log", "r.jsonl", "--summary", "join.json", "train.json",
                                      "--summary", "refresh.json", "--out", "report.html"])
    assert args.summary == ["join.json", "train.json", "refresh.json"]
