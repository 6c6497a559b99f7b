"""``data``, ``report`` and ``evaluate --cold-start`` took ``--config`` and ignored it: a missing file exited 0.
Now every command reads ``--config`` and ``STREAMREC_*`` the same way: an unusable file or variable is one error line
and exit 2, and the settings a command uses come from them (flags over both)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from streamrec.cli import main

COMMANDS = {
    "data": ["data", "status"],
    "report": ["report", "--run-log", "run-log.jsonl", "--out", "r.html"],
    "evaluate --cold-start": ["evaluate", "--cold-start", "--dataset", "synthetic", "--limit", "10"],
}
BAD = {
    "missing": (None, "config file {cfg} does not exist (given with --config)"),
    "a directory": ("dir", "config file {cfg} cannot be read"),
    "not TOML": ("[kafka\n", "config file {cfg} is not valid TOML"),
    "a misspelled section": ('[kafak]\nbootstrap_servers = "x:1"\n', "unknown section [kafak]; did you mean [kafka]?"),
}


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run-log.jsonl").write_text("")


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_unusable_config_file_is_one_error_line_and_exit_2(command: str, case: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    content, expected = BAD[case]
    cfg = tmp_path / "c.toml"
    if content == "dir":
        cfg.mkdir()
    elif content is not None:
        cfg.write_text(content)
    assert main([*COMMANDS[command], "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"streamrec {command.split()[0]}: error: ") and err.count("\n") == 1, err
    assert expected.format(cfg=cfg) in err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_environment_variable_naming_no_section_is_exit_2(command: str, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("STREAMREC_KAFAK_BOOTSTRAP_SERVERS", "x:1")
    assert main(COMMANDS[command]) == 2
    assert "STREAMREC_KAFAK_BOOTSTRAP_SERVERS is not read" in capsys.readouterr().err


def test_report_reads_the_publish_root_and_deltas_dir_from_the_config_and_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from cache_refresh import run_records
    from monitor import recording, sections

    read: dict[str, Any] = {}
    monkeypatch.setattr(run_records, "read_last_run", lambda root: read.setdefault("root", Path(root)) and {})
    monkeypatch.setattr(recording, "read_deltas", lambda d: read.setdefault("deltas", Path(d)) and [])
    monkeypatch.setattr(sections, "SECTIONS", ())  # where it reads them is what this proves: the page with no plot
    (tmp_path / "c.toml").write_text('[refresh]\npublish_root = "pub_cfg"\n[learner]\ndeltas_dir = "deltas_cfg"\n')
    assert main([*COMMANDS["report"], "--config", "c.toml"]) == 0
    assert read == {"root": Path("pub_cfg"), "deltas": Path("deltas_cfg")}
    read.clear()
    monkeypatch.setenv("STREAMREC_LEARNER_DELTAS_DIR", "deltas_env")  # the environment over the file
    assert main([*COMMANDS["report"], "--config", "c.toml", "--publish-root", "pub_flag"]) == 0  # a flag over both
    assert read == {"root": Path("pub_flag"), "deltas": Path("deltas_env")}
    read.clear()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run-log.jsonl").write_text("")
    assert main(["report", "--run-dir", "run", "--out", "r.html", "--config", "c.toml"]) == 0  # --run-dir: a flag
    assert read == {"root": Path("run/serving"), "deltas": Path("run/deltas")}
    read.clear()
    monkeypatch.setenv("STREAMREC_REFRESH_KEEP_VERSIONS", "0")  # a bad value of a section it builds: exit 2
    assert main(COMMANDS["report"]) == 2
    assert "[refresh] keep_versions must be an integer >= 1" in capsys.readouterr().err


def test_cold_start_evaluation_takes_evaluate_settings_under_its_flags(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import learner.cold_start

    seen: dict[str, Any] = {}

    def fake(dataset: str, seed: int, *, config: dict[str, Any], cold: Any, **_: Any) -> dict[str, Any]:
        seen.update(config=config, batch_size=cold.batch_size)
        return {}

    monkeypatch.setattr(learner.cold_start, "evaluate_cold_start", fake)
    monkeypatch.setattr(learner.cold_start, "describe", lambda d: "")
    monkeypatch.setenv("STREAMREC_EVALUATE_MLP", "32,16")
    monkeypatch.setenv("STREAMREC_EVALUATE_BATCH_SIZE", "128")
    monkeypatch.setenv("STREAMREC_EVALUATE_LR_DENSE", "0.01")
    assert main([*COMMANDS["evaluate --cold-start"], "--lr-dense", "0.02"]) == 0
    assert seen == {"config": {"mlp": (32, 16), "lr_dense": 0.02}, "batch_size": 128}
    monkeypatch.setenv("STREAMREC_EVALUATE_REQUEST_TIME", "day")  # checked before any data loads: exit 2
    assert main(COMMANDS["evaluate --cold-start"]) == 2
    assert "request_time must be one of" in capsys.readouterr().err
    monkeypatch.delenv("STREAMREC_EVALUATE_REQUEST_TIME")  # one bad value at a time: each names its own setting
    assert main([*COMMANDS["evaluate --cold-start"], "--mlp", "4x4"]) == 2  # was a ValueError traceback
    assert "mlp: expected comma-separated layer widths" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--buckets", "0"], "buckets must be an integer >= 1, got 0"),  # was a ValueError traceback after the data loaded
    (["--capacity", "-1"], "capacity must be an integer >= 1, got -1"),
    (["--admit-after", "-2"], "admit_after must be an integer >= 0, got -2"),
    (["--cold-k", "-1"], "cold_k must be an integer >= 1, got -1"),  # ran: no sample cold, a NaN cold AUC
    (["--boost", "nan"], "boost must be a finite number >= 0, got nan"),  # ran: silently no boost
    (["--user-bucket-half-life-s", "-3"], "user_bucket_half_life_s must be a finite number > 0"),  # was "never"
    (["--new-user-session-s", "inf"], "synthetic_new_user_session_s must be a finite number >= 0"),
])
def test_cold_start_settings_out_of_range_are_a_usage_error_before_any_data_loads(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flags: list[str], message: str) -> None:
    import learner.cold_start

    def fake(*_: Any, **__: Any) -> dict[str, Any]:
        raise AssertionError("the evaluation ran with a setting out of range")

    monkeypatch.setattr(learner.cold_start, "evaluate_cold_start", fake)
    assert main([*COMMANDS["evaluate --cold-start"], *flags]) == 2
    assert f"[evaluate --cold-start] {message}" in capsys.readouterr().err
