"""The command line: every subcommand explains itself; errors are clear and exit non-zero."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamrec.cli import build_parser, main

SUBCOMMANDS = ["stack", "data", "replay", "audit", "join", "counts", "train", "evaluate", "serve", "monitor", "refresh",
               "report"]


def test_every_subcommand_is_listed_and_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    top = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in top
        with pytest.raises(SystemExit) as info:
            main([name, "--help"])
        assert info.value.code == 0
        text = capsys.readouterr().out
        assert "--config FILE" in text and "--json" in text and len(text.splitlines()) > 8


def test_parser_knows_no_other_subcommand() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert sorted(sub.choices) == sorted(SUBCOMMANDS)


def test_data_status_json_says_where_data_sets_are(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "status", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["datasets"]
    assert set(out) == {"ml-1m", "ml-100k"}
    assert all(v["installed"] and Path(v["path"]).is_dir() for v in out.values())


def test_bad_config_file_and_environment_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[replay]\nlimt = 5\n")
    assert main(["replay", "--config", str(cfg), "--no-progress"]) == 2
    assert "unknown key 'limt' in [replay]" in capsys.readouterr().err
    monkeypatch.setenv("STREAMREC_REPLAY_SEED", "seven")
    assert main(["replay", "--no-progress"]) == 2
    assert "STREAMREC_REPLAY_SEED: cannot use 'seven'" in capsys.readouterr().err


def test_unknown_dataset_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--dataset", "ml-20m", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "ml-20m" in err and "ml-1m" in err and "synthetic" in err


def test_config_file_values_reach_the_job(stack, kafka, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[kafka]\nbootstrap_servers = "{kafka.bootstrap_servers}"\nimpressions_topic = "{kafka.impressions_topic}"\n'
        f'clicks_topic = "{kafka.clicks_topic}"\n[replay]\ndataset = "synthetic"\nprogress = false\n'
        "[synthetic]\nimpressions = 1234\n"
    )
    assert main(["replay", "--config", str(cfg), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dataset"] == "synthetic" and out["impressions"] == 1234
    assert out["acked"][kafka.impressions_topic] == 1234
